"""A thread pool that still works while the interpreter exits."""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import thread as _futures_thread
from typing import Any, Callable


def _exiting() -> bool:
    # concurrent.futures' own flag: set by its exit hook, which stops new work and then
    # joins the threads still running.
    return bool(getattr(_futures_thread, "_shutdown", False))


class ThreadPool(concurrent.futures.ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` that, once the interpreter is exiting, runs each call in
    the caller's thread instead of refusing it.

    At exit Python lets running threads finish (torch's ``dcp.async_save`` executor,
    Lightning's and Orbax's background saves, a thread the program started), but only
    after ``concurrent.futures`` has stopped taking work: a save still running then,
    which spreads its files over a pool, failed with "cannot schedule new futures after
    interpreter shutdown", and since nobody waits for a background save at exit, its
    checkpoint was lost without a word. Run in the caller's thread, it completes (one
    file at a time)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        if not _exiting():
            try:
                return super().submit(fn, *args, **kwargs)
            except RuntimeError:
                if not _exiting():  # this pool shut down: the caller's mistake, as before
                    raise
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # delivered as a pool's future delivers it
            future.set_exception(exc)
        return future


__all__ = ["ThreadPool"]
