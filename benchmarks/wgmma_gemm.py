"""The Hopper wgmma GEMM template on the GPU: configs checked and timed beside cuBLAS (torch.matmul).

For the ANCHORS.md GEMM case (8192^3 fp16, ``relu(A @ W + bias)``, W stored [K, N]) it builds each given
config of ``tvmfuse.kernels.wgmma`` with that epilogue (cp.async or TMA, `` t1``; persistent, `` p1``), checks it
against torch on fresh random inputs with the output poisoned (NaN) first, and times it with TVM's time
evaluator; ``torch.matmul`` alone (cuBLAS) and ``relu(A @ W + b)`` are timed in the same run. Small cases are
checked first: a K-major one (W stored [N, K]) for the first three configs, and for TMA configs also one whose
rows end in a partial tile and a K-major one of more tiles than SMs. ``--build-only`` builds for sm_90a and runs
ptxas (no GPU).

``--conv``: the same for the template's implicit-GEMM conv, on the ANCHORS.md conv case (64 x 256 x 56 x 56,
3x3, pad 1, 256 filters; NHWC in and out, ``relu(conv + bias)``) beside cuDNN's channels-last conv
(``torch.nn.functional.conv2d`` alone and with bias + ReLU). A ResNet-50 7x7 conv (batch 32, 512 channels:
1568 rows, a partial last tile row) is checked too, and for TMA configs a 28x28 one (2 x 32 pixel patches, the
last columns idle).

``--tf32``: fp32 operands and output, the template's TF32 kernels (``wgmma ... k8 .tf32``; B K-major, as TF32
needs; B, the weight, rounded to TF32 beforehand as the planner rounds a model's weights, and the kernel rounding
A's tiles), checked against torch in fp32 with TF32 off, beside cuBLAS / cuDNN in fp32 with TF32 on (PyTorch's
``allow_tf32``).

    python benchmarks/wgmma_gemm.py [--conv] [--tf32] [--configs "g2 m1 n128 k64 s4 r8" ...] [--json out.json]
                                    [--build-only]
    python benchmarks/wgmma_gemm.py --shapes 25088,96,24 1024,1000,2048 c:32,24,56,40 [--configs ...]   # defaults
    python benchmarks/wgmma_gemm.py --shapes c:32,256,14,256 --every-config --jobs 12   # the whole space, built ahead
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tvmfuse.kernels.wgmma import ConvGeometry, GemmSpec, configs, gemm_source, parse, parse_config  # noqa: E402

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def _types(spec: GemmSpec) -> tuple[str, str]:
    """(the TVMScript dtype, torch's name) of the case's operands and output."""
    return ("float32", "float32") if spec.dtype == "float32" else ("float16", "float16")


def conv_spec(n, c, hw, f, r=3, pad=1, stride=1) -> GemmSpec:
    o = (hw + 2 * pad - r) // stride + 1
    g = ConvGeometry(n=n, h=hw, w=hw, c=c, oh=o, ow=o, r=r, s=r, stride=(stride, stride), pad=(pad, pad),
                     dilation=(1, 1))
    return GemmSpec((), n * g.oh * g.ow, f, r * r * c, False, False, True, conv=g)


def kernel(spec: GemmSpec, cfg):
    dt, _ = _types(spec)
    epilogue = "T.max(T.Cast('%s', {acc}) + bias[{col}], T.%s(0))" % (dt, dt)
    if spec.conv is not None:
        g = spec.conv
        params = [f"x: T.Buffer(({g.n}, {g.h}, {g.w}, {g.c}), '{dt}')",
                  f"w: T.Buffer(({spec.n}, {g.r}, {g.s}, {g.c}), '{dt}')",
                  f"bias: T.Buffer(({spec.n},), '{dt}')", f"out: T.Buffer(({g.n}, {g.oh}, {g.ow}, {spec.n}), '{dt}')"]
        store = ("out[{row} // " + f"{g.oh * g.ow}, " + "{row} // " + f"{g.ow} % {g.oh}, " + "{row} % " + f"{g.ow}, "
                 "{col}] = " + epilogue)
        return parse(gemm_source(spec, cfg, params, "x", "w", store, rounded=_weight_rounded(spec)))
    M, N, K = spec.m, spec.n, spec.k
    b_shape = (N, K) if spec.b_kmajor else (K, N)
    params = [f"a: T.Buffer(({M}, {K}), '{dt}')", f"w: T.Buffer({b_shape!r}, '{dt}')",
              f"bias: T.Buffer(({N},), '{dt}')", f"out: T.Buffer(({M}, {N}), '{dt}')"]
    store = "out[{row}, {col}] = " + epilogue
    return parse(gemm_source(spec, cfg, params, "a", "w", store, rounded=_weight_rounded(spec)))


def _weight_rounded(spec) -> tuple:
    """TF32: the weight comes rounded to TF32 (the planner rounds a model's constants once, at compile time) and
    the kernel rounds only the activations' tiles, as in a model."""
    return ("b",) if spec.dtype == "float32" else ()


def _tf32_rounded(w):
    """``w`` (fp32, on the GPU) rounded to TF32 by the planner's own rounding (``tvmfuse.plan.tf32``)."""
    import torch

    from tvmfuse.plan.tf32 import tf32_rounded

    return torch.from_numpy(tf32_rounded(w.cpu().numpy())).to(w.device)


def build(spec, cfg):
    import tvm

    return tvm.compile(kernel(spec, cfg), target=tvm.target.Target(SM90A))


def ptxas(lib) -> str:
    with tempfile.TemporaryDirectory() as d:
        cu = Path(d) / "k.cu"
        cu.write_text(lib.mod.imports[0].inspect_source())
        out = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(Path(d) / "k.cubin"),
                              str(cu)], capture_output=True, text=True)
    if out.returncode:
        return "FAIL " + out.stderr.strip().splitlines()[-1][:200]
    regs = [ln for ln in out.stderr.splitlines() if "registers" in ln]
    return regs[-1].strip() if regs else "ok"


def _why(err: Exception) -> str:
    """What an error says in one line: a TVM diagnostic's ``error:`` line (the source and carets follow it), else
    the last line."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith("error:")] or lines[-1:] or [type(err).__name__]
    return said[0][:200]


def _build_to(job: tuple) -> tuple:
    """A pool worker's build: (spec as JSON, config name, library path) -> (path or None, error, seconds)."""
    spec_json, name, path = job
    t0 = time.time()
    try:
        build(GemmSpec.from_json(spec_json), parse_config(name)).export_library(path)
    except Exception as err:  # noqa: BLE001 - reported in the config's row
        return None, _why(err), time.time() - t0
    return path, None, time.time() - t0


def run_case(spec, cfg, timing: bool, built=None) -> dict:
    """Check (and time) one config; ``built``: a pool's ``_build_to`` result, else it is built here."""
    import torch
    import tvm

    rec = {"config": cfg.name, "b": "conv" if spec.conv else "kmajor" if spec.b_kmajor else "nmajor",
           "shape": [spec.m, spec.n, spec.k]}
    t0 = time.time()
    try:
        if built is not None:
            path, error, seconds = built
            if error:
                raise RuntimeError(error)
            lib, t0 = tvm.runtime.load_module(path), time.time() - seconds
        else:
            lib = build(spec, cfg)
    except Exception as err:  # noqa: BLE001
        rec["error"] = _why(err)
        return rec
    rec["build_s"] = round(time.time() - t0, 2)
    dev = tvm.cuda(0)
    A, W, bias, out, reference = inputs(spec)
    args = [tvm.runtime.from_dlpack(t) for t in (A, W, bias, out)]
    try:
        lib["main"](*args)
        dev.sync()
    except Exception as err:  # noqa: BLE001 - e.g. more shared memory than a block may have
        rec["error"] = _why(err)
        return rec
    ref = reference()
    got = out.float()
    rec["unwritten"] = int(torch.isnan(got).sum())
    rec["rel_error"] = float(torch.linalg.norm(torch.nan_to_num(got - ref)) / torch.linalg.norm(ref))
    rec["ok"] = rec["unwritten"] == 0 and rec["rel_error"] < 1e-2
    if timing and rec["ok"]:
        ev = (lib if built is not None else lib.mod).time_evaluator("main", dev, number=20, repeat=5)
        us = float(np.median(ev(*args).results)) * 1e6
        rec["us"] = round(us, 1)
        rec["tflops"] = round(2 * spec.m * spec.n * spec.k / us / 1e6, 1)
    return rec


def inputs(spec):
    """(A, B, bias, the output poisoned with NaN, a function of the fp32 reference) on the GPU, seeded."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    dtype = getattr(torch, _types(spec)[1])
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    bias = rand(spec.n)
    if spec.conv is not None:
        c = spec.conv
        x, w = rand(c.n, c.h, c.w, c.c), rand(spec.n, c.r, c.s, c.c) * 0.02
        w = _tf32_rounded(w) if _weight_rounded(spec) else w
        out = torch.full((c.n, c.oh, c.ow, spec.n), float("nan"), device="cuda", dtype=dtype)
        return x, w, bias, out, _exact(lambda: torch.relu(torch.nn.functional.conv2d(
            x.float().permute(0, 3, 1, 2), w.float().permute(0, 3, 1, 2), bias.float(), padding=c.pad,
            stride=c.stride, dilation=c.dilation)).permute(0, 2, 3, 1))
    A = rand(spec.m, spec.k)
    W = rand(*((spec.n, spec.k) if spec.b_kmajor else (spec.k, spec.n))) * 0.02
    W = _tf32_rounded(W) if _weight_rounded(spec) else W
    out = torch.full((spec.m, spec.n), float("nan"), device="cuda", dtype=dtype)
    return A, W, bias, out, _exact(lambda: torch.relu((A.float() @ (W.t() if spec.b_kmajor else W).float())
                                                      + bias.float()))


def _exact(reference):
    """``reference`` run in fp32 with PyTorch's TF32 off (the check of a TF32 kernel is against fp32)."""
    import torch

    def run():
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            return reference()
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    return run


def torch_us(spec) -> dict:
    import torch

    def t(f):
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                f()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / 20)
        return float(np.median(times))

    dtype = getattr(torch, _types(spec)[1])
    # fp32 baselines in TF32, the math of the TF32 kernels
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    b = torch.randn(spec.n, device="cuda", dtype=dtype)
    if spec.conv is not None:   # cuDNN, channels-last
        c = spec.conv
        x = torch.randn(c.n, c.c, c.h, c.w, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        w = torch.randn(spec.n, c.c, c.r, c.s, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        conv = torch.nn.functional.conv2d
        return {"cublas_us": round(t(lambda: conv(x, w, padding=c.pad, stride=c.stride)), 1),
                "torch_fused_us": round(t(lambda: torch.relu(conv(x, w, b, padding=c.pad, stride=c.stride))), 1)}
    A = torch.randn(spec.m, spec.k, device="cuda", dtype=dtype)
    W = torch.randn(spec.k, spec.n, device="cuda", dtype=dtype)
    return {"cublas_us": round(t(lambda: A @ W), 1), "torch_fused_us": round(t(lambda: torch.relu(A @ W + b)), 1)}


def shapes_table(shapes: list[str], extra: list, every: bool = False, jobs: int = 1, build_only: bool = False) -> int:
    """``--shapes``: each GEMM at its default config (:func:`default_config`) and the ``extra`` configs that fit
    (``every``: each config of the tuner's space), checked and timed, beside cuBLAS in the same process; a table
    last. ``jobs`` > 1: the kernels are built ahead by that many processes while the GPU checks and times."""
    from tvmfuse.kernels.wgmma import default_config

    cases = []   # (spec, its configs in order) per shape, or an error row
    for text in shapes:
        if text.startswith("c:"):   # c:N,C,HW,F[,R[,STRIDE]]: an NHWC conv, padded to keep R // 2
            n_, c_, hw, f, *rest = (int(x) for x in text[2:].split(","))
            r, st = (rest + [3, 1][len(rest):])[:2]
            spec = conv_spec(n_, c_, hw, f, r, r // 2, st)
            m, n, k = spec.m, spec.n, spec.k
        else:
            parts = text.split(",")
            m, n, k = (int(x) for x in parts[:3])
            spec = GemmSpec((), m, n, k, False, False, parts[3:] == ["t"])
        # (the --configs asked for may go past the tuner's space: 2 stages, K steps of 32 unswizzled, staged stores)
        fits = configs(spec, tma=(0, 1), stages=(2, 3, 4, 5), block_k=(64, 32), swizzle=(128, 0), staged=(0, 1),
                       split=(1, 2, 3, 4, 6, 8))
        if not fits:
            cases.append(({"shape": [m, n, k], "error": "no config takes it"}, []))
            continue
        # (the tuner's choices, search_spaces/cuda.yaml's wgmma_* knobs)
        space = configs(spec, raster=(8, 4, 1), tma=(0, 1), persistent=(0, 1), staged=(0, 1)) if every else []
        cases.append((spec, list(dict.fromkeys([default_config(spec), *(c for c in extra if c in fits), *space]))))
    if build_only:   # sm_90a kernels through ptxas, no GPU
        bad = 0
        for spec, cfgs in [c for c in cases if not isinstance(c[0], dict)]:
            for c in cfgs:
                try:
                    said = ptxas(build(spec, c))
                except Exception as err:  # noqa: BLE001 - reported, the others go on
                    said = "FAIL " + _why(err)
                bad += said.startswith("FAIL")
                print(f"{spec.m} x {spec.n} x {spec.k} {c.name}: {said}", flush=True)
        return 1 if bad else 0
    built = _prebuild(cases, jobs)
    rows = []
    for spec, cfgs in cases:
        if isinstance(spec, dict):
            rows.append(spec)
            continue
        base = torch_us(spec)
        for i, c in enumerate(cfgs):
            done = built.pop((spec, c)).result() if (spec, c) in built else None
            rows.append({**run_case(spec, c, timing=True, built=done), "default": i == 0,
                         "cublas_us": base["cublas_us"]})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'M x N x K':22} {'B':7} {'config':30} {'ok':5} {'rel err':>9} {'us':>9} {'cuBLAS':>8} {'ratio':>6}")
    for r in rows:
        us, shape = r.get("us"), " x ".join(str(x) for x in r["shape"])
        name = r.get("config", "-") + (" (default)" if r.get("default") else "")
        ratio = f"{us / r['cublas_us']:6.2f}" if us else "     -"
        print(f"{shape:22} {r.get('b', '-'):7} {name:30} {str(r.get('ok', r.get('error', '')))[:5]:5} "
              f"{r.get('rel_error', float('nan')):9.2e} {us or '-':>9} {r.get('cublas_us', '-'):>8} {ratio}")
    return 0


def _prebuild(cases: list, jobs: int, out: Path | None = None) -> dict:
    """(spec, config) -> a future of :func:`_build_to`, submitted in the order the GPU takes them, the libraries
    written under ``out`` (default: a new temporary folder); {} for 1 job."""
    if jobs <= 1:
        return {}
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    out = out or Path(tempfile.mkdtemp(prefix="wgmma_libs_"))
    # spawn: a forked worker would inherit the parent's CUDA context, which the timing initialises
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    futures, i = {}, 0
    for spec, cfgs in cases:
        for c in cfgs:
            futures[(spec, c)] = pool.submit(_build_to, (spec.to_json(), c.name, str(out / f"k{i}.so")))
            i += 1
    pool.shutdown(wait=False)
    return futures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=None)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--json", default=None)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--conv", action="store_true", help="the implicit-GEMM conv instead of the GEMM")
    ap.add_argument("--tf32", action="store_true", help="fp32 operands on the TF32 kernels (B K-major)")
    ap.add_argument("--shapes", nargs="*", default=None,
                    help="GEMMs M,N,K (a trailing ,t: W stored [N, K]) or convs c:N,C,HW,F[,R[,STRIDE]], each at "
                         "its untuned default and the "
                         "--configs that fit it, checked and timed beside cuBLAS; columns and K need not be whole "
                         "tiles")
    ap.add_argument("--every-config", action="store_true",
                    help="--shapes: every config of the tuner's space too (a table of the whole space)")
    ap.add_argument("--jobs", type=int, default=1, help="--shapes: build kernels ahead in this many processes")
    a = ap.parse_args()
    if a.shapes:
        return shapes_table(a.shapes, [parse_config(c) for c in a.configs or []], a.every_config, a.jobs,
                            a.build_only)
    if a.conv:
        spec, small = conv_spec(64, 256, 56, 256), conv_spec(32, 512, 7, 512)
    else:
        spec = GemmSpec(batch=(), m=a.size, n=a.size, k=a.size, a_batched=False, b_batched=False, b_kmajor=a.tf32)
        small = GemmSpec((), 1024, 1024, 1024, False, False, True)
    tf32 = (lambda s: s if s is None or not a.tf32 else replace(s, dtype="float32", b_kmajor=True))  # noqa: E731
    spec, small = tf32(spec), tf32(small)
    cfgs = [parse_config(c) for c in a.configs] if a.configs else configs(spec)
    if a.build_only:
        for c in cfgs:
            for s in (spec, small):
                if c.tma and c not in configs(s, tma=(0, 1), persistent=(0, 1)):
                    print(c.name, "does not fit", s)
                    continue
                t0 = time.time()
                print(c.name, "conv" if s.conv else "kmajor" if s.b_kmajor else "nmajor", ptxas(build(s, c)), f"{time.time() - t0:.1f}s",
                      flush=True)
        return 0
    rows = []
    # small checks: the first three configs on a K-major B; TMA configs also on an N-major B with a partial last
    # tile row (TMA's zero fill past the tensor)
    # (a conv: 28 x 28 outputs, TMA's 2 x 32 pixel patches with their last 4 columns idle)
    tail = tf32(conv_spec(8, 128, 28, 128) if a.conv else GemmSpec((), 1000, 1024, 1024, False, False, False))
    many = tf32(None if a.conv else GemmSpec((), 4000, 2048, 512, False, False, True))   # > 132 tiles: persistent
    for i, c in enumerate(cfgs):                                                  # take one or two each
        for s in (small, tail, many):
            if s is not None and (i < 3 or c.tma) and c in configs(s, tma=(0, 1), persistent=(0, 1)):
                rows.append(run_case(s, c, timing=False))
                print(json.dumps(rows[-1]), flush=True)
    base = torch_us(spec)
    for c in cfgs:
        rows.append(run_case(spec, c, timing=True))
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"torch": base, "rows": rows}, indent=1))
    lib, op = ("cuDNN", "conv") if a.conv else ("cuBLAS", "A@W")
    print(f"\n{lib} {op} {base['cublas_us']} us ({2 * spec.m * spec.n * spec.k / base['cublas_us'] / 1e6:.0f} "
          f"TFLOP/s), torch relu({op}+b) {base['torch_fused_us']} us")
    print(f"{'config':24} {'B':7} {'ok':5} {'rel err':>9} {'us':>9} {'TFLOP/s':>8} {'x ' + lib:>8}")
    for r in rows:
        us = r.get("us")
        print(f"{r['config']:24} {r['b']:7} {str(r.get('ok', r.get('error', '')))[:5]:5} "
              f"{r.get('rel_error', float('nan')):9.2e} {us or '-':>9} {r.get('tflops', '-'):>8} "
              f"{(base['cublas_us'] / us) if us else float('nan'):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
