"""What the servers under a key are, asked through RPC sessions, and the target and record identity of a run that
measures on them.

Records of a remote run are keyed exactly as a run on the server's own machine would key them: a GPU by its name
and arch (``NVIDIA H200 sm_90a``), read from the device through the session; a CPU by its model and cores
(``cpu:Neoverse-V2 x72``), which a tvmfuse server answers (``tvmfuse.rpc.describe_device``, registered by
``tvmfuse rpc server``). A plain TVM server cannot tell its CPU's model: its records are keyed by its LLVM CPU
name instead (``cpu:neoverse-v2 x72``), which a run on that machine does not match.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace

from tvmfuse.machine import host_arch, normalize_arch, triple_arch
from tvmfuse.rpc import RPCError, RPCOptions
from tvmfuse.rpc.tracker import NoFreeServer, request_server, wait_for_servers
from tvmfuse.target import TargetInfo, cpu_identity, cuda_identity, cuda_spec, host_cpu_description, resolve_target

DESCRIBE_FUNC = "tvmfuse.rpc.describe_device"


def local_cuda_description() -> dict | None:
    """This machine's GPU 0 as target JSON plus ``name``, read through the local CUDA runtime, or None without one.

    A tvmfuse server answers it inside its session, so the client never depends on TVM marshalling each device
    attribute across the connection."""
    from tvmfuse.target import cuda_device

    dev = cuda_device()
    return None if dev is None else {**cuda_spec(dev), "name": str(dev.device_name)}


def register_describe() -> None:
    """Make this process (an RPC server, whose sessions fork from it) answer DESCRIBE_FUNC. The description is read
    when a session asks, in the session's process: the server itself never touches the GPU, so a CUDA context is
    never inherited across the fork."""
    import tvm_ffi

    def describe() -> str:
        info = host_cpu_description()
        try:
            info["cuda"] = local_cuda_description()
        except Exception as err:  # noqa: BLE001 - told to the client, which refuses the server with it
            info["cuda_error"] = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1][:200]}"
        return json.dumps(info)

    tvm_ffi.register_global_func(DESCRIBE_FUNC, describe, override=True)


@dataclass(frozen=True)
class RemoteDevice:
    """One server's device as its session tells it.

    Attributes
    ----------
    server : ``host:port`` of the server asked
    triple, arch : its LLVM triple and CPU architecture
    cpu : its CPU's model (a tvmfuse server) or LLVM CPU name (a plain TVM server), and its cores
    mcpu : its CPU as LLVM names it (the ``mcpu`` of its llvm target), None when LLVM cannot tell
    cuda : its GPU 0 as target JSON plus ``name``, or None when it has no CUDA GPU
    described_by : "tvmfuse" or "tvm" (a plain TVM server)
    """

    server: str
    triple: str
    arch: str
    cpu: str
    cores: int
    mcpu: str | None
    cuda: dict | None
    described_by: str

    @property
    def cpu_identity(self) -> str:
        return cpu_identity(self.cpu, self.cores)

    @property
    def gpu_identity(self) -> str | None:
        return None if self.cuda is None else cuda_identity(self.cuda["name"], self.cuda)

    @property
    def summary(self) -> str:
        return self.gpu_identity or self.cpu_identity

    def llvm_spec(self) -> dict:
        """Its llvm target, as ``--target llvm`` on that machine resolves it (plus its triple when it is another
        architecture than this machine's, so that the candidates are built for it)."""
        spec = {"kind": "llvm", "num-cores": self.cores, **({"mcpu": self.mcpu} if self.mcpu else {})}
        if self.arch != host_arch():
            spec["mtriple"] = self.triple
        return spec

    def cuda_target_spec(self) -> dict:
        spec = {k: v for k, v in (self.cuda or {}).items() if k != "name"}
        if self.arch != host_arch():
            spec["host"] = {"kind": "llvm", "mtriple": self.triple}
        return spec


def _connect(opts: RPCOptions, *, timeout: float):
    """An RPC session on a free server under the key, and that server's ``host:port``; bounded by ``timeout``
    (TVM's connect has no bound of its own: a server registered under an address this machine cannot reach
    would hang it)."""
    from tvm import rpc

    url, port, matchkey = request_server(opts.host, opts.port, opts.key, timeout=timeout)
    where = f"{url}:{port}"
    box: dict = {}

    def connect() -> None:
        try:
            box["session"] = rpc.connect(url, port, matchkey, session_timeout=max(timeout, opts.session_timeout_s))
        except Exception as e:  # noqa: BLE001 - reported below as one line
            box["error"] = e

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RPCError(f"the RPC server {where} (key '{opts.key}') did not accept a session within {timeout:g} s",
                       hint="is it bound to an address this machine can reach?")
    if "error" in box:
        line = (str(box["error"]).strip().splitlines() or ["?"])[-1][:200]
        raise RPCError(f"cannot open a session on the RPC server {where} (key '{opts.key}'): {line}")
    return box["session"], where


def _remote_func(session, name: str):
    try:
        return session.get_function(name)
    except Exception:  # noqa: BLE001 - a function the server does not have
        return None


def _session_cuda(session, server: str) -> dict | None:
    """GPU 0 of a plain TVM server, asked attribute by attribute through the session; None without one."""
    has_gpu = False
    try:
        dev = session.cuda(0)
        has_gpu = bool(dev.exist)
        return {**cuda_spec(dev), "name": str(dev.device_name)} if has_gpu else None
    except Exception as err:  # noqa: BLE001 - a server without the CUDA runtime is a CPU server; one whose GPU
        #                       answers but cannot be described must not pass for a CPU server
        if has_gpu:
            last = (str(err).strip().splitlines() or [""])[-1][:200]
            raise RPCError(f"the RPC server {server} has a CUDA GPU, but reading its properties failed "
                           f"({type(err).__name__}: {last})") from None
        return None


def describe(session, server: str) -> RemoteDevice:
    """Ask one session what its server's device is: a tvmfuse server describes itself (CPU and GPU, read on its
    side); a plain TVM server is asked attribute by attribute through the session."""
    told = _remote_func(session, DESCRIBE_FUNC)
    if told is not None:
        info = json.loads(str(told()))
        if info.get("cuda_error"):
            raise RPCError(f"the RPC server {server} has a CUDA GPU, but reading its properties failed there "
                           f"({info['cuda_error']})")
        triple = str(info["triple"])
        return RemoteDevice(server=server, triple=triple, arch=triple_arch(triple), cpu=str(info["cpu_model"]),
                            cores=int(info["cores"]), mcpu=info.get("mcpu") or None, cuda=info.get("cuda"),
                            described_by="tvmfuse")
    cuda = _session_cuda(session, server)
    triple_f = _remote_func(session, "target.llvm_get_system_triple")
    cpu_f = _remote_func(session, "target.llvm_get_system_cpu")
    count_f = _remote_func(session, "s_tir.meta_schedule.cpu_count")
    triple = str(triple_f()) if triple_f is not None else "unknown-unknown-linux-gnu"
    mcpu = str(cpu_f()) if cpu_f is not None else ""
    cores = int(count_f(True)) if count_f is not None else 1  # logical, as a local run counts them
    return RemoteDevice(server=server, triple=triple, arch=normalize_arch(triple_arch(triple)),
                        cpu=mcpu or triple, cores=cores, mcpu=mcpu if mcpu and mcpu != "generic" else None,
                        cuda=cuda, described_by="tvm")


def probe(opts: RPCOptions) -> tuple[RemoteDevice, list[str]]:
    """Describe the servers under ``opts.key``: (their device, every server's ``host:port``).

    Every registered server is asked (sessions held open one after another, so that the tracker hands out a
    different server each time); servers under one key that are different devices are refused, since their
    records would share one identity. Raises RPCError (exit 2) for a tracker that cannot be reached, no server
    under the key within ``opts.connect_timeout_s``, or a server that does not answer."""
    servers = wait_for_servers(opts.host, opts.port, opts.key, timeout=opts.connect_timeout_s)
    sessions, devices = [], []
    try:
        for _ in servers:
            try:
                session, where = _connect(opts, timeout=opts.connect_timeout_s)
            except NoFreeServer:
                break  # the others are busy (another run's sessions): those asked speak for the key
            sessions.append(session)
            devices.append(describe(session, where))
    finally:
        sessions.clear()  # closes them: a session ends when its last reference goes
    if not devices:
        raise RPCError(f"no RPC server under key '{opts.key}' at {opts.tracker} was free within "
                       f"{opts.connect_timeout_s:g} s")
    kinds = {d.summary for d in devices}
    if len(kinds) > 1:
        shown = "; ".join(f"{d.server}: {d.summary}" for d in devices)
        raise RPCError(f"the servers under key '{opts.key}' are different devices ({shown})",
                       hint="register each kind of device under a key of its own")
    return devices[0], servers


def remote_target(spec, device: RemoteDevice) -> TargetInfo:
    """The target of a run that measures on ``device``, keyed by its identity.

    ``auto``, ``llvm`` and ``cuda`` resolve against the remote device (its GPU's arch and limits; its CPU's cores,
    ``mcpu`` and, for another architecture, triple), as they would on that machine. A target JSON is taken as
    given; it must be for the device's kind and CPU architecture."""
    if spec is None or spec == "auto":
        spec = "cuda" if device.cuda else "llvm"
    if spec == "cuda":
        if device.cuda is None:
            raise RPCError(f"--target cuda, but the RPC server {device.server} has no CUDA GPU "
                           f"({device.cpu_identity})")
        spec = device.cuda_target_spec()
    elif spec == "llvm":
        spec = device.llvm_spec()
    info = resolve_target(spec)
    if info.is_gpu and device.cuda is None:
        raise RPCError(f"a CUDA target, but the RPC server {device.server} has no CUDA GPU ({device.cpu_identity})")
    if triple_arch(info.triple) != device.arch:
        raise RPCError(f"the target builds for {triple_arch(info.triple)}, but the RPC server {device.server} is "
                       f"{device.arch} ({device.triple})",
                       hint=f"give the target an \"mtriple\" of {device.triple}, or --target auto")
    identity = cuda_identity(device.cuda["name"], json.loads(info.canonical)) if info.is_gpu else \
        cpu_identity(device.cpu, json.loads(info.canonical).get("num-cores", device.cores))
    return replace(info, device=identity)
