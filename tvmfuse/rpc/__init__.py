"""Tuning on other machines through TVM's RPC tracker: servers register under a key, ``tune`` builds candidates
here and measures them on those servers (``tvmfuse.rpc.runner``), each record keyed by the remote device's own
identity (``tvmfuse.rpc.device``). ``tvmfuse.rpc.service`` starts TVM's tracker and server for ``tvmfuse rpc``.

TVM RPC has no authentication: a server runs whatever code reaches it. Everything here binds to loopback unless
told otherwise, and says so when it is told otherwise.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from tvmfuse.errors import TvmfuseError

SECURITY_WARNING = ("TVM RPC has no authentication and no encryption: anyone who can reach {addr} can upload and "
                    "run any code as this user. Bind to a trusted network only (an SSH tunnel or a private "
                    "cluster network), never one others can reach.")


class RPCError(TvmfuseError):
    """The tracker cannot be reached, or no server answers under the key (exit 2)."""


@dataclass(frozen=True)
class RPCOptions:
    """Where candidates are measured: the servers registered under ``key`` at the tracker ``host:port``.

    Attributes
    ----------
    workers : trials measured at once (one session per server at a time); None: the servers under the key
    connect_timeout_s : how long to wait for the tracker to answer, and at the start for a server under the key
    session_timeout_s : one trial's session (upload, link, time) on its server; the server ends it after this
    queue_timeout_s : how long a trial waits for a free server before it is lost (None: ``session_timeout_s``)
    """

    host: str
    port: int
    key: str
    workers: int | None = None
    connect_timeout_s: float = 10.0
    session_timeout_s: float = 30.0
    queue_timeout_s: float | None = None

    @property
    def tracker(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def queue_wait_s(self) -> float:
        return self.session_timeout_s if self.queue_timeout_s is None else self.queue_timeout_s


def parse_address(text: str, *, what: str = "--rpc-tracker") -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9190`` for IPv6) -> (host, port); a TvmfuseError naming ``what`` otherwise."""
    text = str(text or "").strip()
    host, sep, port = text.rpartition(":")
    if text.startswith("[") and "]" in text:
        host, _, rest = text[1:].partition("]")
        sep, port = ":", rest[1:] if rest.startswith(":") else ""
    if not sep or not host or not port:
        raise RPCError(f"{what} must be HOST:PORT, not '{text}'", hint="e.g. 127.0.0.1:9190")
    try:
        number = int(port)
    except ValueError:
        raise RPCError(f"{what} must be HOST:PORT: '{port}' is not a port number") from None
    if not 0 < number < 65536:
        raise RPCError(f"{what}: port {number} is out of range (1-65535)")
    return host, number


def rpc_options(tracker: str | None, key: str | None, *, workers: int | None = None,
                session_timeout_s: float | None = None) -> RPCOptions | None:
    """The RPC options of a command's ``--rpc-tracker``/``--rpc-key``/``--rpc-workers``; None without a tracker.
    Both or neither: a key without a tracker (or a tracker without a key) is refused."""
    if not tracker and not key:
        if workers is not None:
            raise RPCError("--rpc-workers needs --rpc-tracker and --rpc-key")
        return None
    if not tracker:
        raise RPCError("--rpc-key needs --rpc-tracker HOST:PORT")
    host, port = parse_address(tracker)
    if not key or not key.strip():
        raise RPCError("--rpc-tracker needs --rpc-key KEY (the key the servers registered under)")
    if workers is not None and workers < 1:
        raise RPCError(f"--rpc-workers must be at least 1, not {workers}")
    extra = {} if session_timeout_s is None else {"session_timeout_s": float(session_timeout_s)}
    return RPCOptions(host=host, port=port, key=key.strip(), workers=workers, **extra)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a socket on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


__all__ = ["RPCError", "RPCOptions", "SECURITY_WARNING", "is_loopback", "parse_address", "rpc_options"]
