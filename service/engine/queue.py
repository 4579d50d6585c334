"""The requests waiting for one model: a bounded FIFO counted in rows."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from fusedserve.service.errors import QueueFull


@dataclass(slots=True, eq=False)  # eq=False: the queue finds an item by identity
class Pending:
    x: np.ndarray  # [rows, in] float32
    future: asyncio.Future
    enqueued: float  # time.monotonic()
    origin: int = 0  # who sent it: the front-end connection in the engine process of --workers N
    requests: int = 1  # client requests its rows answer (a front end's group, in the engine process)

    @property
    def rows(self) -> int:
        return self.x.shape[0]


class RequestQueue:
    """Pending requests of one model in arrival order, at most ``max_rows`` rows in all.

    ``put`` refuses a request that would pass the cap (``QueueFull``, 503 with Retry-After);
    ``discard`` withdraws one not yet taken (a deadline or a client gone); ``take`` pops the oldest
    requests while they fit a batch, never splitting or reordering one.
    """

    def __init__(self, model: str, max_rows: int):
        self.model = model
        self.max_rows = max_rows
        self._items: deque[Pending] = deque()
        self._rows = 0

    @property
    def rows(self) -> int:
        """Rows queued, all requests together."""
        return self._rows

    def __len__(self) -> int:
        return len(self._items)

    @property
    def oldest(self) -> Pending:
        return self._items[0]

    def put(self, x: np.ndarray, future: asyncio.Future, origin: int = 0, requests: int = 1) -> Pending:
        rows = x.shape[0]
        if self._rows + rows > self.max_rows:
            raise QueueFull(
                f"model {self.model!r} has {self._rows} rows queued (limit {self.max_rows}); retry shortly",
                headers={"Retry-After": "1"})
        item = Pending(x, future, time.monotonic(), origin, requests)
        self._items.append(item)
        self._rows += rows
        return item

    def discard(self, item: Pending) -> None:
        """Withdraw ``item`` if it is still queued (once taken into a batch, its answer is dropped)."""
        try:
            self._items.remove(item)
        except ValueError:
            return
        self._rows -= item.rows

    def take(self, max_rows: int) -> list[Pending]:
        """Pop requests in order while they fit ``max_rows``; a request is never split across batches."""
        batch, rows = [], 0
        while self._items:
            n = self._items[0].rows
            if rows + n > max_rows:
                break
            batch.append(self._items.popleft())
            self._rows -= n
            rows += n
        return batch

    def clear(self) -> list[Pending]:
        """Empty the queue; returns what it held, oldest first."""
        items, self._items, self._rows = list(self._items), deque(), 0
        return items
