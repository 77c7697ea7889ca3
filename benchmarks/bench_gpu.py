#!/usr/bin/env python3
"""The ANCHORS.md GPU cases side by side in one run: PyTorch eager, torch.compile, stock TVM, tvmfuse tuned.

Each case is a small ONNX model (tvmfuse/bench/cases.py, fp16); ``resnet50`` (batch 32, 224x224) and
``bert_base`` (batch 8 x 512) are whole models built on the spot with random weights
(tvmfuse/bench/models.py; run them with ``--cases resnet50,bert_base``). Stages (``--stages``):
  torch    PyTorch eager and torch.compile (plus cuBLAS GEMM alone and SDPA-flash where they apply),
           and the device-to-device copy ceiling (bytes read + written), measured in the same run;
  stock    TVM 0.27's default CUDA pipeline (FuseOps + FuseTIR + dlight);
  tvmfuse  tvmfuse's planner, each fused kernel tuned in tvmfuse's search space (``--trials`` per kernel,
           records in ``--db``, resumed when carried back in), every tuned kernel checked against its
           reference schedule on fresh random inputs with NaN-poisoned outputs, the whole case checked
           against an fp32 PyTorch run of the same ONNX graph, then timed.
Prints µs, GB/s (fewest bytes: inputs once, output once) or TFLOP/s, the share of the copy ceiling, and
each kernel's tuning curve (trials to reach 90% of its final speed). Writes ``$OUT/bench_gpu.json``.

``--small`` runs tiny sizes (a CPU smoke test of the script needs ``--stages tvmfuse --target llvm``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tvmfuse.bench.cases import CASES, SMALL  # noqa: E402
from tvmfuse.bench.models import MODELS, SMALL_MODELS  # noqa: E402

OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench_gpu-"))
OUT.mkdir(parents=True, exist_ok=True)
T0 = time.time()
KEEP: dict = {}   # per case: the PyTorch baselines' calls and tvmfuse's build, for --interleave
TORCH_DEVICE = "cuda"   # the PyTorch side's device ("cpu": tests/bench/test_torch_replay.py runs it at tiny sizes)
# _bench_torch's samples: ``repeat`` of them, each at least ``min_number`` calls and ``min_sample_s`` long, after
# ``warmup_s`` of calls. The CPU test of the PyTorch side takes one call a sample: it checks that every case runs, not
# how fast, and 100 calls of a case in fp16 on a CPU take minutes
TORCH_TIMING = {"repeat": 10, "min_number": 10, "min_sample_s": 0.030, "warmup_s": 0.025}


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ------------------------------------------------------------------------------------------- torch
def _bench_torch(fn):
    """Seconds per call of ``fn``, timed as tvmfuse's side is (``_time_vm``: TVM's time evaluator, number 10,
    repeat 10, each repeat at least 30 ms): after a 25 ms warm-up, 10 repeats of back-to-back calls between two
    CUDA events, each at least 30 ms, the median. Sustained load lowers the H200's clock, and more for some kernels
    than for others (2026-11-30: a GEMM kernel timed 1668 us in a 20 ms burst and 2020 us sustained), so both sides
    get the same load. (Until 2026-12-01 this was triton's ``do_bench``: 100 ms of calls, each after an L2 flush.)"""
    import torch

    from tvmfuse.bench import call_samples

    fn()
    cuda = TORCH_DEVICE == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t = TORCH_TIMING
    once = max(call_samples(fn, repeat=1, number=3, cuda=cuda)[0], 1e-6)
    call_samples(fn, repeat=1, number=max(1, int(t["warmup_s"] / once)), cuda=cuda)    # warm-up
    # calls per repeat: at least min_number, and enough to last min_sample_s
    number = max(t["min_number"], int(np.ceil(t["min_sample_s"] / once)))
    return float(np.median(call_samples(fn, repeat=t["repeat"], number=number, cuda=cuda)))


def copy_ceiling() -> float:
    import torch

    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    t = _bench_torch(lambda: b.copy_(a))
    del a, b
    torch.cuda.empty_cache()
    return 2 * 2 * 1024**3 / t / 1e9


def torch_case(name: str, size: dict, model=None) -> dict:
    """Eager and torch.compile times (seconds) of the case, written the way a PyTorch user writes it.

    Whole models (``MODELS``) run their ONNX graph through tvmfuse.bench.torch_onnx, op by op in eager
    mode and as one graph under torch.compile; a CNN in both layouts, the faster kept.
    """
    import torch
    import torch.nn.functional as F

    dev, h = TORCH_DEVICE, torch.float16
    torch.manual_seed(0)
    extra: dict = {}
    if name in MODELS:
        from tvmfuse.bench.torch_onnx import build_fn

        shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
        torch.backends.cudnn.benchmark = True
        x = torch.randn(*shape, device=dev, dtype=h)
        if len(shape) == 4:
            # a CNN in both layouts, the faster one kept: on the H200 (2026-12-01) torch.compile of ResNet-50 b32
            # took 2128 us NCHW and 2380 us channels-last in one run, 1857 us channels-last in another
            by_layout = {}
            for layout in ("NCHW", "channels_last"):
                cl = layout == "channels_last"
                xi = x.contiguous(memory_format=torch.channels_last) if cl else x
                by_layout[layout] = _eager_and_compiled(build_fn(model, dev, channels_last=cl), (xi,))
            best = min(by_layout, key=lambda k: by_layout[k][0]["compile_s"])
            r, call = by_layout[best]
            # copies: the kept layout's record is one of them, and may not hold itself
            r.update(layout=f"{best} (the faster under torch.compile), cudnn.benchmark; the ONNX graph as a module",
                     by_layout={k: dict(v[0]) for k, v in by_layout.items()})
            KEEP.setdefault(name, {})["compile_s"] = call
            return r
        f, args = build_fn(model, dev), (x,)
        extra["layout"] = "the ONNX graph as a module"
    elif name == "pointwise":
        M, N = size.get("M", 16384), size.get("N", 8192)
        x, res = torch.randn(M, N, device=dev, dtype=h), torch.randn(M, N, device=dev, dtype=h)
        b, s = torch.randn(N, device=dev, dtype=h), torch.randn(N, device=dev, dtype=h)
        f, args = (lambda x, res: F.gelu(x + b) * s + res), (x, res)
    elif name == "add_layernorm":
        M, N = size.get("M", 16384), size.get("N", 8192)
        x, res = torch.randn(M, N, device=dev, dtype=h), torch.randn(M, N, device=dev, dtype=h)
        w, bb = torch.randn(N, device=dev, dtype=h), torch.randn(N, device=dev, dtype=h)
        f, args = (lambda x, res: F.layer_norm(x + res, (N,), w, bb)), (x, res)
    elif name in ("layernorm", "rmsnorm"):
        M, N = size.get("M", 16384), size.get("N", 4096)
        x, w, bb = torch.randn(M, N, device=dev, dtype=h), torch.randn(N, device=dev, dtype=h), torch.randn(N, device=dev, dtype=h)
        if name == "layernorm":
            f = lambda x: F.layer_norm(x, (N,), w, bb)  # noqa: E731
        else:
            f = lambda x: x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w  # noqa: E731
        args = (x,)
    elif name == "swiglu":
        M, N = size.get("M", 16384), size.get("N", 8192)
        a, g = torch.randn(M, N, device=dev, dtype=h), torch.randn(M, N, device=dev, dtype=h)
        f, args = (lambda a, g: F.silu(a) * g), (a, g)
    elif name == "softmax":
        M, N = size.get("M", 65536), size.get("N", 2048)
        f, args = (lambda z: torch.softmax(z, dim=-1)), (torch.randn(M, N, device=dev, dtype=h),)
    elif name == "gemm_bias_relu":
        M, K, N = size.get("M", 8192), size.get("K", 8192), size.get("N", 8192)
        A, W = torch.randn(M, K, device=dev, dtype=h), torch.randn(K, N, device=dev, dtype=h) * 0.02
        bg = torch.randn(N, device=dev, dtype=h)
        f, args = (lambda A: torch.relu(A @ W + bg)), (A,)
        extra["cublas_gemm_alone_s"] = _bench_torch(lambda: A @ W)
        KEEP.setdefault(name, {})["cublas_gemm_alone_s"] = lambda: A @ W
    elif name == "llama_mlp":
        M, H_, I_ = size.get("M", 2048), size.get("H", 4096), size.get("I", 11008)
        x = torch.randn(M, H_, device=dev, dtype=h)
        Wg, Wu = (torch.randn(H_, I_, device=dev, dtype=h) * 0.02 for _ in range(2))
        Wd = torch.randn(I_, H_, device=dev, dtype=h) * 0.02
        f, args = (lambda x: (F.silu(x @ Wg) * (x @ Wu)) @ Wd), (x,)
    elif name == "conv_bn_relu":
        B, C, H, W_ = size.get("B", 64), size.get("C", 256), size.get("H", 56), size.get("W", 56)
        xc = torch.randn(B, C, H, W_, device=dev, dtype=h).to(memory_format=torch.channels_last)
        conv = torch.nn.Conv2d(C, C, 3, padding=1, bias=False).to(dev, h).to(memory_format=torch.channels_last)
        bn = torch.nn.BatchNorm2d(C).to(dev, h).eval()
        f, args = (lambda z: torch.relu(bn(conv(z)))), (xc,)
        extra["layout"] = "NHWC in and out on both sides (torch channels_last; the ONNX model wraps its Conv in Transposes)"
    elif name == "attention":
        B, H, S, D = size.get("B", 4), size.get("H", 32), size.get("S", 4096), size.get("D", 128)
        q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=h) for _ in range(3))
        f, args = (lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) * D**-0.5, dim=-1) @ v), (q, k, v)
        extra["sdpa_flash_s"] = _bench_torch(lambda: F.scaled_dot_product_attention(q, k, v))
        KEEP.setdefault(name, {})["sdpa_flash_s"] = lambda: F.scaled_dot_product_attention(q, k, v)
    else:
        raise KeyError(name)
    r, call = _eager_and_compiled(f, args)
    KEEP.setdefault(name, {})["compile_s"] = call
    r.update(extra)
    return r


def _eager_and_compiled(f, args) -> tuple[dict, object]:
    """Eager and torch.compile seconds of ``f(*args)``, and the compiled call (for ``--interleave``)."""
    import torch

    r: dict = {}
    with torch.no_grad():
        r["eager_s"] = _bench_torch(lambda: f(*args))
        c = torch.compile(f)
        t0 = time.time()
        c(*args)
        if TORCH_DEVICE == "cuda":
            torch.cuda.synchronize()
        r["compile_build_s"] = time.time() - t0
        r["compile_s"] = _bench_torch(lambda: c(*args))
    return r, (lambda: c(*args))


# --------------------------------------------------------------------------------------------- TVM
def _inputs(loaded, target, seed):
    """Fresh random inputs: numpy arrays and the device tensors made from them."""
    from tvmfuse._tvm import tvm

    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(tuple(s.shape), dtype=np.float32).astype(s.dtype) for s in loaded.inputs]
    dev = target.tvm_device()
    return arrays, [tvm.runtime.tensor(a, dev) for a in arrays]


def _vm(exe, target, args, params=()):
    """A VM of the build on the target's device, its ``main``'s arguments (inputs, then lifted weights) and the device."""
    from tvmfuse._tvm import relax, tvm

    dev = target.tvm_device()
    return relax.VirtualMachine(exe, dev), list(args) + [tvm.runtime.tensor(p.numpy(), dev) for p in params], dev


def _time_vm(exe, target, args, params=()):
    vm, full, dev = _vm(exe, target, args, params)
    out = vm["main"](*full)
    dev.sync()
    te = vm.time_evaluator("main", dev, number=10, repeat=10, min_repeat_ms=30)
    # (On the H200, 2026-11-30, timing the call as a saved VM closure measured the same as this, 3906 vs 3903 us
    # for the GEMM case: the gap between a case and its tuned kernels is not per-call VM overhead.)
    return float(np.median(te(*full).results)), out


def interleaved(name: str, rounds: int) -> dict:
    """The case's tvmfuse build and its PyTorch baselines timed in turn, ``rounds`` times (A B A B ...): the H200's
    clock drifts with load and temperature (the eleventh session saw cuBLAS move 1609 -> 1673 us between runs),
    so a ratio of two figures taken minutes apart carries that drift; each round's ratio does not. Returns the
    per-round seconds and the median per-round ratio (baseline / tvmfuse: above 1, tvmfuse is faster)."""
    import torch

    exe, target, args, params = KEEP[name]["tvmfuse"]
    torch_fns = {k: f for k, f in KEEP[name].items() if k != "tvmfuse"}
    out: dict = {"tvmfuse_s": [], **{k: [] for k in torch_fns}}
    for _ in range(rounds):
        out["tvmfuse_s"].append(_time_vm(exe, target, args, params)[0])
        with torch.no_grad():
            for k, f in torch_fns.items():
                out[k].append(_bench_torch(f))
    out["ratio"] = {k: float(np.median([b / a for a, b in zip(out["tvmfuse_s"], out[k])])) for k in torch_fns}
    return out


def top_kernels(fn, k=12, runs=5) -> list[dict]:
    """The ``k`` CUDA kernels taking the most device time over ``runs`` calls of ``fn`` (torch.profiler's CUPTI
    trace: it sees TVM's kernels too), each with its calls and microseconds per call of ``fn``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:k]
    return [{"kernel": e.key[:100], "calls_per_run": e.count // runs, "us_per_run": e.device_time_total / runs}
            for e in rows]


def profile_build(name: str) -> list[dict]:
    """Where the tvmfuse build's time goes: its heaviest kernels in one run of the whole model."""
    vm, full, dev = _vm(*KEEP[name]["tvmfuse"])
    return top_kernels(lambda: (vm["main"](*full), dev.sync()))


def reference(model, arrays, target):
    """fp32 run of the same ONNX graph (PyTorch on the GPU, onnxruntime on the CPU)."""
    if target.is_gpu:
        import torch

        from tvmfuse.bench.torch_onnx import build_fn

        fn = build_fn(model, "cuda", float_dtype=torch.float32)
        with torch.no_grad():
            args = [torch.from_numpy(a).cuda() for a in arrays]
            outs = fn(*[t.float() if t.is_floating_point() else t for t in args])   # token ids stay integers
        res = [o.double().cpu().numpy() for o in outs]
        del outs
        torch.cuda.empty_cache()
        return res
    names = [i.name for i in model.graph.input]
    return run_onnxruntime_proto(model, dict(zip(names, arrays)))


def run_onnxruntime_proto(model, feeds):
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(x) for x in sess.run(None, feeds)]


def _first(out):
    from tvmfuse.runtime.loaded import _flatten

    return [t.numpy() for t in _flatten(out)]


def stock_case(path, loaded, target, args, ref) -> dict:
    from tvmfuse._tvm import from_onnx, tvm
    from tvmfuse.verify import relative_error

    t0 = time.time()
    mod = from_onnx(loaded.proto, keep_params_in_input=False)
    with target.target:
        exe = tvm.compile(mod, target.target)
    build_s = time.time() - t0
    t, out = _time_vm(exe, target, args)
    return {"s": t, "build_s": build_s, "rel_error": relative_error(_first(out)[0], ref[0])}


def trials_to_90(curve):
    """Trials after which the best latency is within 1/0.9 of the final best (None if no curve)."""
    pts = [(n, b) for n, b in curve if b is not None]
    if not pts:
        return None
    final = pts[-1][1]
    for n, b in pts:
        if b <= final / 0.9:
            return n
    return pts[-1][0]


def tvmfuse_case(name, path, loaded, target, args, ref, *, db_path, trials, deadline_s, ungated=False) -> dict:
    from tvmfuse.compile import build
    from tvmfuse.db import open_database
    from tvmfuse.frontend import import_model
    from tvmfuse.plan import partition
    from tvmfuse.tune import TuneConfig, extract_kernels, tune_kernels
    from tvmfuse.tune.check import check_kernel
    from tvmfuse.verify import relative_error

    rec: dict = {}
    t0 = time.time()
    mod = import_model(loaded)
    # --ungated: the gate and up projections as two GEMMs (rewrites.gated_gemm off), the A/B of that rewrite
    fused, plan = partition(mod, target=target, cost_overrides={"gated_gemm_rows": 0} if ungated else None)
    rec["patterns"] = [g.pattern for g in plan.groups]
    kernels = extract_kernels(fused, target=target)
    rec["kernels_planned"] = [k.name for k in kernels]
    db = open_database(db_path, target=target)
    try:
        left = deadline_s - (time.time() - T0)
        budget = trials if left > 60 else 0
        if budget == 0:
            log(f"{name}: no time left to tune (deadline); building from the database as it is")
        cfg = TuneConfig(trials=budget * len(kernels), trials_per_kernel=budget, trials_per_round=min(10, max(1, budget)),
                         population=32, max_workers=min(16, os.cpu_count() or 4), builder_timeout_s=120,
                         runner_timeout_s=60, log_dir=OUT / "mslogs" / name,
                         time_budget_s=max(0.0, left - 60))  # leave time to check, build and time the case
        res = tune_kernels(kernels, target=target, database=db, config=cfg, model=name)
        rec["tune_s"] = time.time() - t0
        rec["tuning"] = [r.to_json() for r in res]
        for r in rec["tuning"]:
            r["trials_to_90pct"] = trials_to_90([(n, b) for n, b in r["curve"]])
        # every tuned kernel against its reference schedule, poisoned outputs, random inputs: the tuner checked
        # the kernels it tuned in this run; the others (records carried in) are checked here
        checks = []
        for k, r in zip(kernels, res):
            if r.check is not None:
                checks.append({"name": k.name, **r.check})
                continue
            with target.target:
                sch = db.query_schedule(k.mod, target.target, k.name)
            if sch is None:
                checks.append({"name": k.name, "ok": None, "note": "no record"})
                continue
            try:
                checks.append(check_kernel(k.mod, sch.mod, target, name=k.name, seed=int(time.time()) % 10000).to_json())
            except Exception as err:  # noqa: BLE001
                checks.append({"name": k.name, "ok": False, "note": f"check failed: {str(err).splitlines()[0][:200]}"})
        rec["kernel_checks"] = checks
        t1 = time.time()
        built = build(fused, target=target, database=db)
        rec["build_s"] = time.time() - t1
        rec["schedules"] = [k.to_json() for k in built.kernels]
        rec["untuned"] = built.untuned
    finally:
        db.close()
    t, out = _time_vm(built.executable, target, args, built.lifted_params)
    KEEP.setdefault(name, {})["tvmfuse"] = (built.executable, target, args, built.lifted_params)
    rec["s"] = t
    # each kernel as often as the model calls it (ResNet-50 b32, 2026-12-01: 2070 us weighted, 1151 us counting each
    # of its 28 kernels once, against 2117 us for the model)
    calls = {k.name: k.weight for k in kernels}
    rec["kernel_sum_s"] = sum(k.best_ms * calls.get(k.name, 1) for k in built.kernels if k.best_ms) / 1e3
    rec["rel_error"] = relative_error(_first(out)[0], ref[0])
    return rec


# ---------------------------------------------------------------------------------------------- main
def fmt_us(s):
    return "-" if s is None else f"{s * 1e6:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--stages", default="torch,stock,tvmfuse")
    ap.add_argument("--trials", type=int, default=20, help="tuning trials per fused kernel")
    ap.add_argument("--ungated", action="store_true",
                    help="also time tvmfuse with gated GEMMs off (a row 'CASE ungated'): the A/B of the rewrite")
    ap.add_argument("--db", default=None, help="tuning database (default $OUT/tvmfuse_gpu.db)")
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=520.0, help="stop starting new tuning after this")
    ap.add_argument("--merge", nargs="*", default=[], help="earlier bench_gpu.json files to show beside")
    ap.add_argument("--profile", action="store_true",
                    help="list the tvmfuse build's heaviest kernels in a run of the whole case (torch.profiler)")
    ap.add_argument("--interleave", type=int, default=0,
                    help="after both sides ran, time tvmfuse and the PyTorch baselines in turn this many rounds")
    a = ap.parse_args()
    stages = set(a.stages.split(","))
    cases = [c for c in a.cases.split(",") if c]
    rows: dict = {}
    for m in a.merge:
        try:
            prev = json.loads(Path(m).read_text())
            for c, r in prev.get("cases", {}).items():
                rows.setdefault(c, {}).update(r)
            if prev.get("copy_GBps") and "torch" not in stages:
                rows.setdefault("_meta", {})["copy_GBps_merged"] = prev["copy_GBps"]
        except Exception as err:  # noqa: BLE001
            log("merge", m, "failed:", err)
    meta = rows.pop("_meta", {})
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cases": rows}
    copy = None
    try:
        import torch

        if torch.cuda.is_available():
            result["device"] = torch.cuda.get_device_name()
            result["torch"] = torch.__version__
            copy = copy_ceiling()
            log(f"copy ceiling {copy:.0f} GB/s")
    except ImportError:
        pass
    copy = copy or meta.get("copy_GBps_merged")
    result["copy_GBps"] = copy

    def save():
        (OUT / "bench_gpu.json").write_text(json.dumps(result, indent=1, default=str))

    target = None
    if stages & {"stock", "tvmfuse"}:
        from tvmfuse.frontend import load_model
        from tvmfuse.target import resolve_target

        target = resolve_target(a.target)
        result["tvm_target"] = target.canonical
        import shutil

        db_path = OUT / "tvmfuse_gpu.db"
        if a.db and Path(a.db).resolve() != db_path.resolve():
            shutil.copy(a.db, db_path)
    tmp = Path(tempfile.mkdtemp(prefix="cases-"))
    for name in cases:
        if name not in CASES and name not in MODELS:
            log(name, "unknown case; cases:", ", ".join([*CASES, *MODELS]))
            continue
        size = ({**SMALL, **SMALL_MODELS}[name] if a.small else {})
        model, bytes_min, flops = {**CASES, **MODELS}[name](**size)
        row = rows.setdefault(name, {})
        row.update(bytes_min=bytes_min, flops=flops, size=size or "anchors")
        if "torch" in stages and copy:
            try:
                log(name, "torch")
                row["torch"] = torch_case(name, size, model)
            except Exception as err:  # noqa: BLE001
                row["torch"] = {"error": str(err).splitlines()[0][:300]}
            save()
        if target is None:
            continue
        import onnx

        path = tmp / f"{name}.onnx"
        onnx.save(model, path)
        loaded = load_model(path)
        arrays, args = _inputs(loaded, target, seed=int(time.time()) % 100000)
        ref = reference(loaded.proto, arrays, target)
        if "stock" in stages:
            try:
                log(name, "stock TVM")
                row["stock"] = stock_case(path, loaded, target, args, ref)
            except Exception as err:  # noqa: BLE001
                row["stock"] = {"error": str(err).strip().splitlines()[-1][:300]}
            save()
        if "tvmfuse" in stages:
            try:
                log(name, "tvmfuse")
                row["tvmfuse"] = tvmfuse_case(name, path, loaded, target, args, ref, db_path=db_path,
                                              trials=a.trials, deadline_s=a.deadline_s)
            except Exception as err:  # noqa: BLE001
                traceback.print_exc()
                row["tvmfuse"] = {"error": str(err).strip().splitlines()[-1][:300]}
            save()
            if a.ungated and "gated_gemm" in row["tvmfuse"].get("patterns", []):
                try:
                    log(name, "tvmfuse, gated GEMMs off")
                    rows.setdefault(name + " ungated", {}).update(
                        torch=row.get("torch", {}), bytes_min=bytes_min, flops=flops,
                        tvmfuse=tvmfuse_case(name + "_ungated", path, loaded, target, args, ref, db_path=db_path,
                                             trials=a.trials, deadline_s=a.deadline_s, ungated=True))
                except Exception as err:  # noqa: BLE001
                    traceback.print_exc()
                    rows.setdefault(name + " ungated", {})["tvmfuse"] = {"error": str(err).strip()[-300:]}
                save()
        if a.profile and copy and "tvmfuse" in KEEP.get(name, {}):
            log(name, "profile")
            row["tvmfuse_profile"] = profile_build(name)
            save()
        if a.interleave and "tvmfuse" in KEEP.get(name, {}) and len(KEEP[name]) > 1:
            log(name, f"interleaved: {a.interleave} rounds")
            row["interleaved"] = interleaved(name, a.interleave)
            save()
        del args
        KEEP.pop(name, None)
        if copy:
            import torch

            torch.cuda.empty_cache()
    save()
    # ---- the table
    print()
    print(f"copy ceiling: {copy:.0f} GB/s" if copy else "copy ceiling: not measured")
    hdr = ("case", "eager us", "compile us", "stock TVM us", "tvmfuse us", "tvmfuse BW/TFLOPs", "%copy",
           "vs compile", "check", "trials->90%")
    print("%-15s %9s %10s %12s %10s %17s %6s %10s %12s %11s" % hdr)
    for name in [c for n in cases for c in (n, n + " ungated") if c in rows]:
        r = rows.get(name, {})
        tr, st, tf = r.get("torch", {}), r.get("stock", {}), r.get("tvmfuse", {})
        t = tf.get("s")
        perf, share = "-", "-"
        if t:
            if r.get("flops"):
                perf = f"{r['flops'] / t / 1e12:.0f} TFLOP/s"
            else:
                gbs = r["bytes_min"] / t / 1e9
                perf = f"{gbs:.0f} GB/s"
                share = f"{100 * gbs / copy:.0f}%" if copy else "-"
        vs = f"{tr['compile_s'] / t:.2f}x" if t and tr.get("compile_s") else "-"
        ok = "-"
        if "rel_error" in tf:
            kc = tf.get("kernel_checks", [])
            good = tf["rel_error"] <= 1e-2 and all(c.get("ok") is not False for c in kc)
            ok = ("ok" if good else "WRONG") + f" {tf['rel_error']:.0e}"
        t90 = ",".join(str(k.get("trials_to_90pct")) for k in tf.get("tuning", []))
        print("%-15s %9s %10s %12s %10s %17s %6s %10s %12s %11s" % (
            name, fmt_us(tr.get("eager_s")), fmt_us(tr.get("compile_s")), fmt_us(st.get("s")), fmt_us(t), perf,
            share, vs, ok, t90 or "-"))
        for k in ("cublas_gemm_alone_s", "sdpa_flash_s"):
            if tr.get(k):
                print(f"{'':15s}   {k}: {tr[k] * 1e6:.0f} us")
        for k, ratio in r.get("interleaved", {}).get("ratio", {}).items():
            n = len(r["interleaved"]["tvmfuse_s"])
            print(f"{'':15s}   interleaved x{n}: {k[:-2]} / tvmfuse = {ratio:.3f} (median of per-round ratios)")
        for p in r.get("tvmfuse_profile", [])[:8]:
            print(f"{'':15s}   {p['us_per_run']:8.1f} us  x{p['calls_per_run']:<3d} {p['kernel'][:70]}")
        if tf.get("kernel_sum_s"):
            print(f"{'':15s}   tvmfuse kernels x their calls (as timed in tuning): {tf['kernel_sum_s'] * 1e6:.0f} us")
        if tf.get("error") or st.get("error"):
            print(f"{'':15s}   errors: tvmfuse={tf.get('error')} stock={st.get('error')}")
        if tf.get("untuned"):
            print(f"{'':15s}   untuned kernels: {tf['untuned']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
