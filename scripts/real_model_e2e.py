"""Issue 2's real-model check: tune -> compile -> run --verify-against on an ONNX model nobody here wrote,
and time the tuned artifact against TVM's untuned default build of the same model, in one run.

    python scripts/real_model_e2e.py /work/zoo/squeezenet1_0.float32.onnx --trials 64 [--db PATH]

Prints one JSON line per step and a short table last. The models come from scripts/model_zoo.py
(torchvision with random weights).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def _time_vm(vm, args, dev, repeat: int) -> tuple[float, float]:
    fn = vm["main"]
    for _ in range(3):
        fn(*args)
    dev.sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        dev.sync()
        times.append(time.perf_counter() - t0)
    t = np.array(times) * 1e3
    return float(np.median(t)), float(np.percentile(t, 90))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--trials-per-kernel", type=int, default=16)
    ap.add_argument("--db", type=Path, default=None)
    ap.add_argument("--planner", default=None)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--workdir", type=Path, default=Path("tuning_logs") / "e2e")
    a = ap.parse_args()

    from tvmfuse import api, verify
    from tvmfuse._tvm import relax, tvm
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan.partition import DEFAULT_PLANNER
    from tvmfuse.target import resolve_target
    from tvmfuse.tune import TuneConfig

    a.workdir.mkdir(parents=True, exist_ok=True)
    db = a.db or a.workdir / f"{a.model.stem}.db"
    cfg = api.ModelConfig(model=a.model, target="llvm", db=db, planner=a.planner or DEFAULT_PLANNER)
    t0 = time.perf_counter()
    tuned = api.tune(cfg, TuneConfig(trials=a.trials, trials_per_kernel=a.trials_per_kernel))
    print(json.dumps({"step": "tune", "seconds": round(time.perf_counter() - t0, 1), "kernels": len(tuned["kernels"]),
                      "trials_run": tuned["trials_run"], "failed": tuned["failed"]}), flush=True)
    art = a.workdir / f"{a.model.stem}.artifact"
    built = api.compile(cfg, out=art)
    print(json.dumps({"step": "compile", "seconds": built["seconds"], "untuned_kernels": built["untuned"]}), flush=True)
    ran = api.run(art, verify_against=a.model, repeat=a.repeat)
    print(json.dumps({"step": "run", "latency_ms": ran["latency_ms"], "verification": ran["verification"]}), flush=True)

    # TVM's untuned default build of the same model: stock pipeline (FuseOps, no tuning)
    target = resolve_target("llvm")
    loaded = load_model(a.model)
    mod = import_model(loaded)
    t0 = time.perf_counter()
    with target.target:
        exe = tvm.compile(mod, target.target, relax_pipeline="default")
    dev = tvm.cpu(0)
    vm = relax.VirtualMachine(exe, dev)
    feeds = verify.random_inputs(loaded.inputs, seed=0)
    args = [tvm.runtime.tensor(feeds[s.name], dev) for s in loaded.inputs]
    default_med, default_p90 = _time_vm(vm, args, dev, a.repeat)
    out = vm["main"](*args)
    out = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    ref = verify.run_onnxruntime(a.model, feeds)[0]
    print(json.dumps({"step": "tvm-default", "compile_s": round(time.perf_counter() - t0, 1),
                      "median_ms": default_med, "p90_ms": default_p90,
                      "rel_error": verify.relative_error(out, ref)}), flush=True)
    med = ran["latency_ms"]["median"]
    err = ran["verification"]["outputs"][0]["rel_error"]
    print(f"\n{'build':<24}{'median ms':>12}{'p90 ms':>10}{'rel err':>12}")
    print(f"{'tvmfuse tuned':<24}{med:>12.3f}{ran['latency_ms']['p90']:>10.3f}{err:>12.2e}")
    print(f"{'tvm default (untuned)':<24}{default_med:>12.3f}{default_p90:>10.3f}")
    print(f"speedup over TVM default: {default_med / med:.2f}x; {len(tuned['kernels'])} kernels, "
          f"{tuned['trials_run']} trials, {len(built['untuned'])} untuned")
    return 0 if ran["verification"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
