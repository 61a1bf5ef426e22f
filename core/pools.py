"""A thread pool that still works while the interpreter exits, and a background save's future
whose failure is reported at exit if no one received it."""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import threading
import warnings
from concurrent.futures import Future
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


class SaveFuture(Future):
    """A background save's future. One that failed with no one asking for its result
    (a script that ended without ``wait()``) is reported at exit, on stderr: there is no
    caller left to raise it to, and the checkpoint the run counted on is not there."""

    # What the exit report says of each failure not yet raised to a caller, by future:
    # not the futures themselves, whose errors' tracebacks hold the failed save's staged
    # state (a copy of the whole state) and its writer for as long as they live.
    _undelivered_failures: dict[int, tuple[str, str]] = {}
    _undelivered_lock = threading.Lock()
    _numbers = itertools.count()

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.error_delivered = False  # the save's error reached a caller, through result() or exception()
        self._number = next(SaveFuture._numbers)
        self.add_done_callback(SaveFuture._note_if_undelivered)
        # The save runs from the start and nothing can stop it, so cancel() is refused, as for any running
        # future: cancelled, the future would fail the save's completion (InvalidStateError), have wait()
        # raise CancelledError for a save that goes on, and let the next save start beside it.
        self.set_running_or_notify_cancel()

    def _note_if_undelivered(self) -> None:
        error = Future.exception(self)
        if error is None:
            return
        with SaveFuture._undelivered_lock:
            if not self.error_delivered:
                SaveFuture._undelivered_failures[self._number] = (self.path, f"{type(error).__name__}: {error}")

    def _delivered(self) -> None:
        with SaveFuture._undelivered_lock:
            self.error_delivered = True
            SaveFuture._undelivered_failures.pop(self._number, None)

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        except BaseException as exc:
            # The save's own error, not this call's timeout (the save may fail just after it).
            if self.done() and exc is Future.exception(self):
                self._delivered()
            raise

    def report_if_undelivered(self) -> None:
        """A failure no caller has had (through ``result()``, ``exception()``), as a
        ``RuntimeWarning`` naming the checkpoint; then it counts as delivered."""
        error = Future.exception(self)
        if error is not None and not self.error_delivered:
            self._delivered()
            warnings.warn(f"the background save to {self.path} failed: {type(error).__name__}: {error}",
                          RuntimeWarning, stacklevel=5)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)
        if error is not None:
            self._delivered()
        return error

    @classmethod
    def report_undelivered(cls) -> None:
        with cls._undelivered_lock:
            failures, cls._undelivered_failures = cls._undelivered_failures, {}
        for path, error in failures.values():
            # Named by the checkpoint, not by this line: the source line would be all a reader saw.
            warnings.warn_explicit(f"the background save to {path} failed and no one waited for it: {error}",
                                   RuntimeWarning, path, 0)


atexit.register(SaveFuture.report_undelivered)


__all__ = ["SaveFuture", "ThreadPool"]
