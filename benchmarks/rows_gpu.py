"""The row program (tvmfuse/kernels/rows/) on the GPU: each config built, checked and timed beside the copy ceiling.

For the ANCHORS.md row cases (softmax 65536 x 2048, add+LayerNorm 16384 x 8192, fp16) it takes the planner's
row kernel, builds the row program under each config (``--configs``, default: every config that fits), checks it
against the same kernel under TVM's default GPU schedule (dlight) on fresh random inputs with the output
poisoned (NaN) first, and times both with TVM's time evaluator beside the device-to-device copy of the case's
bytes (inputs read once, output written once), in the same run.

    python benchmarks/rows_gpu.py [--cases softmax,add_layernorm] [--configs "t32 r1" ...] [--json out.json]
                               [--small] [--build-only] [--shapes softmax=2048x32000 rmsnorm=8192x5120 ...]
                               [--default-only]

``--shapes`` runs cases at the given rows x columns instead of ``--cases``; ``--default-only`` builds only the
config an untuned build runs (``rows.default_config``). Softmax rows are also checked against PyTorch's
float32 softmax (``fp32 err``).

``--build-only`` (or ``--dry-run``) builds every config for sm_90a and runs ptxas (no GPU): registers and spills
per config. ``--sample N``: the untuned default, the same config without the kept vectors and online pass (the
streamed default before them) and N other configs of the space drawn at random (``--seed``), instead of every
config. ``log_softmax`` rows are checked against PyTorch's float32 log-softmax like softmax's.

    python benchmarks/rows_gpu.py --shapes softmax=2048x32000 softmax=4096x50257 log_softmax=4096x50257 \
        softmax=1024x128256 softmax=4096x128256 layernorm=16384x4099 rmsnorm=16384x4099 --sample 6
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {"softmax": dict(M=65536, N=2048), "add_layernorm": dict(M=16384, N=8192),
         "layernorm": dict(M=16384, N=4096), "rmsnorm": dict(M=16384, N=4096), "log_softmax": dict(M=4096, N=50257)}
SMALL = {"softmax": dict(M=64, N=2048), "add_layernorm": dict(M=16, N=8192), "layernorm": dict(M=16, N=4096),
         "rmsnorm": dict(M=16, N=4096), "log_softmax": dict(M=4, N=50257)}


def log_softmax(M, N):
    """y = LogSoftmax(x) over the last axis (fp16)."""
    from onnx import TensorProto, helper

    x, y = (helper.make_tensor_value_info(v, TensorProto.FLOAT16, [M, N]) for v in "xy")
    graph = helper.make_graph([helper.make_node("LogSoftmax", ["x"], ["y"], axis=-1)], "logsoftmax", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), 2 * M * N * 2, 0
SM90A = {"kind": "cuda", "arch": "sm_90a"}


def row_kernel(case: str, size: dict):
    import onnx

    from tvmfuse.bench.cases import CASES
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.target import resolve_target
    from tvmfuse.tune import extract_kernels
    from tvmfuse.tune.spaces import classify

    target = resolve_target(SM90A)
    path = Path(tempfile.mkdtemp()) / f"{case}.onnx"
    onnx.save((log_softmax if case == "log_softmax" else CASES[case])(**size)[0], path)
    fused, _ = partition(import_model(load_model(path)), target=target)
    (kernel,) = [k for k in extract_kernels(fused, target=target) if classify(k.mod["main"]) == "row_reduction"]
    return kernel.mod["main"]


def _build(func):
    from tvmfuse._tvm import build_context, tvm

    with build_context():
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                           target=tvm.target.Target(SM90A))


def _ptxas(src: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        cu = Path(d) / "k.cu"
        cu.write_text(src)
        out = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(Path(d) / "k.cubin"),
                              str(cu)], capture_output=True, text=True)
    if out.returncode:
        return "FAIL " + out.stderr.strip().splitlines()[-1][:160]
    lines = [ln.strip() for ln in out.stderr.splitlines() if "registers" in ln or "spill" in ln]
    return " | ".join(lines[-2:])


def _reference(func):
    """The kernel under dlight's default GPU schedule (what an untuned build runs)."""
    from tvmfuse._gpu_rules import default_gpu_rules
    from tvmfuse._tvm import dlight, tvm

    target = tvm.target.Target(SM90A)
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    with target:
        mod = dlight.ApplyDefaultSchedule(*default_gpu_rules())(mod)
    return tvm.compile(mod, target=target)


def _no_exp(func, cfg):
    """The row program of ``func`` under ``cfg`` with every exp2 made an fabs (ALU work, no SFU): an ablation that
    says how much of a softmax's time the exponentials' unit takes (its output is not softmax: timed, not checked)."""
    import tvmfuse.kernels.rows as rows
    from tvmfuse.kernels.wgmma.ptx import parse

    return parse(rows.row_source(rows.analyze(func), cfg, False).replace("T.exp2(", "T.fabs("))


def run_case(case: str, func, configs, build_only: bool, ablate: bool = False) -> dict:
    import tvmfuse.kernels.rows as rows
    prog = rows.analyze(func)
    out = {"case": case, "shape": [prog.rows, prog.cols], "configs": []}
    if not build_only:
        import torch

        from tvmfuse._tvm import tvm

        dev = tvm.cuda(0)
        bufs = prog.params
        gen = torch.Generator(device="cuda").manual_seed(0)
        inputs = [torch.randn([int(d) for d in b.shape], device="cuda", dtype=getattr(torch, str(b.dtype)),
                              generator=gen) for b in bufs[:-1]]
        full = [t for t, b in zip(inputs, bufs) if b.name in prog.full]
        out_t = getattr(torch, str(bufs[-1].dtype))
        nbytes = (sum(t.numel() * t.element_size() for t in full)
                  + int(np.prod([int(d) for d in bufs[-1].shape])) * torch.finfo(out_t).bits // 8)
        # the copy ceiling: a device-to-device copy moving the case's bytes (half read, half written)
        src_t = torch.empty(nbytes // 4, device="cuda", dtype=torch.float16)
        dst_t = torch.empty_like(src_t)
        from triton.testing import do_bench

        out["copy_us"] = do_bench(lambda: dst_t.copy_(src_t), warmup=25, rep=100, return_mode="median") * 1e3
        ref_lib = _reference(func)
        want = torch.full([int(d) for d in bufs[-1].shape], float("nan"), device="cuda", dtype=out_t)
        args = [tvm.runtime.from_dlpack(t) for t in (*inputs, want)]
        ref_lib["main"](*args)
        dev.sync()
        ev = ref_lib.mod.time_evaluator("main", dev, number=20, repeat=5)
        out["dlight_us"] = float(np.median(ev(*args).results)) * 1e6
    for cfg in configs:
        rec = {"config": cfg.name}
        t0 = time.time()
        try:
            lib = _build(rows.kernel_for(func, cfg))
        except Exception as err:  # noqa: BLE001 - report and go on
            rec["error"] = str(err).strip().splitlines()[-1][:160]
            out["configs"].append(rec)
            print(json.dumps(rec), flush=True)
            continue
        rec["build_s"] = round(time.time() - t0, 1)
        if build_only:
            rec["ptxas"] = _ptxas(lib.mod.imports[0].inspect_source())
        else:
            got = torch.full_like(want, float("nan"))
            args = [tvm.runtime.from_dlpack(t) for t in (*inputs, got)]
            try:   # (a staged row past the block's shared memory fails at launch: that config's row says so)
                lib["main"](*args)
                dev.sync()
            except Exception as err:  # noqa: BLE001 - report and go on
                rec["error"] = str(err).strip().splitlines()[-1][:160]
                out["configs"].append(rec)
                print(json.dumps(rec), flush=True)
                continue
            diff = (got.float() - want.float()).nan_to_num(nan=float("inf")).norm() / want.float().norm()
            rec["unwritten"] = int(torch.isnan(got).sum())
            rec["rel_error"] = float(diff)
            rec["ok"] = rec["unwritten"] == 0 and rec["rel_error"] < 1e-2
            if case in ("softmax", "log_softmax"):
                # PyTorch's float32 result decides: dlight sums a row's exponentials in order in fp16, which a
                # 100k-wide row takes far from it
                exact = (torch.softmax if case == "softmax" else torch.log_softmax)(inputs[0].float(), -1)
                rec["fp32_error"] = float((got.float() - exact).nan_to_num(nan=float("inf")).norm() / exact.norm())
                rec["ok"] = rec["unwritten"] == 0 and rec["fp32_error"] < 1e-2
            if rec["unwritten"] == 0:  # timed even past the tolerance: the table says which were not ok
                ev = lib.mod.time_evaluator("main", dev, number=20, repeat=5)
                rec["us"] = float(np.median(ev(*args).results)) * 1e6
                rec["pct_copy"] = 100 * out["copy_us"] / rec["us"]
            if ablate:
                lib = _build(_no_exp(func, cfg))
                lib["main"](*args)
                ev = lib.mod.time_evaluator("main", dev, number=20, repeat=5)
                us = float(np.median(ev(*args).results)) * 1e6
                out["configs"].append({"config": cfg.name + " noexp", "ablation": True, "ok": None, "us": us,
                                       "pct_copy": 100 * out["copy_us"] / us})
        out["configs"].append(rec)
        print(json.dumps(rec), flush=True)
    return out


def _sampled(rows, prog, default, space, n: int, seed: int) -> list:
    """The default, the default without its kept vectors and online pass (the streamed default before them, where
    it differs), the plain staged and re-read configs at the default's threads, and ``n`` other configs of the
    space drawn at random."""
    import random

    head = [] if default is None else [default, rows.RowConfig(default.threads, default.rows_per_block,
                                                               default.lanes, default.mode)]
    if default is not None and default.mode:
        head += [rows.RowConfig(default.threads, 1, 0, m) for m in (rows.SHARED, rows.L2)]
    head = list(dict.fromkeys(head))
    rest = [c for c in space if c not in head]
    return head + random.Random(seed).sample(rest, min(n, len(rest)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="softmax,add_layernorm")
    ap.add_argument("--configs", nargs="*", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--build-only", "--dry-run", action="store_true")
    ap.add_argument("--sample", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--default-only", action="store_true")
    ap.add_argument("--ablate", action="store_true", help="also time each config with its exp2s made fabs (how much "
                    "of its time the exponentials take; not checked)")
    a = ap.parse_args()

    import tvmfuse.kernels.rows as rows
    runs = []
    for case in a.cases.split(",") if not a.shapes else []:
        if case not in SIZES:
            print(f"error: unknown case '{case}' (cases: {', '.join(SIZES)})", file=sys.stderr)
            return 2
        runs.append((case, (SMALL if a.small else SIZES)[case]))
    for shape in a.shapes or []:
        case, _, dims = shape.partition("=")
        try:
            m, n = (int(d) for d in dims.split("x"))
        except ValueError:
            print(f"error: --shapes takes case=ROWSxCOLS, not '{shape}'", file=sys.stderr)
            return 2
        if case not in SIZES:
            print(f"error: unknown case '{case}' (cases: {', '.join(SIZES)})", file=sys.stderr)
            return 2
        runs.append((case, dict(M=m, N=n)))
    results = []
    for case, size in runs:
        func = row_kernel(case, size)
        prog = rows.analyze(func)
        default = rows.default_config(prog)
        if a.default_only and default is None:
            print(f"{case} {size}: no untuned row-program config (the untuned build keeps dlight's schedule)")
            continue
        fits = [default] if a.default_only else rows.configs(prog)
        if a.sample is not None and not a.default_only:
            fits = _sampled(rows, prog, default, fits, a.sample, a.seed)
        configs = [rows.parse_config(c) for c in a.configs] if a.configs else fits
        results.append(run_case(case, func, configs, a.build_only, a.ablate))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    for r in results:
        head = f"\n{r['case']} {r['shape'][0]} x {r['shape'][1]}"
        if "copy_us" in r:
            head += f": copy {r['copy_us']:.1f} us, dlight {r['dlight_us']:.1f} us"
        print(head)
        print(f"{'config':16} {'ok':6} {'rel err':>9} {'fp32 err':>9} {'us':>8} {'% copy':>7}  ptxas")
        for c in sorted(r["configs"], key=lambda c: c.get("us", 1e9)):
            err = f"{c['rel_error']:9.1e}" if "rel_error" in c else f"{'-':>9}"
            err += f" {c['fp32_error']:9.1e}" if "fp32_error" in c else f" {'-':>9}"
            us = f"{c['us']:8.1f} {c['pct_copy']:7.0f}" if "us" in c else f"{'-':>8} {'-':>7}"
            ok = str(c.get("ok", "error" not in c))
            print(f"{c['config']:16} {ok:6} {err} {us}  {c.get('ptxas', c.get('error', ''))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
