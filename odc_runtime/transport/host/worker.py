"""The host transport's asynchronous operations: one worker thread, FIFO, errors kept until ``quiet``."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError

from odc_runtime.errors import OdcTimeoutError
from odc_runtime.transport.base import Work


class FutureWork(Work):
    """Handle of a function running on the worker thread."""

    def __init__(self, future: Future, default_timeout: float, what: str) -> None:
        self._future = future
        self._timeout = default_timeout
        self._what = what

    def wait(self, timeout: float | None = None) -> None:
        limit = self._timeout if timeout is None else timeout
        try:
            self._future.result(timeout=limit)
        except FutureTimeoutError:
            # Since Python 3.11 this is the builtin TimeoutError, which OdcTimeoutError derives from: an operation
            # that itself raised a timeout is done, and its error is what to report.
            if self._future.done():
                raise
            # The operation goes on: this wait gave up, the operation did not fail. Issuing it again would do it
            # twice (a push would be added twice), so the error says to wait again instead (docs/design.md,
            # "Fail-stop": handle timeouts).
            raise OdcTimeoutError(
                f"odc {self._what}: the operation did not complete within {limit:g} s and is still running (it has "
                "not failed: it completes on its own, and sync() waits for it). Do not issue it again (a push would "
                "be added twice): call wait() again or sync()"
            ) from None

    def is_completed(self) -> bool:
        return self._future.done()


class AsyncWorker:
    """Runs submitted functions on one thread in issue order; ``quiet`` waits for all and reports failures."""

    def __init__(self, rank: int, timeout: float) -> None:
        self._rank = rank
        self._timeout = timeout
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def submit(self, fn: Callable[[], None], what: str) -> Work:
        """Run ``fn`` on the worker thread (FIFO: asynchronous operations complete in issue order)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="odc-host")
        future = self._executor.submit(fn)
        # Keep failed operations until quiet() reports them: a failed push must not vanish silently.
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append(future)
        return FutureWork(future, self._timeout, f"async {what}")

    def quiet(self) -> None:
        """Wait for every submitted operation; then re-raise the first error of one that failed since the last
        quiet (so ``sync`` cannot report success after a lost push)."""
        error = self.wait_all()
        if error is not None:
            raise error

    def wait_all(self) -> BaseException | None:
        """Wait for every submitted operation and return the first error of one that failed since the last call
        (each failure is reported once), or ``None``.

        Anything that ends the *wait* itself propagates and forgets nothing: an interrupt (``KeyboardInterrupt``,
        or any exception a signal handler raises while this thread waits) or this wait's own timeout leaves every
        operation that is still running or failed unreported in the pending list, so the next call waits for them
        again. Dropping them would let a retried ``sync`` meet its peers while a push is still adding
        (docs/design.md, "Fail-stop": an interrupt inside quiet is atomic)."""
        pending, self._pending = self._pending, []
        deadline = time.monotonic() + self._timeout
        error: BaseException | None = None
        try:
            for future in pending:
                try:
                    future.result(timeout=max(0.0, deadline - time.monotonic()))
                except BaseException as e:
                    if future.done() and future.exception() is e:  # the operation's own failure (a timeout too)
                        error = error or e
                        continue
                    if isinstance(e, FutureTimeoutError):  # our wait ran out, the operation still runs
                        raise OdcTimeoutError(
                            f"odc quiet on rank {self._rank}: async operations still running after "
                            f"{self._timeout:g} s"
                        ) from None
                    raise  # an interrupt of this wait: not the operation's outcome
        except BaseException:
            # Keep what was not reported yet (still running, or failed): the next quiet waits for / reports it.
            kept = [f for f in pending if not f.done() or f.exception() is not None]
            self._pending = kept + self._pending
            raise
        return error

    def shutdown(self) -> None:
        """Wait for the running operations, then stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=False)
