"""One trial measured on an RPC server, in a worker process of ``tvmfuse.rpc.runner``: MetaSchedule's RPC
runner's steps (ask the tracker for a server, upload, load, allocate, time, clean up), with two differences:
the answer names the server, and it says whether a failure is the kernel's or the server's.

The answer is ``(status, server, payload)``:
  ``ok``     payload is the run times (seconds);
  ``error``  the kernel failed on a live server (an exception from its run, or the server ending the session at
             its timeout, or the kernel crashing its session while the server lived on): a failed trial, as
             MetaSchedule's runners report one;
  ``lost``   the server did not get to run it or died with it (no server free, the connection refused or
             closed, the server gone from the tracker, no answer): the trial says nothing of the kernel;
  ``gone``   lost, and no server is left to run any trial (none registered under the key, or no tracker).
"""
from __future__ import annotations

import time

# what the server says when it ends a session at its timeout (tvm/rpc/server.py): the kernel ran too long
_SESSION_TIMEOUT = "RPCSessionTimeoutError"
# how long a server whose connection closed has to leave the tracker before the kernel is blamed for the crash
_GONE_GRACE_S = 3.0


def _line(err: BaseException | str) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(err).__name__)[:300]


def _why(err: BaseException) -> str:
    """Why a session failed, in words: TVM reports a connection closed under it as a failed check of its
    protocol (``Check failed: (code == RPCCode::kReturn) is false: code=kShutdown``)."""
    text = str(err)
    if "RPCCode::kReturn" in text or "kShutdown" in text or "connection reset" in text.lower():
        return "its connection closed"
    return _line(err)


def _alloc(session, device, args_info) -> list:
    """The trial's arguments on the server's device: floats random (TVM's measuring fill), integers and
    booleans zero (an index every gather accepts; see tvmfuse.tune.measure_args)."""
    import numpy as np
    import tvm

    fill = session.get_function("tvm.contrib.random.random_fill_for_measure")
    args = []
    for kind, dtype, shape in args_info:
        if kind != "TENSOR":
            raise NotImplementedError(kind)
        arr = tvm.runtime.empty(shape=shape, dtype=dtype, device=device)
        if str(dtype).startswith(("float", "bfloat")):
            fill(arr)
        else:
            arr.copyfrom(np.zeros(shape, dtype=dtype))
        args.append(arr)
    return args


def _alive(session) -> bool:
    """Whether the session still answers (a kernel's exception leaves it answering; a dead server does not).
    A round trip: a device's ``exist`` is answered without one once the session has died."""
    try:
        session.get_function("runtime.NumThreads")()
        return True
    except Exception:  # noqa: BLE001 - any failure to answer is a dead session
        return False


def _still_registered(tracker: tuple[str, int], key: str, server: str) -> bool:
    """Whether ``server`` stays registered under ``key`` for ``_GONE_GRACE_S`` (a server that died leaves the
    tracker as soon as the tracker sees its connection close)."""
    from tvmfuse.rpc.tracker import servers_under

    deadline = time.monotonic() + _GONE_GRACE_S
    while True:
        try:
            if server not in servers_under(*tracker, key, timeout=5.0):
                return False
        except Exception:  # noqa: BLE001 - the tracker itself is gone: nothing says the server lives
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.25)


def measure(tracker: tuple[str, int], key: str, session_timeout_s: float, queue_timeout_s: float,
            evaluator: tuple, artifact_path: str, device_type: str, args_info, claim_path: str | None = None):
    """Measure one built candidate on a server under ``key``; see the module for the answer."""
    import os.path as osp

    from tvm import rpc
    from tvm.s_tir.meta_schedule.runner.config import EvaluatorConfig
    from tvm.s_tir.meta_schedule.runner.utils import run_evaluator_common

    from tvmfuse.rpc import RPCError
    from tvmfuse.rpc.tracker import NoFreeServer, NoServer, request_server

    try:
        url, port, matchkey = request_server(*tracker, key, timeout=queue_timeout_s)
    except NoServer as e:
        return "gone", None, str(e)
    except NoFreeServer as e:
        return "lost", None, str(e)
    except RPCError as e:  # the tracker itself
        return "gone", None, str(e)
    server = f"{url}:{port}"
    if claim_path:  # the runner reads it when this worker is killed at the pool's timeout
        with open(claim_path, "w", encoding="utf-8") as f:
            f.write(server)
    session = remote_name = None
    clean = True  # False once the session is dead or hung: cleaning up would wait on it
    try:
        try:
            session = rpc.connect(url, port, matchkey, session_timeout=session_timeout_s)
            device = session.device(device_type, 0)
            remote_name = osp.basename(artifact_path)
            session.upload(artifact_path, remote_name)
            module = session.load_module(remote_name)
        except Exception as e:  # noqa: BLE001 - no session, or one that could not take the module
            clean = session is not None and _alive(session)
            if _SESSION_TIMEOUT in str(e):
                return "lost", server, f"the server did not load the module within {session_timeout_s:g} s"
            if not clean and not _still_registered(tracker, key, server):
                return "lost", server, f"the server went away before the trial ran ({_why(e)})"
            return "lost", server, f"could not run it there: {_why(e)}"
        try:
            args = _alloc(session, device, args_info)
            secs = run_evaluator_common(module, device, EvaluatorConfig(*evaluator), [args])
        except Exception as e:  # noqa: BLE001 - the kernel's failure, or the server's death: told apart below
            text = str(e)
            if _SESSION_TIMEOUT in text:
                clean = False  # the server closed it
                return "error", server, f"timeout: the server ended the session after {session_timeout_s:g} s"
            if _alive(session):
                return "error", server, text
            clean = False
            if _still_registered(tracker, key, server):
                return "error", server, f"the kernel crashed its RPC session (the server lived on): {_why(e)}"
            return "lost", server, f"the server went away during the trial ({_why(e)})"
        return "ok", server, [float(s) for s in secs]
    finally:
        if clean and session is not None and remote_name is not None:
            try:  # MetaSchedule's cleanup: the uploaded file, its linked library, the session's folder
                session.remove(remote_name)
                session.remove(remote_name + ".so")
                session.remove("")
            except Exception:  # noqa: BLE001 - a dead session has nothing left to clean
                pass
