"""TVM's RPC tracker and server, run in this process for ``tvmfuse rpc tracker`` and ``tvmfuse rpc server``.

TVM's ``Tracker`` and ``Server`` classes start a worker process and run the service there, on threads that
outlive the worker's parent: a killed ``python -m tvm.exec.rpc_server`` can leave that worker holding its port
and its place at the tracker. Here the same start functions run in this process, so stopping the command stops
the service (Ctrl-C and SIGTERM also end the sessions it forked).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from tvmfuse.rpc import RPCError
from tvmfuse.rpc.tracker import servers_under, summary


@dataclass
class Running:
    """A service started here: where it listens, and the thread that serves (its end is the service's end)."""

    host: str
    port: int
    thread: threading.Thread

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _quiet(name: str, verbose: bool) -> None:
    # TVM's tracker and server log each connection at INFO on their own handlers; kept for --verbose
    logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)


def _bind_error(what: str, host: str, port: int, port_end: int, err: Exception) -> RPCError:
    where = f"{host}:{port}" if port_end <= port + 1 else f"{host} (ports {port}-{port_end - 1})"
    text = getattr(err, "strerror", None) or str(err)
    return RPCError(f"cannot start the RPC {what} on {where}: {text}",
                    hint="is the port taken, or the address not one of this machine's? give another --port/--host")


def start_tracker(host: str = "127.0.0.1", port: int = 9190, *, verbose: bool = False) -> Running:
    """Start TVM's tracker listening on exactly ``host:port`` (a tracker that moved to another port would not be
    where its servers look for it)."""
    from tvm.rpc import tracker as tvm_tracker

    _quiet("RPCTracker", verbose)
    try:
        bound, _stop_key = tvm_tracker._popen_start_tracker_server(host, port, port + 1, not verbose)
    except (OSError, ValueError) as e:
        raise _bind_error("tracker", host, port, port + 1, e) from None
    return Running(host, bound, tvm_tracker.PopenTrackerServerState.current.thread)


def _survive_crashed_sessions(tvm_server) -> None:
    """Keep serving after a session whose process died (a kernel that crashed it): TVM's listen loop raises there
    and its thread ends, leaving a server still registered at the tracker that never serves again. The session's
    trial is the kernel's failure (``tvmfuse.rpc.measure``); the server goes on with the next one."""
    original = tvm_server._serving
    if getattr(original, "tvmfuse_survives", False):
        return

    def serving(sock, addr, opts, load_library):
        cwd = os.getcwd()
        try:
            original(sock, addr, opts, load_library)
        except RuntimeError as e:  # "Child process ... exited unsuccessfully"
            logging.getLogger("RPCServer").warning("a session from %s ended abnormally (%s); serving on", addr, e)
            os.chdir(cwd)  # the session's folder, which the loop would have left
            try:
                sock.close()
            except OSError:
                pass

    serving.tvmfuse_survives = True
    tvm_server._serving = serving


# The server forks a process per session, and CUDA cannot be used in a child forked from a process that had
# initialized it (cudaErrorInitializationError). Importing TVM does that where PyTorch is installed: tvm_ffi asks
# ``torch.cuda.is_available()`` for its DLPack bridge, which creates the CUDA driver's state. These variables turn
# that bridge off (the server never exchanges tensors with torch) and make torch's check use NVML.
CUDA_FREE_ENV = {"TVM_FFI_DISABLE_TORCH_C_DLPACK": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


def keep_cuda_out_of_this_process() -> None:
    """Set :data:`CUDA_FREE_ENV` for this process: call it before TVM is first imported, in a process that will
    run an RPC server (``tvmfuse rpc server`` does)."""
    for k, v in CUDA_FREE_ENV.items():
        os.environ.setdefault(k, v)


def start_server(tracker: tuple[str, int], key: str, *, host: str = "127.0.0.1", port: int = 9090,
                 port_end: int | None = None, wait_s: float = 15.0, verbose: bool = False) -> Running:
    """Start TVM's RPC server on the first free port of ``[port, port_end)``, registered at ``tracker`` under
    ``key``, answering tvmfuse's device question (``tvmfuse.rpc.device``); returns once the tracker lists it.

    The tracker is asked first: a wrong address is one line (RPCError), not TVM's 60 s of retries in a thread."""
    import sys

    if "tvm_ffi" not in sys.modules:
        keep_cuda_out_of_this_process()
    elif (any(os.environ.get(k) != v for k, v in CUDA_FREE_ENV.items()) and "torch" in sys.modules
          and os.path.exists("/dev/nvidiactl")):
        # TVM was imported beside torch before the variables were set: its sessions could not use this GPU
        raise RPCError("an RPC server must start in a process that has not imported TVM beside PyTorch "
                       "(its forked sessions could not use CUDA)",
                       hint="run `tvmfuse rpc server`, or call tvmfuse.rpc.service.keep_cuda_out_of_this_process() "
                            "before importing tvm")
    from tvm.rpc import server as tvm_server

    from tvmfuse.rpc.device import register_describe

    summary(*tracker, timeout=min(wait_s, 10.0))
    _quiet("RPCServer", verbose)
    end = port_end if port_end is not None else port + 100
    register_describe()  # before the server forks its first session
    from tvmfuse.nvcc_cache import install

    install()   # the sessions compile each candidate's CUDA source as they load it: through the cache
    _survive_crashed_sessions(tvm_server)
    try:
        bound = tvm_server._popen_start_rpc_server(host, port, end, False, tracker, key, None, None, not verbose)
    except (OSError, ValueError) as e:
        raise _bind_error("server", host, port, end, e) from None
    running = Running(host, bound, tvm_server.PopenRPCServerState.current.thread)
    deadline = time.monotonic() + wait_s
    while True:
        listed = servers_under(*tracker, key, timeout=min(wait_s, 10.0))
        if any(s.endswith(f":{bound}") for s in listed):
            return running
        if not running.thread.is_alive():
            raise RPCError(f"the RPC server on {host}:{bound} stopped before it registered at "
                           f"{tracker[0]}:{tracker[1]}")
        if time.monotonic() >= deadline:
            raise RPCError(f"the RPC server on {host}:{bound} did not register at {tracker[0]}:{tracker[1]} "
                           f"within {wait_s:g} s")
        time.sleep(0.2)


def serve_until_stopped(running: Running, on_stop=None, announce=None) -> str:
    """Block until the service's thread ends (returns why) or SIGINT/SIGTERM arrives (returns the signal's name);
    the caller then exits with ``os._exit`` (the service's threads are not daemons and never end by themselves).
    ``announce``: called once the signals are caught, so a SIGTERM sent as soon as the service says it is ready
    stops it cleanly (sent before, it killed the process: exit -15, 2 runs in 11 of the tracker test)."""
    import signal

    got: list[str] = []

    def stop(signum, _frame):
        got.append(signal.Signals(signum).name)

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if announce is not None:
            announce()
        while not got and running.thread.is_alive():
            running.thread.join(0.5)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if on_stop is not None:
        on_stop()
    return got[0] if got else "stopped"


def end_sessions() -> None:
    """End the sessions this process forked (each runs until its client closes it or its timeout)."""
    try:
        import psutil

        for child in psutil.Process(os.getpid()).children(recursive=True):
            try:
                child.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
    except Exception:  # noqa: BLE001 - without psutil the sessions end at their own timeouts
        pass
