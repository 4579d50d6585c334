"""How a request waits for its answer: a deadline and the client's leaving end the wait by callbacks
on the answer's future, with no task or wait set per request. Shared by the batcher (in process), the
engine process's ``LocalEngine.submit`` and the front ends' ``RemoteEngine`` (across processes)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fusedserve.service.errors import ClientGone, DeadlineExceeded


async def wait_answer(future: asyncio.Future, model: str, timeout_s: float | None, abandon: asyncio.Future | None,
                      give_up: Callable[[Exception | None], None], slack_s: float = 0.0):
    """``future``'s result. ``give_up(error)`` ends it: DeadlineExceeded ``timeout_s`` (+ ``slack_s``)
    after now, ClientGone once ``abandon`` is done, None (cancel) if our caller is cancelled."""
    timer = None if timeout_s is None else deadline(future, model, timeout_s, give_up, slack_s)
    gone = None
    if abandon is not None:
        def gone(_):
            give_up(ClientGone(f"client disconnected before model {model!r} answered"))
        abandon.add_done_callback(gone)
    try:
        return await future
    finally:
        if timer is not None:
            timer.cancel()
        if gone is not None:
            abandon.remove_done_callback(gone)
        if not future.done():  # our caller was cancelled
            give_up(None)


def deadline(future: asyncio.Future, model: str, timeout_s: float, give_up: Callable[[Exception | None], None],
             slack_s: float = 0.0) -> asyncio.TimerHandle:
    """Calls ``give_up(DeadlineExceeded)`` ``timeout_s`` (+ ``slack_s``) from now unless cancelled first."""
    return future.get_loop().call_later(timeout_s + slack_s, _expire, model, timeout_s, give_up)


def _expire(model: str, timeout_s: float, give_up: Callable[[Exception | None], None]) -> None:
    give_up(DeadlineExceeded(f"no answer from model {model!r} within {timeout_s * 1000:.0f} ms; "
                             "raise the timeout or retry when the server is less loaded"))
