"""Ctrl-C and SIGTERM during ``tvmfuse tune``: the first asks the run to stop at its next safe point, the second
aborts at once.

Why the signals are blocked in every thread and taken by one waiting thread instead of a plain handler:
MetaSchedule's builder and runner workers are subprocesses in the terminal's foreground process group, so a
Ctrl-C reaches each of them too and kills the trial it is building or timing, which MetaSchedule then records as
a failed trial. A subprocess starts with the signal mask of the thread that starts it, and every thread starts
with its creator's, so once SIGINT and SIGTERM are blocked here every thread and worker started later has them
blocked: the workers finish the trials in flight and only this process decides what a signal means. A thread
waiting in ``sigwait`` takes them; it runs even while the main thread is inside TVM's C++ code (TVM's FFI
releases the GIL there), so the second signal aborts without waiting for the main thread.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's status for a command ended by ``signum`` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


def kill_descendants() -> None:
    """SIGKILL every process this one started (the workers block SIGINT and SIGTERM, and an orphaned worker
    would keep the terminal's output open and print a broken-pipe traceback when its trial ends)."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001 - aborting: nothing left to report it to
        return
    for child in children:
        try:
            child.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass


class StopRequest:
    """Callable: True once the first SIGINT or SIGTERM has arrived. ``signum`` is that signal."""

    def __init__(self, on_first: Callable[[int], None], on_abort: Callable[[int], None]):
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._count = 0
        self._on_first, self._on_abort = on_first, on_abort
        self.signum: int | None = None

    def __call__(self) -> bool:
        return self._event.is_set()

    def signal(self, signum: int) -> None:
        with self._lock:
            self._count += 1
            first = self._count == 1
            if first:
                self.signum = signum
                self._event.set()
        if first:
            self._on_first(signum)
        else:
            self._on_abort(signum)


def abort(signum: int, message: str) -> None:
    """Print ``message`` on stderr, kill the workers and exit now with the signal's status (no cleanup: nothing
    half-measured is committed, and SQLite's write-ahead log drops a transaction cut short)."""
    text = message + "\n"
    stream = sys.stderr
    try:
        # straight to the descriptor: the main thread may be inside a write to the stream (its lock held).
        # sys.stderr's, not fd 2, which may be pointed at a capture of TVM's native log (tvmfuse.logs)
        fd = stream.fileno()
        if os.isatty(fd):
            text = "\x1b[?25h" + text  # the progress display hides the cursor; give it back
        os.write(fd, text.encode(errors="replace"))
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (an in-process runner)
        try:
            stream.write(text)
            stream.flush()
        except Exception:  # noqa: BLE001 - aborting: nowhere else to say it
            pass
    kill_descendants()
    os._exit(exit_code(signum))


@contextmanager
def stop_on_signal(on_first: Callable[[int], None], on_abort: Callable[[int], None]) -> Iterator[StopRequest]:
    """Within the block, the first SIGINT/SIGTERM sets the yielded :class:`StopRequest` and calls ``on_first``; a
    second calls ``on_abort`` (which should not return: see :func:`abort`). Outside the main thread, or where
    POSIX signal masks are missing, signals keep their usual meaning and the request is never set."""
    stop = StopRequest(on_first, on_abort)
    usable = (threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")
              and hasattr(signal, "sigwait"))
    if not usable:
        yield stop
        return
    old_handlers = {s: signal.getsignal(s) for s in SIGNALS}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    closing = threading.Event()

    def wait() -> None:
        while True:
            signum = signal.sigwait(SIGNALS)
            if closing.is_set():
                return
            stop.signal(signum)

    # A thread started before the block that does not block the signals itself may still take one: Python then
    # runs this in the main thread at its next Python instruction, and two signals that arrive before that count
    # as one. tvmfuse starts none (tvmfuse.logs' follower blocks them), so this is a fallback.
    for s in SIGNALS:
        signal.signal(s, lambda signum, frame: stop.signal(signum))
    waiter = threading.Thread(target=wait, name="tvmfuse-signals", daemon=True)
    waiter.start()
    try:
        yield stop
    finally:
        closing.set()
        if waiter.is_alive():
            signal.pthread_kill(waiter.ident, signal.SIGINT)  # blocked there: sigwait takes it, sees closing
        waiter.join(timeout=5)
        for s, handler in old_handlers.items():
            # once stopping, what is left is the summary and the exit: a signal then changes nothing, and must not
            # end the process by its default action half way through (exit -2 instead of 130)
            signal.signal(s, signal.SIG_IGN if stop() else (handler if handler is not None else signal.SIG_DFL))
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
