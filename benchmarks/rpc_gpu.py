#!/usr/bin/env python3
"""Tuning through TVM's RPC tracker on a GPU machine, beside tuning in the same process (issue 23).

On one GPU host: ``tvmfuse rpc tracker`` and ``tvmfuse rpc server`` (and a plain ``python -m tvm.exec.rpc_server``)
on loopback; each server is described through a session (what ``tune --rpc-tracker`` asks first); then each case is
tuned twice with the same budget, once measured here and once on the server, each into its own database, and the
two compared kernel by kernel:
- ``default``: the untuned default schedule, measured first by both runs: the same code, so the two figures should
  agree within the GPU's noise;
- ``best``: the best of the search (a random search, so the configs may differ; the figures should still be close).

    python benchmarks/rpc_gpu.py [--cases softmax,gemm_bias_relu] [--trials 6]
Writes ``$OUT/rpc_gpu.json``; prints the table last.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="rpc_gpu-"))
OUT.mkdir(parents=True, exist_ok=True)

# moderate sizes: each kernel times in tens of microseconds, so a trial's RPC round trip is not what is measured
SIZES = {
    "softmax": dict(M=8192, N=2048),
    "pointwise": dict(M=4096, N=4096),
    "add_layernorm": dict(M=4096, N=4096),
    "gemm_bias_relu": dict(M=2048, K=2048, N=2048),
}


def log(msg: str) -> None:
    print(f"[rpc_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], extra_env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **(extra_env or {})}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)


def ready(proc: subprocess.Popen, timeout: float = 60) -> dict | None:
    box: dict = {}
    reader = threading.Thread(target=lambda: box.setdefault("line", proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box.get("line"):
        return None
    return json.loads(box["line"])


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def describe_all(tracker_port: int, keys: list[str]) -> dict:
    """Each key's device as ``tune --rpc-tracker`` would see it, or the error it would stop with."""
    from tvmfuse.rpc import RPCError, rpc_options
    from tvmfuse.rpc.device import probe

    out = {}
    for key in keys:
        try:
            dev, servers = probe(rpc_options(f"127.0.0.1:{tracker_port}", key))
            out[key] = {"ok": True, "described_by": dev.described_by, "gpu": dev.gpu_identity, "cuda": dev.cuda,
                        "cpu": dev.cpu_identity, "servers": servers}
        except RPCError as err:
            out[key] = {"ok": False, "error": str(err)}
        except Exception as err:  # noqa: BLE001 - shown in the table: this is the diagnostic
            out[key] = {"ok": False, "error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}"}
        log(f"describe {key}: {out[key]}")
    return out


def tune_case(path: Path, db: Path, trials: int, rpc_port: int | None, key: str) -> dict:
    cmd = [sys.executable, "-m", "tvmfuse.cli.main", "tune", str(path), "--target", "cuda", "--db", str(db),
           "--trials", str(trials * 8), "--trials-per-kernel", str(trials), "--json", "--keep-going"]
    if rpc_port is not None:
        cmd += ["--rpc-tracker", f"127.0.0.1:{rpc_port}", "--rpc-key", key]
    t0 = time.time()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    wall = time.time() - t0
    try:
        report = json.loads(p.stdout)
    except json.JSONDecodeError:
        return {"rc": p.returncode, "wall_s": wall, "error": (p.stderr or p.stdout).strip()[-600:]}
    return {"rc": p.returncode, "wall_s": wall, "report": report}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="softmax,gemm_bias_relu")
    ap.add_argument("--trials", type=int, default=6, help="searched trials per kernel, both runs")
    ap.add_argument("--describe-only", action="store_true")
    args = ap.parse_args()

    import onnx

    from tvmfuse.bench import cases as case_defs

    tport, sport, pport = free_port(), free_port(), free_port()
    procs = []
    result: dict = {"cases": {}}
    try:
        tracker = start([sys.executable, "-m", "tvmfuse.cli.main", "rpc", "tracker", "--port", str(tport), "--json"])
        procs.append(tracker)
        result["tracker"] = ready(tracker)
        server = start([sys.executable, "-m", "tvmfuse.cli.main", "rpc", "server", "--tracker", f"127.0.0.1:{tport}",
                        "--key", "h200", "--port", str(sport), "--json"])
        procs.append(server)
        result["server"] = ready(server)
        # a plain TVM server needs the same environment as tvmfuse's (README: its forked sessions use CUDA)
        from tvmfuse.rpc.service import CUDA_FREE_ENV

        plain = start([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{tport}",
                       "--key", "h200plain", "--port", str(pport), "--port-end", str(pport + 1)], CUDA_FREE_ENV)
        procs.append(plain)
        time.sleep(3)
        result["describe"] = describe_all(tport, ["h200", "h200plain"])
        if args.describe_only or not result["describe"]["h200"]["ok"]:
            if not result["describe"]["h200"]["ok"]:
                log(f"server stderr: {server.stderr.read()[-1500:] if server.poll() is not None else '(running)'}")
            print(json.dumps(result["describe"], indent=1))
            return 0 if result["describe"]["h200"]["ok"] else 1
        work = Path(tempfile.mkdtemp(prefix="rpc_gpu_models-"))
        for name in [c for c in args.cases.split(",") if c]:
            path = work / f"{name}.onnx"
            onnx.save(getattr(case_defs, name)(**SIZES[name])[0], str(path))
            local = tune_case(path, work / f"{name}.local.db", args.trials, None, "")
            log(f"{name} local: rc {local['rc']}, {local['wall_s']:.0f} s")
            remote = tune_case(path, work / f"{name}.rpc.db", args.trials, tport, "h200")
            log(f"{name} rpc: rc {remote['rc']}, {remote['wall_s']:.0f} s")
            result["cases"][name] = {"local": local, "rpc": remote}
    finally:
        for p in reversed(procs):
            stop(p)
        (OUT / "rpc_gpu.json").write_text(json.dumps(result, indent=1, default=str))

    print()
    print("describe:", {k: (v.get("gpu") if v["ok"] else v["error"][:120]) for k, v in result["describe"].items()})
    print(f"{'case':16} {'kernel':36} {'default local':>14} {'default rpc':>12} {'ratio':>6} "
          f"{'best local':>11} {'best rpc':>9} {'ratio':>6}  device / servers")
    for name, c in result["cases"].items():
        rl, rr = c["local"].get("report"), c["rpc"].get("report")
        if rl is None or rr is None:
            print(f"{name:16} local: {c['local'].get('error', '')[:80]} | rpc: {c['rpc'].get('error', '')[:80]}")
            continue
        remote_k = {k["name"]: k for k in rr.get("kernels", [])}
        for k in rl.get("kernels", []):
            r = remote_k.get(k["name"], {})

            def f(x):
                return "-" if x is None else f"{x * 1e3:.1f}"

            def ratio(a, b):
                return "-" if not a or not b else f"{b / a:.3f}"

            print(f"{name:16} {k['name'][:36]:36} {f(k.get('baseline_ms')):>14} {f(r.get('baseline_ms')):>12} "
                  f"{ratio(k.get('baseline_ms'), r.get('baseline_ms')):>6} {f(k.get('best_ms')):>11} "
                  f"{f(r.get('best_ms')):>9} {ratio(k.get('best_ms'), r.get('best_ms')):>6}  "
                  f"{rr.get('device', '?')} / {r.get('servers')}")
        print(f"{name:16} wall: local {c['local']['wall_s']:.0f} s, rpc {c['rpc']['wall_s']:.0f} s; status local "
              f"{[k['status'] for k in rl.get('kernels', [])]}, rpc {[k['status'] for k in rr.get('kernels', [])]}")
    print("(µs; ratio = rpc / local)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
