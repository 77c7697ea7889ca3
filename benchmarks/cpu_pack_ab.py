"""The CPU default with and without compile-time weight packing, one model, one process: both untuned llvm builds
of the same plan, checked against each other, then timed in turn (7 rounds of 5 calls each, the rounds
interleaved, so a loaded machine slows both alike).

    python benchmarks/cpu_pack_ab.py MODEL.onnx [--rounds 7]

Without packing, the build skips ``tvmfuse.compile.build.pack_weights`` and the CPU default keeps the weights'
own layout (``tvmfuse.kernels.cpu.pack_weights`` off), as before it existed.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if not args.model.is_file():
        sys.exit(f"model file not found: {args.model}")

    from tvmfuse._tvm import relax, tvm
    from tvmfuse.plan.partition import plan_model
    from tvmfuse.target import resolve_target
    import tvmfuse.kernels.cpu as cpu

    build_mod = importlib.import_module("tvmfuse.compile.build")
    target = resolve_target("llvm")
    fused, _ = plan_model(args.model, target="llvm")

    def build(pack: bool):
        saved = build_mod.pack_weights, cpu.pack_weights
        if not pack:
            build_mod.pack_weights, cpu.pack_weights = (lambda mod: mod), (lambda sch: False)
        try:
            return relax.VirtualMachine(build_mod.build(fused, target=target, lift_params=False).executable,
                                        tvm.cpu())
        finally:
            build_mod.pack_weights, cpu.pack_weights = saved

    vms = {"plain": build(False), "packed": build(True)}
    rng = np.random.default_rng(0)
    inputs = []
    for p in fused["main"].params:
        shape, dtype = [int(v) for v in p.ty.shape], str(p.ty.dtype)
        value = rng.standard_normal(shape).astype(dtype) if "float" in dtype else np.zeros(shape, dtype)
        inputs.append(tvm.runtime.tensor(value))

    def first(out):
        return out.numpy() if hasattr(out, "numpy") else first(out[0])

    a, b = (first(vm["main"](*inputs)) for vm in vms.values())
    rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))
    times = {k: [] for k in vms}
    for _ in range(args.rounds):
        for k, vm in vms.items():
            vm["main"](*inputs)
            t0 = time.perf_counter()
            for _ in range(5):
                vm["main"](*inputs)
            times[k].append((time.perf_counter() - t0) / 5 * 1e3)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"{args.model.name}: plain {med['plain']:.2f} ms, packed {med['packed']:.2f} ms "
          f"({med['plain'] / med['packed']:.2f}x), outputs agree to {rel:.1e}")


if __name__ == "__main__":
    main()
