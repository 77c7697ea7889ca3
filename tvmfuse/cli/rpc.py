"""``tvmfuse rpc tracker|server|status``: TVM's RPC tracker and server for tuning on other GPUs and machines
(``tvmfuse tune --rpc-tracker HOST:PORT --rpc-key KEY``), and what a tracker has registered."""
from __future__ import annotations

import os
import sys
from typing import Optional

import typer

from tvmfuse.cli.common import FlagGroup, JsonOpt, VerboseOpt, emit_json, err, handle_errors, out, table

app = typer.Typer(help="TVM RPC: a tracker, servers registered under a key, and what the tracker holds.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=FlagGroup)

HostOpt = typer.Option("127.0.0.1", "--host", help="Address to bind. Loopback by default: TVM RPC has no "
                       "authentication, so anything else is reachable by whoever can reach that address.")
TrackerOpt = typer.Option(..., "--tracker", help="The tracker, HOST:PORT.")


def _warn_if_exposed(host: str, port: int | str) -> None:
    from tvmfuse.rpc import SECURITY_WARNING, is_loopback

    if not is_loopback(host):
        err.print("warning: " + SECURITY_WARNING.format(addr=f"{host}:{port}"), highlight=False, markup=False)


def _say(text: str) -> None:
    err.print(text, highlight=False, markup=False)
    err.file.flush()


def _serve(running, what: str, announce) -> None:
    """Say the service is ready (``announce``, once its signals are caught), serve until Ctrl-C or SIGTERM (exit 0)
    or until the service ends by itself (exit 1), then leave at once: TVM's service threads are not daemons and
    never end by themselves."""
    from tvmfuse.rpc.service import end_sessions, serve_until_stopped

    why = serve_until_stopped(running, announce=announce)
    end_sessions()
    if why == "stopped":
        _say(f"error: the RPC {what} on {running.address} stopped by itself (rerun with --verbose to see why)")
        code = 1
    else:
        _say(f"{why}: the RPC {what} on {running.address} stopped")
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _import_services() -> None:
    # before the capture of native stderr (handle_errors) begins: TVM's tracker and server loggers bind the
    # stream they write to when first imported, and the capture's stream is closed when it ends
    try:
        import tvm.rpc.server  # noqa: F401
        import tvm.rpc.tracker  # noqa: F401
    except ImportError as e:  # the tracker needs tornado
        print(f"error: TVM's RPC services do not import here: {e}", file=sys.stderr)
        raise typer.Exit(2) from None


@app.command("tracker")
def tracker_command(
    host: str = HostOpt,
    port: int = typer.Option(9190, "--port", min=1, max=65535, help="Port to listen on (exactly this one)."),
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """Run TVM's RPC tracker until Ctrl-C: servers register with it under a key, `tune --rpc-tracker` asks it
    for them."""
    _import_services()
    with handle_errors(verbose):
        from tvmfuse.rpc.service import start_tracker

        _warn_if_exposed(host, port)
        running = start_tracker(host, port, verbose=verbose)
    address = f"{host}:{running.port}"

    def announce():
        if json_out:
            emit_json({"service": "tracker", "address": address, "host": host, "port": running.port,
                       "pid": os.getpid()})
            sys.stdout.flush()
        else:
            _say(f"RPC tracker listening on {address} (Ctrl-C stops it); register servers with: "
                 f"tvmfuse rpc server --tracker {address} --key KEY")

    _serve(running, "tracker", announce)


@app.command("server")
def server_command(
    tracker: str = TrackerOpt,
    key: str = typer.Option(..., "--key", help="The key to register under (one key per kind of device: h200, "
                            "rtx4090, graviton3); `tune --rpc-key` measures on every server under it."),
    host: str = HostOpt,
    port: int = typer.Option(9090, "--port", min=1, max=65535, help="First port to try."),
    port_end: Optional[int] = typer.Option(None, "--port-end", min=2, max=65536, help="Ports up to (not including) "
                                           "this one are tried, the first free is taken (default: --port + 100)."),
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """Run TVM's RPC server until Ctrl-C, registered at the tracker under KEY: it measures what `tune` sends it
    on this machine's device (CUDA_VISIBLE_DEVICES picks the GPU: run one server per GPU)."""
    from tvmfuse.rpc.service import keep_cuda_out_of_this_process

    keep_cuda_out_of_this_process()  # before TVM is imported: the sessions it forks must be able to use CUDA
    _import_services()
    with handle_errors(verbose):
        from tvmfuse.rpc import RPCError, is_loopback, parse_address
        from tvmfuse.rpc.service import start_server

        tracker_addr = parse_address(tracker, what="--tracker")
        if not key.strip() or any(c.isspace() or c == ":" for c in key.strip()):
            raise RPCError(f"--key must be one word without ':' (got '{key}')")
        if port_end is not None and port_end <= port:
            raise RPCError(f"--port-end ({port_end}) must be above --port ({port})")
        _warn_if_exposed(host, port)
        if is_loopback(host) and not is_loopback(tracker_addr[0]):
            _say(f"note: this server listens on {host} only: tune runs on other machines cannot reach it "
                 "(give --host an address they can reach)")
        running = start_server(tracker_addr, key.strip(), host=host, port=port, port_end=port_end, verbose=verbose)
    address = f"{host}:{running.port}"

    def announce():
        if json_out:
            emit_json({"service": "server", "address": address, "host": host, "port": running.port,
                       "key": key.strip(), "tracker": f"{tracker_addr[0]}:{tracker_addr[1]}", "pid": os.getpid(),
                       "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})
            sys.stdout.flush()
        else:
            gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
            _say(f"RPC server on {address} registered under key '{key.strip()}' at {tracker_addr[0]}:"
                 f"{tracker_addr[1]}" + (f" (CUDA_VISIBLE_DEVICES={gpus})" if gpus is not None else "")
                 + " (Ctrl-C stops it)")

    _serve(running, "server", announce)


@app.command("status")
def status_command(
    tracker: str = TrackerOpt,
    key: Optional[str] = typer.Option(None, "--key", help="Only this key."),
    timeout: float = typer.Option(10.0, "--timeout", min=0.1, help="Seconds to wait for the tracker."),
    json_out: bool = JsonOpt, verbose: bool = VerboseOpt,
):
    """The servers a tracker has, per key: their addresses, how many are free, how many requests wait."""
    with handle_errors(verbose):
        from tvmfuse.rpc import RPCError, parse_address
        from tvmfuse.rpc.tracker import servers_by_key, summary

        host, port = parse_address(tracker, what="--tracker")
        keys = servers_by_key(summary(host, port, timeout=timeout))
        if key is not None:
            if key not in keys:
                raise RPCError(f"the tracker at {host}:{port} has no server under key '{key}'",
                               hint="its keys: " + (", ".join(keys) or "none"))
            keys = {key: keys[key]}
        if json_out:
            emit_json({"tracker": f"{host}:{port}", "keys": keys})
            return
        rows = [[k, len(v["servers"]), v["free"], v["pending"], ", ".join(v["servers"]) or "-"]
                for k, v in keys.items()]
        out.print(table(f"RPC tracker {host}:{port}", ["key", "servers", "free", "waiting requests", "addresses"],
                        rows))
        if not rows:
            out.print("no server registered (start one: tvmfuse rpc server --tracker "
                      f"{host}:{port} --key KEY)", highlight=False)
