"""Talking to TVM's RPC tracker with a bound on every wait.

TVM's own client (``rpc.connect_tracker``) retries a refused connection for 60 s and then waits without limit
for a server under a key; a wrong address or an empty key would hang ``tune``. These calls speak the same
protocol (``tvm.rpc.base``: a magic number, then length-prefixed JSON) on a socket with a timeout.
"""
from __future__ import annotations

import socket
import struct
import time

from tvmfuse.rpc import RPCError


class NoFreeServer(RPCError):
    """No server under the key became free in time."""


class NoServer(NoFreeServer):
    """No server is registered under the key."""


def _base():
    from tvm.rpc import base

    return base


def _open(host: str, port: int, timeout: float) -> socket.socket:
    base = _base()
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        raise RPCError(f"the RPC tracker at {where} did not answer within {timeout:g} s") from None
    except OSError as e:
        raise RPCError(f"cannot reach the RPC tracker at {where}: {e.strerror or e}",
                       hint="is `tvmfuse rpc tracker` running there?") from None
    try:
        sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
        magic = struct.unpack("<i", base.recvall(sock, 4))[0]
    except (OSError, struct.error) as e:
        sock.close()
        raise RPCError(f"{where} is not an RPC tracker (no answer to the tracker handshake: {e})") from None
    if magic != base.RPC_TRACKER_MAGIC:
        sock.close()
        raise RPCError(f"{where} is not an RPC tracker (it answered the handshake with something else)")
    return sock


def tracker_call(host: str, port: int, message: list, *, timeout: float = 10.0):
    """Send one request to the tracker and return its answer; RPCError when it cannot be reached in time."""
    base = _base()
    sock = _open(host, port, timeout)
    try:
        base.sendjson(sock, message)
        return base.recvjson(sock)
    except socket.timeout:
        raise RPCError(f"the RPC tracker at {host}:{port} did not answer within {timeout:g} s") from None
    except (OSError, ValueError) as e:
        raise RPCError(f"the RPC tracker at {host}:{port} dropped the connection: {e}") from None
    finally:
        sock.close()


def summary(host: str, port: int, *, timeout: float = 10.0) -> dict:
    """The tracker's summary: ``{"queue_info": {key: {"free", "pending"}}, "server_info": [{"key":
    "server:KEY", "addr": [host, port]}, ...]}``."""
    base = _base()
    reply = tracker_call(host, port, [base.TrackerCode.SUMMARY], timeout=timeout)
    if not isinstance(reply, list) or not reply or reply[0] != base.TrackerCode.SUCCESS:
        raise RPCError(f"the RPC tracker at {host}:{port} gave no summary ({str(reply)[:80]})")
    return reply[1]


def servers_by_key(info: dict) -> dict[str, dict]:
    """The summary per key: ``{key: {"servers": ["host:port", ...], "free": n, "pending": n}}``, keys sorted."""
    keys: dict[str, dict] = {}
    for item in info.get("server_info", []):
        kind, _, key = str(item.get("key", "")).partition(":")
        if kind != "server":
            continue
        addr = item.get("addr") or [None, None]
        keys.setdefault(key, {"servers": [], "free": 0, "pending": 0})["servers"].append(f"{addr[0]}:{addr[1]}")
    for key, queue in (info.get("queue_info") or {}).items():
        entry = keys.setdefault(key, {"servers": [], "free": 0, "pending": 0})
        entry["free"], entry["pending"] = int(queue.get("free", 0)), int(queue.get("pending", 0))
    for entry in keys.values():
        entry["servers"].sort()
    return dict(sorted(keys.items()))


def servers_under(host: str, port: int, key: str, *, timeout: float = 10.0) -> list[str]:
    """``host:port`` of every server registered under ``key``."""
    return servers_by_key(summary(host, port, timeout=timeout)).get(key, {}).get("servers", [])


def wait_for_servers(host: str, port: int, key: str, *, timeout: float = 10.0, poll_s: float = 0.5) -> list[str]:
    """The servers under ``key``, waiting up to ``timeout`` for the first to register; RPCError when the tracker
    cannot be reached or no server registers in time (the keys it has are named)."""
    deadline = time.monotonic() + timeout
    while True:
        info = summary(host, port, timeout=timeout)
        found = servers_by_key(info)
        if found.get(key, {}).get("servers"):
            return found[key]["servers"]
        if time.monotonic() >= deadline:
            others = [k for k, v in found.items() if v["servers"]]
            known = f"; it has servers under {', '.join(others)}" if others else "; it has no server at all"
            raise RPCError(f"no RPC server registered under key '{key}' at the tracker {host}:{port} within "
                           f"{timeout:g} s{known}",
                           hint=f"start one with `tvmfuse rpc server --tracker {host}:{port} --key {key}`")
        time.sleep(poll_s)


def request_server(host: str, port: int, key: str, *, timeout: float) -> tuple[str, int, str]:
    """Ask the tracker for a free server under ``key``: (address, port, match key) for ``rpc.connect``.

    The tracker queues the request until a server under the key is free; past ``timeout`` the request is given
    up (closing the socket takes it off the tracker's queue) and NoFreeServer is raised. A key with no server
    registered at all fails at once (NoServer); a tracker that cannot be reached raises RPCError."""
    base = _base()
    if not servers_under(host, port, key, timeout=min(timeout, 10.0)):
        raise NoServer(f"no server is registered under key '{key}' at {host}:{port}")
    sock = _open(host, port, min(timeout, 10.0))
    try:
        sock.settimeout(timeout)
        base.sendjson(sock, [base.TrackerCode.REQUEST, key, "", 1])
        reply = base.recvjson(sock)
    except socket.timeout:
        raise NoFreeServer(f"no server under key '{key}' became free within {timeout:g} s") from None
    except (OSError, ValueError) as e:
        raise RPCError(f"the RPC tracker at {host}:{port} dropped the connection: {e}") from None
    finally:
        sock.close()
    if not isinstance(reply, list) or reply[0] != base.TrackerCode.SUCCESS:
        raise RPCError(f"the RPC tracker at {host}:{port} refused the request for '{key}' ({str(reply)[:80]})")
    url, server_port, matchkey = reply[1]
    return str(url), int(server_port), str(matchkey)
