"""Causal and grouped-query attention through the real planner on the GPU, beside PyTorch SDPA.

Each case is an ONNX graph made with onnx.helper (Q, K, V inputs; a constant causal mask as torch exports it; K/V
heads repeated as transformers' ``repeat_kv`` exports them), imported and partitioned by tvmfuse's planner for CUDA
(so the mask and the head repeat are recognised there, or the run says they were not), built with the untuned
default flash kernel, checked against torch in fp32 on the model's outputs (output poisoned first), and timed with
TVM's time evaluator beside ``torch.nn.functional.scaled_dot_product_attention`` in the same process:

(a) B8 H16 S2048 D64 fp16: unmasked vs causal (mask recognised) vs SDPA(is_causal=False / True);
(b) GQA B4 Hq32 Hkv8 S4096 D128 causal vs SDPA(is_causal=True, enable_gqa=True).

    python benchmarks/attention_causal_gpu.py [--configs N] [--small] [--dry-run]

``--configs N`` also times the first N other tile configs of the template's space for each case, one by one.
``--dry-run`` plans each case for CUDA and builds every kernel it would run with nvcc, without a GPU;
``--small`` runs small shapes on llvm end to end against onnxruntime (no GPU, no torch needed).
Writes ``$OUT/attention_causal_gpu.json`` when ``$OUT`` is set; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


def attention_onnx(*, batch=1, heads=4, kv_heads=None, seq_q=16, seq_k=None, dim=16, mask="const", repeat="expand",
                   dtype="float32", mask_value=None, scale=None, padding=False, window=None,
                   heads_out=False) -> onnx.ModelProto:
    """softmax(Q Kᵀ * scale + mask) V as an ONNX graph with inputs q [B, H, Sq, D], k and v [B, Hkv, Sk, D].

    ``mask``: ``none``; ``const`` (a [1, 1, Sq, Sk] constant, 0 where key j <= i + Sk - Sq, ``mask_value``
    elsewhere, as torch exports it); ``where`` (Where(constant triangular condition, 0, -inf)); ``where_scores``
    (Where(constant triangular condition, scores, ``mask_value``): GPT-Neo's and older GPT-2 exports' form);
    ``masked_fill`` (Where(the hidden keys, ``mask_value``, scores)); ``trilu``
    ((1 - Trilu(ones)) * -big, computed in the graph from constants); ``near`` (``const`` with one hidden element
    set to 0: not causal); ``input`` (a runtime mask input of that shape).
    ``repeat`` (when Hkv < H): ``expand`` (Unsqueeze -> Expand -> Reshape, transformers' repeat_kv), ``tile``
    (Unsqueeze -> Tile -> Reshape, the same order), ``tile_heads`` (Tile of the head axis: the other head order,
    h % Hkv), ``broadcast`` (Hkv 1 only: the matmuls broadcast K and V). ``padding``: a second addition after the
    mask, a runtime [B, 1, 1, Sk] input ``pad`` (a padding mask beside the causal one, or T5's bias beside its mask).
    ``window``: each query also hides the keys ``window`` or more before it (GPT-Neo's local attention: a band, not
    causal). ``heads_out``: the output transposed to [B, Sq, H, D] and reshaped to [B, Sq, H * D], as a model's
    attention hands it to its output projection."""
    seq_k = seq_k or seq_q
    kv_heads = kv_heads or heads
    np_dt = np.float16 if dtype == "float16" else np.float32
    et = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT
    if mask_value is None:
        mask_value = float(np.finfo(np_dt).min)
    scale = dim ** -0.5 if scale is None else scale
    inits, nodes, k = [], [], [0]

    def const(arr, name=None):
        k[0] += 1
        name = name or f"c{k[0]}"
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def op(op_type, ins, **attrs):
        k[0] += 1
        out = f"t{k[0]}"
        nodes.append(helper.make_node(op_type, ins, [out], name=f"n{k[0]}", **attrs))
        return out

    def rep(x):
        if kv_heads == heads or repeat == "broadcast":
            return x
        n = heads // kv_heads
        if repeat == "tile_heads":
            return op("Tile", [x, const(np.array([1, n, 1, 1], np.int64))])
        u = op("Unsqueeze", [x, const(np.array([2], np.int64))])
        shape5 = np.array([batch, kv_heads, n, seq_k, dim], np.int64)
        w = (op("Expand", [u, const(shape5)]) if repeat == "expand"
             else op("Tile", [u, const(np.array([1, 1, n, 1, 1], np.int64))]))
        return op("Reshape", [w, const(np.array([batch, heads, seq_k, dim], np.int64))])

    s = op("Mul", [op("MatMul", ["q", op("Transpose", [rep("k")], perm=[0, 1, 3, 2])]), const(np.array(scale, np_dt))])
    keep = np.arange(seq_k)[None, :] <= np.arange(seq_q)[:, None] + (seq_k - seq_q)
    if window is not None:
        keep &= np.arange(seq_k)[None, :] > np.arange(seq_q)[:, None] + (seq_k - seq_q) - window
    ins = {"q": [batch, heads, seq_q, dim], "k": [batch, kv_heads, seq_k, dim], "v": [batch, kv_heads, seq_k, dim]}
    if mask in ("const", "near"):
        m = np.where(keep, 0, mask_value).astype(np_dt)[None, None]
        if mask == "near":
            m[0, 0, seq_q // 2, seq_k - 1] = 0   # one hidden key made visible: not causal any more
        s = op("Add", [s, const(m)])
    elif mask == "where":
        s = op("Add", [s, op("Where", [const(keep), const(np.array(0, np_dt)), const(np.array(-np.inf, np_dt))])])
    elif mask == "where_scores":
        s = op("Where", [const(keep[None, None]), s, const(np.array(mask_value, np_dt))])
    elif mask == "masked_fill":
        s = op("Where", [const(~keep[None, None]), const(np.array(mask_value, np_dt)), s])
    elif mask == "trilu":
        tri = op("Trilu", [const(np.ones((seq_q, seq_k), np_dt)), const(np.array(seq_k - seq_q, np.int64))], upper=0)
        hidden = op("Sub", [const(np.array(1, np_dt)), tri])
        s = op("Add", [s, op("Mul", [hidden, const(np.array(mask_value, np_dt))])])
    elif mask == "input":
        ins["mask"] = [1, 1, seq_q, seq_k]
        s = op("Add", [s, "mask"])
    if padding:
        ins["pad"] = [batch, 1, 1, seq_k]
        s = op("Add", [s, "pad"])
    y = op("MatMul", [op("Softmax", [s], axis=-1), rep("v")])
    y_shape = [batch, heads, seq_q, dim]
    if heads_out:
        y = op("Reshape", [op("Transpose", [y], perm=[0, 2, 1, 3]), const(np.array([batch, seq_q, heads * dim]))])
        y_shape = [batch, seq_q, heads * dim]
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info(n, et, sh) for n, sh in ins.items()],
                              [helper.make_tensor_value_info("y", et, y_shape)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    del y
    return model


# ------------------------------------------------------------------------------------------------------ the cases
CASES = {   # name: (attention_onnx arguments, what the planner must recognise: causal, kv_group)
    "a unmasked": (dict(batch=8, heads=16, seq_q=2048, dim=64, mask="none"), (False, 1)),
    "a causal": (dict(batch=8, heads=16, seq_q=2048, dim=64, mask="const"), (True, 1)),
    "b gqa causal": (dict(batch=4, heads=32, kv_heads=8, seq_q=4096, dim=128, mask="const", repeat="expand"),
                     (True, 4)),
    "c d128": (dict(batch=4, heads=32, seq_q=4096, dim=128, mask="none"), (False, 1)),   # ANCHORS.md's attention
}
SMALL = {   # --small: the same graphs at llvm sizes
    "a unmasked": dict(batch=1, heads=2, seq_q=64, dim=16, mask="none"),
    "a causal": dict(batch=1, heads=2, seq_q=64, dim=16, mask="const"),
    "b gqa causal": dict(batch=1, heads=8, kv_heads=2, seq_q=64, dim=32, mask="const", repeat="expand"),
    "c d128": dict(batch=1, heads=2, seq_q=64, dim=32, mask="none"),
}


def _planned(model, target):
    """(fused module, plan, the attention PrimFunc's spec or None, its PrimFunc): the real import and planner."""
    import tempfile

    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.kernels.flash import spec_of
    from tvmfuse.plan.cost import CostModel
    from tvmfuse.plan.planner import PlannerConfig, plan_tvmfuse

    # attention fused on llvm too (--small checks the kernel's semantics there; CPU plans otherwise leave it
    # unfused for the CPU defaults)
    cost = CostModel.for_target(target, attention_decline=None)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "attention.onnx"
        onnx.save(model, path)
        fused, plan = plan_tvmfuse(import_model(load_model(path)), target, config=PlannerConfig(cost_model=cost))
    found = [(spec_of(f), f) for f in fused.functions.values() if getattr(f, "attrs", None) is not None
             and spec_of(f) is not None]
    spec, func = found[0] if len(found) == 1 else (None, None)
    return fused, plan, spec, func


def _recognised(spec, want) -> str:
    if spec is None:
        return "NOT FUSED"
    got = (spec.causal, spec.kv_group)
    return "yes" if got == want else f"NO (causal {spec.causal}, kv_group {spec.kv_group})"


def _torch_reference(spec, q, k, v):
    """softmax(scale q kᵀ + causal mask) v in fp32, K/V head h // kv_group, one batch at a time (memory)."""
    import torch

    out = []
    for b in range(q.shape[0]):
        kk = k[b].float().repeat_interleave(spec.kv_group, dim=0)
        vv = v[b].float().repeat_interleave(spec.kv_group, dim=0)
        s = (q[b].float() @ kk.transpose(-1, -2)) * spec.scale
        if spec.causal:
            hidden = torch.ones(spec.seq_q, spec.seq_k, dtype=torch.bool, device=q.device).triu(
                1 + spec.causal_offset)
            s = s.masked_fill(hidden, float("-inf"))
        out.append(torch.softmax(s, dim=-1) @ vv)
        del s
    return torch.stack(out)


def _rel(a, b) -> float:
    return float((a.float() - b).norm() / b.norm())


def _time_torch(fn) -> float:
    """Median microseconds of ``fn``: 10 samples, each as many back-to-back calls as take >= 30 ms."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    number = max(1, int(0.03 / max(time.perf_counter() - t0, 1e-6)) + 1)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(number):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / number * 1e3)
    return float(np.median(times))


def _time_tvm(f, dev, args) -> float:
    te = f.time_evaluator("main", dev, number=1, repeat=10, min_repeat_ms=30)
    return float(np.median(te(*args).results)) * 1e6


def _configs(spec, n: int, names: tuple[str, ...] = ()) -> list:
    """``n`` configs of the template's space besides the default for ``spec``: the mma.sync default, the overlapped
    Hopper kernels, the runner-up Hopper tiles measured at the non-causal anchor, then the rest in space order
    (``names``: those configs of the space instead, at most ``n``)."""
    from tvmfuse.kernels.flash import configs, default_config, parse_config

    default = default_config(spec, wgmma=True)
    space = [c for c in configs(spec, wgmma=(True, False), overlap=(True, False), tma=(0, 1, 2, 3),
                                max_shared_bytes=227 * 1024) if c != default]
    if names:
        return [c for c in space if c.name in names][:n]
    first = [parse_config(x) for x in ("w4 m2 n32 s1", "w4 m1 n64 s2 hp", "w8 m1 n64 s2 hp", "w8 m1 n64 s2 h",
                                       "w4 m1 n64 s2 h", "w8 m1 n128 s1")]
    return ([c for c in first if c in space] + [c for c in space if c not in first])[:n]


def run_gpu(name: str, args: dict, want, n_configs: int, names: tuple[str, ...] = ()) -> list[dict]:
    """The case built through the planner for the H200, checked against torch fp32 and timed; a row per kernel."""
    import torch

    from tvmfuse._tvm import relax, tvm
    from tvmfuse.compile.build import build
    from tvmfuse.kernels.flash import default_config, flash_kernel, flash_primfunc
    from tvmfuse.target import resolve_target

    target = resolve_target("cuda")
    model = attention_onnx(dtype="float16", **args)
    fused, plan, spec, func = _planned(model, target)
    row = {"case": name, "recognised": _recognised(spec, want), "kernel": "model (untuned default)"}
    t0 = time.time()
    result = build(fused, target=target)
    row["build_s"] = round(time.time() - t0, 1)
    row["schedules"] = [k.schedule for k in result.kernels]
    dev = tvm.cuda(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input]
    q, k, v = (torch.randn(*s, device="cuda", dtype=torch.float16, generator=g) for s in shapes)
    vm = relax.VirtualMachine(result.executable, dev)
    vm_args = [tvm.runtime.from_dlpack(t) for t in (q, k, v)] + [
        tvm.runtime.tensor(p.numpy(), dev) for p in result.lifted_params]
    got = torch.from_numpy(vm["main"](*vm_args).numpy()).to("cuda")
    ref = _torch_reference(spec, q, k, v) if spec is not None else None
    row["rel_error"] = _rel(got, ref) if ref is not None else float("nan")
    row["ok"] = bool(row["rel_error"] <= 1e-2)
    row["us"] = _time_tvm(vm, dev, vm_args)
    rows = [row]
    if spec is None:
        return rows
    default = default_config(spec, wgmma=True)
    row["config"] = default.name
    kernels = [("default kernel", default, flash_kernel(func, default))] + [
        ("config", c, flash_primfunc(spec, c)) for c in _configs(spec, n_configs, names)]
    for label, cfg, kfunc in kernels:
        rec = {"case": name, "recognised": row["recognised"], "kernel": label, "config": cfg.name}
        try:
            lib = tvm.compile(tvm.IRModule({"main": kfunc.with_attr("global_symbol", "main")}), target=target.target)
            out = torch.full_like(q, float("nan"))
            kargs = [tvm.runtime.from_dlpack(t) for t in (q, k, v, out)]
            lib["main"](*kargs)
            torch.cuda.synchronize()
            rec["unwritten"] = int(torch.isnan(out).sum())
            rec["rel_error"] = _rel(out, ref)
            rec["ok"] = rec["unwritten"] == 0 and rec["rel_error"] <= 1e-2
            rec["us"] = _time_tvm(lib.mod, dev, kargs)
        except Exception as err:  # noqa: BLE001 - report the config and go on to the next case
            rec["error"] = str(err)[-300:]
        rows.append(rec)
        print(json.dumps(rec), flush=True)
        if "error" in rec:
            break
    del ref
    torch.cuda.empty_cache()
    return rows


def sdpa_rows() -> list[dict]:
    """PyTorch SDPA (its flash backend for fp16) on the same shapes."""
    import torch
    import torch.nn.functional as F

    out = []
    g = torch.Generator(device="cuda").manual_seed(1)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=g)  # noqa: E731
    q, k, v = rnd(8, 16, 2048, 64), rnd(8, 16, 2048, 64), rnd(8, 16, 2048, 64)
    for causal in (False, True):
        out.append({"case": "a causal" if causal else "a unmasked", "kernel": f"SDPA is_causal={causal}",
                    "us": _time_torch(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))})
    q, k, v = rnd(4, 32, 4096, 128), rnd(4, 32, 4096, 128), rnd(4, 32, 4096, 128)
    out.append({"case": "c d128", "kernel": "SDPA is_causal=False",
                "us": _time_torch(lambda: F.scaled_dot_product_attention(q, k, v))})
    q, k, v = rnd(4, 32, 4096, 128), rnd(4, 8, 4096, 128), rnd(4, 8, 4096, 128)
    try:
        us = _time_torch(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        out.append({"case": "b gqa causal", "kernel": "SDPA is_causal enable_gqa", "us": us})
    except TypeError as err:   # torch < 2.5 has no enable_gqa: say so, and time SDPA on K/V repeated instead
        out.append({"case": "b gqa causal", "kernel": "SDPA enable_gqa", "error": str(err)[:120]})
        kr, vr = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
        out.append({"case": "b gqa causal", "kernel": "SDPA is_causal (K/V repeated)",
                    "us": _time_torch(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True))})
    return out


def dry_run(n_configs: int, names: tuple[str, ...] = ()) -> list[dict]:
    """Each case planned for the H200 and every kernel the GPU run would build, built with nvcc (no GPU)."""
    from tvmfuse._tvm import tvm
    from tvmfuse.compile.build import build
    from tvmfuse.kernels.flash import default_config, flash_primfunc
    from tvmfuse.target import resolve_target

    target = resolve_target("cuda")
    rows = []
    for name, (args, want) in CASES.items():
        fused, plan, spec, func = _planned(attention_onnx(dtype="float16", **args), target)
        t0 = time.time()
        result = build(fused, target=target)
        row = {"case": name, "recognised": _recognised(spec, want), "kernel": "model (untuned default)",
               "schedules": [k.schedule for k in result.kernels], "build_s": round(time.time() - t0, 1)}
        rows.append(row)
        extra = _configs(spec, n_configs, names) if spec is not None else []
        for cfg in ([default_config(spec, wgmma=True)] + extra) if spec is not None else []:
            tvm.compile(tvm.IRModule({"main": flash_primfunc(spec, cfg).with_attr("global_symbol", "main")}),
                        target=target.target)
            rows.append({"case": name, "recognised": row["recognised"], "kernel": "built", "config": cfg.name})
        print(json.dumps(row), flush=True)
    return rows


def small() -> list[dict]:
    """The same graphs at small sizes planned for llvm and run end to end against onnxruntime (no GPU)."""
    import onnxruntime as ort

    from tvmfuse._tvm import relax, tvm
    from tvmfuse.compile.build import build
    from tvmfuse.target import resolve_target

    target = resolve_target("llvm")
    rows = []
    for name, args in SMALL.items():
        model = attention_onnx(dtype="float32", **args)
        fused, plan, spec, func = _planned(model, target)
        rng = np.random.default_rng(0)
        ins = [rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
               for i in model.graph.input]
        result = build(fused, target=target)
        vm = relax.VirtualMachine(result.executable, tvm.cpu())
        got = vm["main"](*[tvm.runtime.tensor(x) for x in ins], *[tvm.runtime.tensor(p.numpy())
                                                               for p in result.lifted_params]).numpy()
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        ref = sess.run(None, {"q": ins[0], "k": ins[1], "v": ins[2]})[0]
        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        rows.append({"case": name, "recognised": _recognised(spec, CASES[name][1]), "kernel": "llvm model",
                     "rel_error": err, "ok": err <= 1e-4})
    return rows


SDPA_OF = {"a unmasked": ("SDPA is_causal=False",), "a causal": ("SDPA is_causal=True",),
           "c d128": ("SDPA is_causal=False",),
           "b gqa causal": ("SDPA is_causal enable_gqa", "SDPA is_causal (K/V repeated)")}


def _table(rows: list[dict]) -> str:
    """The rows, each tvmfuse time also as a multiple of its SDPA baseline and (causal) of the unmasked kernel."""
    sdpa = {}
    for r in rows:
        if "us" in r and r["kernel"] in SDPA_OF.get(r["case"], ()) and r["case"] not in sdpa:
            sdpa[r["case"]] = r["us"]
    unmasked = {r["kernel"]: r["us"] for r in rows if r["case"] == "a unmasked" and "us" in r
                and r["kernel"] in ("default kernel", "model (untuned default)")}
    lines = [f"{'case':14s} {'kernel':30s} {'config':18s} {'recog':6s} {'ok':5s} {'rel err':>9s} {'us':>9s} "
             f"{'x SDPA':>7s} {'/unmasked':>9s}"]
    for r in rows:
        us, ours = r.get("us"), not str(r.get("kernel", "")).startswith("SDPA")
        vs_sdpa = f"{us / sdpa[r['case']]:7.2f}" if us and ours and r["case"] in sdpa else ""
        vs_plain = (f"{us / unmasked[r['kernel']]:9.2f}" if us and r["case"] == "a causal" and r["kernel"] in unmasked
                    else "")
        lines.append(f"{r['case']:14s} {str(r.get('kernel', ''))[:30]:30s} {str(r.get('config', ''))[:18]:18s} "
                     f"{str(r.get('recognised', ''))[:6]:6s} {str(r.get('ok', '')):5s} "
                     f"{r.get('rel_error', float('nan')):9.2e} {us if us is not None else float('nan'):9.1f} "
                     f"{vs_sdpa:>7s} {vs_plain:>9s} {r.get('error', '')[:60]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=int, default=0, help="also time the first N other configs of each case")
    ap.add_argument("--dry-run", action="store_true", help="plan and build every kernel for CUDA, run nothing")
    ap.add_argument("--small", action="store_true", help="small shapes on llvm against onnxruntime")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names (GPU run)")
    ap.add_argument("--names", default="", help="comma-separated config names to time (with --configs N: at most N)")
    a = ap.parse_args()
    names = tuple(n.strip() for n in a.names.split(",") if n.strip())
    t0 = time.time()
    if a.small:
        rows = small()
    elif a.dry_run:
        rows = dry_run(a.configs, names)
    else:
        rows = []
        for name in a.cases.split(","):
            args, want = CASES[name]
            rows += run_gpu(name, args, want, a.configs, names)
        rows += sdpa_rows()
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "attention_causal_gpu.json").write_text(json.dumps({"rows": rows, "wall_s": time.time() - t0},
                                                                            indent=1))
    print(f"\nwall {time.time() - t0:.0f} s")
    print(_table(rows))
    bad = [r for r in rows if r.get("ok") is False or ("error" in r and not r["kernel"].startswith("SDPA"))
           or str(r.get("recognised", "yes")) != "yes"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
