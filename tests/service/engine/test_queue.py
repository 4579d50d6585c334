"""The request queue alone: row accounting, the cap, discard and taking a batch that fits."""

import asyncio

import numpy as np
import pytest

from fusedserve.service.engine.queue import RequestQueue
from fusedserve.service.errors import QueueFull


def rows(n):
    return np.zeros((n, 3), dtype=np.float32)


async def test_take_pops_whole_requests_in_order_while_they_fit():
    queue = RequestQueue("m", max_rows=64)
    loop = asyncio.get_running_loop()
    items = [queue.put(rows(n), loop.create_future()) for n in (1, 3, 3, 2)]
    assert (queue.rows, len(queue), queue.oldest) == (9, 4, items[0])
    # 1 + 3 fit in 5 rows; the next 3-row request would not, so it waits whole and keeps its place.
    assert queue.take(5) == items[:2] and queue.rows == 5
    assert queue.take(5) == items[2:] and queue.rows == 0 and len(queue) == 0
    assert queue.take(5) == []


async def test_a_request_larger_than_the_batch_is_never_taken():
    queue = RequestQueue("m", max_rows=64)
    queue.put(rows(6), asyncio.get_running_loop().create_future())
    assert queue.take(5) == [] and queue.rows == 6


async def test_cap_refuses_with_retry_after_and_counts_rows_not_requests():
    queue = RequestQueue("digits", max_rows=4)
    loop = asyncio.get_running_loop()
    queue.put(rows(3), loop.create_future())
    with pytest.raises(QueueFull, match="'digits' has 3 rows queued \\(limit 4\\)") as info:
        queue.put(rows(2), loop.create_future())
    assert info.value.headers == {"Retry-After": "1"}
    queue.put(rows(1), loop.create_future())  # exactly at the cap
    assert queue.rows == 4


async def test_discard_frees_rows_once_and_ignores_taken_requests():
    queue = RequestQueue("m", max_rows=8)
    loop = asyncio.get_running_loop()
    first, second = (queue.put(rows(n), loop.create_future()) for n in (2, 3))
    queue.discard(second)
    queue.discard(second)
    assert queue.rows == 2 and len(queue) == 1
    assert queue.take(8) == [first]
    queue.discard(first)  # already in a batch: nothing to withdraw
    assert queue.rows == 0


async def test_clear_returns_everything_oldest_first():
    queue = RequestQueue("m", max_rows=8)
    loop = asyncio.get_running_loop()
    items = [queue.put(rows(1), loop.create_future()) for _ in range(3)]
    assert queue.clear() == items and queue.rows == 0 and len(queue) == 0
