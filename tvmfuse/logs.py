"""TVM's native log output, kept off the user's terminal unless asked for.

TVM's C++ ``LOG(WARNING)`` writes straight to file descriptor 2 (``std::cerr``), from this process and from
MetaSchedule's builder and runner workers, which inherit it. Python's ``logging`` and ``warnings`` filters
never see those writes, so the only place to catch them is the descriptor itself.

:func:`capture_native_stderr` points fd 2 at a temporary file for the duration of a command while
``sys.stderr`` (what rich's ``Console(stderr=True)``, ``print(file=sys.stderr)``, tracebacks and Python
logging write through) becomes a text stream over a duplicate of the terminal's descriptor: tvmfuse's own
progress bars and ``error:`` lines stay live, and only native writes land in the file. A thread follows the
file as it grows: TVM log messages are counted (one summary line on exit); TVM errors and anything that is
not a TVM log message (a worker's traceback, LLVM's own warnings) are passed on to the terminal as they come.

The file is read with ``pread`` at the thread's own position and never through a pipe: a pipe's writer
blocks once the pipe is full, and a reader that needs the GIL while native code holds it would never drain
it. A regular file never blocks its writers; the thread only falls behind.
"""
from __future__ import annotations

import faulthandler
import io
import logging
import os
import re
import signal
import sys
import tempfile
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

# TVM's LogMessage header (include/tvm/runtime/logging.h): "[HH:MM:SS] file:line: " then "Debug: ",
# "Warning: ", "Error: " or, for LOG(INFO), nothing
TVM_LOG_HEADER = re.compile(rb"^\[\d\d:\d\d:\d\d\] \S+:\d+: (?:(Debug|Warning|Error): )?")

# TVM errors are shown even without --verbose: unlike its warnings they say something went wrong
SHOWN_LEVELS = frozenset({"error"})

_POLL_S = 0.1
# raised by the faulting thread itself: blocking them would turn a fault into a silent kill
_FAULTS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP, signal.SIGABRT, signal.SIGSYS}


@dataclass
class NativeLog:
    """What native code wrote to fd 2 while captured.

    Attributes
    ----------
    counts : TVM log messages by level ("warning", "info", "debug", "error")
    shown : the bytes passed on to the terminal (TVM errors and everything that is not a TVM log message)
    captured : whether fd 2 was captured at all (not with ``verbose``, nor when fd 2 cannot be duplicated)
    """

    counts: Counter = field(default_factory=Counter)
    shown: bytearray = field(default_factory=bytearray)
    captured: bool = False
    _in_tvm: str | None = field(default=None, repr=False)  # level of the TVM message the next lines may continue

    def feed(self, line: bytes) -> bool:
        """Sort one captured line (with its newline): True when it is to be shown.

        A TVM message can span lines (an IR dump after the header): indented and empty lines that follow
        one belong to it. Any other line is not TVM's.
        """
        head = TVM_LOG_HEADER.match(line)
        if head:
            self._in_tvm = (head.group(1) or b"Info").decode().lower()
            self.counts[self._in_tvm] += 1
            return self._in_tvm in SHOWN_LEVELS
        if self._in_tvm is not None and (not line.strip() or line[:1] in (b" ", b"\t")):
            return self._in_tvm in SHOWN_LEVELS
        self._in_tvm = None
        return True

    @property
    def hidden(self) -> int:
        """TVM log messages kept off the terminal."""
        return sum(n for level, n in self.counts.items() if level not in SHOWN_LEVELS)

    def summary(self) -> str | None:
        """The one line that stands for the hidden messages, or None when there were none."""
        hidden = {level: n for level, n in self.counts.items() if level not in SHOWN_LEVELS and n}
        if not hidden:
            return None
        total = sum(hidden.values())
        plural = "s" if total != 1 else ""
        if set(hidden) == {"warning"}:
            what = f"{total} warning{plural}"
        else:
            parts = ", ".join(f"{hidden[lv]} {lv}" + ("s" if lv == "warning" and hidden[lv] != 1 else "")
                              for lv in ("warning", "info", "debug") if lv in hidden)
            what = f"{total} log message{plural} ({parts})"
        return f"note: TVM printed {what} (rerun with --verbose to see them)"


class _Follower(threading.Thread):
    """Reads the capture file as it grows and passes the lines to be shown to ``emit``."""

    def __init__(self, fd: int, log: NativeLog, emit: Callable[[bytes], None]):
        super().__init__(name="tvmfuse-native-stderr", daemon=True)
        self.fd, self.log, self.emit = fd, log, emit
        self.pos = 0
        self.partial = b""
        self.done = threading.Event()
        self.lock = threading.Lock()  # the last pump, on exit, runs in the caller's thread

    def run(self) -> None:
        # a signal sent to the process goes to any thread that does not block it: this one never takes one, so
        # the main thread (or a thread that waits for signals in sigwait, as tvmfuse.cli.interrupt's does) does
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - _FAULTS)
        while not self.done.wait(_POLL_S):
            try:
                self.pump()
            except Exception:  # noqa: BLE001 - stop following; the last pump, on exit, reads the rest
                return

    def pump(self, final: bool = False) -> None:
        with self.lock:
            lines = (self.partial + self._read_new()).split(b"\n")
            self.partial = lines.pop()  # what follows the last newline: a line still being written
            if final and self.partial:
                lines.append(self.partial)  # nothing more will come: shown with a newline of its own
                self.partial = b""
            out = bytearray()
            for line in lines:
                line += b"\n"
                if self.log.feed(line):
                    out += line
            if out:
                self.log.shown += out
                self.emit(bytes(out))

    def _read_new(self) -> bytes:
        chunks = []
        size = os.fstat(self.fd).st_size
        while self.pos < size:
            chunk = os.pread(self.fd, min(size - self.pos, 1 << 20), self.pos)
            if not chunk:
                break
            chunks.append(chunk)
            self.pos += len(chunk)
        return b"".join(chunks)

    def finish(self) -> None:
        self.done.set()
        self.join()
        self.pump(final=True)


def _retarget_handlers(old, new) -> None:
    """Point Python logging handlers that write to ``old`` at ``new`` (handlers made before the swap hold the
    stream object itself, not ``sys.stderr``)."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and h.stream is old:
                h.setStream(new)


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return None


def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@contextmanager
def capture_native_stderr(*, verbose: bool = False) -> Iterator[NativeLog]:
    """Capture what native code writes to fd 2 for the duration of the block; see the module's docstring.

    With ``verbose`` nothing is captured: TVM's messages reach the terminal as they are written, in order
    with everything else. The yielded :class:`NativeLog` fills in as the block runs and is complete on exit,
    when the summary line (if any TVM message was hidden) goes to ``sys.stderr``.
    """
    log = NativeLog()
    if verbose or not hasattr(os, "pread"):  # no pread (Windows): the capture could not be followed
        yield log
        return
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 to capture (closed by the caller)
        yield log
        return
    log.captured = True
    capture = tempfile.TemporaryFile(prefix="tvmfuse-stderr-")
    old_stderr = sys.stderr
    # only a sys.stderr that writes to fd 2 is moved over to the saved descriptor; another one (typer's
    # CliRunner, a Jupyter kernel's stream) does not reach fd 2 and is left as it is
    swap = old_stderr is not None and _fileno(old_stderr) == 2
    ours = None
    # a crash in native code kills the process before the rest of the capture is read: the Python traceback of
    # where it happened goes to the terminal instead (a fault handler the caller enabled is left as it is)
    fault = swap and not faulthandler.is_enabled()

    def emit(data: bytes) -> None:
        # through rich's live display when one wraps ours, so that it moves the lines above itself
        stream = sys.stderr if getattr(sys.stderr, "rich_proxied_file", None) is ours else ours
        if ours is not None and not ours.closed:
            try:
                stream.write(data.decode(ours.encoding, errors="backslashreplace"))
                stream.flush()
                return
            except (OSError, ValueError):
                pass
        _write_fd(saved, data)

    follower = _Follower(capture.fileno(), log, emit)
    try:
        if swap:
            old_stderr.flush()
            ours = io.TextIOWrapper(io.FileIO(saved, "w", closefd=False),
                                    encoding=old_stderr.encoding or "utf-8",
                                    errors=old_stderr.errors or "backslashreplace",
                                    line_buffering=True, write_through=True)
        os.dup2(capture.fileno(), 2)
        if ours is not None:
            sys.stderr = ours
            _retarget_handlers(old_stderr, ours)
        if fault:
            faulthandler.enable(file=ours)
        follower.start()
        yield log
    finally:
        try:
            if follower.is_alive():
                follower.finish()
            else:
                follower.pump(final=True)
        finally:
            if ours is not None:
                ours.flush()
            os.dup2(saved, 2)
            if ours is not None:
                sys.stderr = old_stderr
                _retarget_handlers(ours, old_stderr)
                ours.close()  # a stale reference now raises instead of writing to whatever reuses the number
            if fault:
                faulthandler.disable()
            os.close(saved)
            capture.close()
        note = log.summary()
        if note and sys.stderr is not None:
            print(note, file=sys.stderr, flush=True)
