"""The flash-attention template on the GPU: every tile config checked and timed beside PyTorch SDPA.

For the ANCHORS.md attention case (B4 H32 S4096 D128 fp16) it builds each config of
``tvmfuse.kernels.flash.configs``, checks it against an fp32 reference on fresh random inputs with the
output poisoned (NaN) first, and times it with TVM's time evaluator; SDPA (PyTorch's flash backend) is
timed in the same run. Smaller variants (Kᵀ given transposed, an additive mask, mask before scale,
head dim 64) are checked for correctness only. Prints a table last; ``--json`` writes the rows.

    python benchmarks/flash_gpu.py [--json out.json] [--quick] [--part variants|anchor] [--kind mma|wgmma|overlap|tma] [--configs NAME ...]
    python benchmarks/flash_gpu.py --tf32 [--configs NAME ...]

``--ragged``: sequences that are no whole number of tiles (ViT's 197 tokens with K as rows and Kᵀ given, Whisper's 1500
frames with Kᵀ and a padding mask, a causal 200), fp16 and TF32, every ``mma.sync`` config checked and timed beside
SDPA.
``--tf32``: fp32 attention at BERT-base's shape (8 x 12 heads x 512, head dim 64, a padding mask; Kᵀ given, and K
given as rows) in TF32 (``mma.sync.m16n8k8``, every config), beside the CUDA-core kernel's default (fp32 exact) and
SDPA in fp32 with TF32 allowed, all checked against an fp32 reference with TF32 off; ``--x3`` adds every config of
the kernel in three TF32 products a fragment (an fp32 build's on Hopper, checked to fp32's 1e-5).

``--kind wgmma`` includes the overlapped Hopper kernels (`` hp``); ``--kind overlap`` runs only those.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tvmfuse.plan.attention import AttentionSpec  # noqa: E402
from tvmfuse.kernels.flash import configs as all_configs, flash_primfunc  # noqa: E402


def _reference(spec: AttentionSpec, q, k, v, mask):
    import torch

    kk = k.float() if spec.k_rows else k.float().transpose(-1, -2)
    s = q.float() @ kk.transpose(-1, -2)
    scale = 1.0 if spec.scale is None else spec.scale
    if mask is None:
        s = s * scale
    elif spec.scale_first:
        s = s * scale + mask.float()
    else:
        s = (s + mask.float()) * scale
    if spec.causal:
        rows, cols = (torch.arange(n, device=s.device) for n in (spec.seq_q, spec.seq_k))
        hidden = cols[None, :] > rows[:, None] + spec.causal_offset
        s = s.masked_fill(hidden, float("-inf"))
    return torch.softmax(s, dim=-1) @ v.float()


def run_config(spec: AttentionSpec, cfg, *, time_it: bool, seed: int) -> dict:
    import torch

    import tvm

    rec: dict = {"config": cfg.name}
    t0 = time.time()
    lib = tvm.compile(tvm.IRModule({"main": flash_primfunc(spec, cfg).with_attr("global_symbol", "main")}),
                      target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    rec["build_s"] = round(time.time() - t0, 2)
    g = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    q = rnd(*spec.batch, spec.seq_q, spec.head_dim)
    k = rnd(*spec.batch, spec.seq_k, spec.head_dim) if spec.k_rows else rnd(*spec.batch, spec.head_dim, spec.seq_k)
    v = rnd(*spec.batch, spec.seq_k, spec.head_dim_v)
    mask = None
    if spec.mask_shape is not None:
        mask = torch.where(torch.rand(*spec.mask_shape, device="cuda", generator=g) < 0.2,
                           torch.tensor(-10000.0, device="cuda"), torch.tensor(0.0, device="cuda"))
        mask = mask.to(getattr(torch, spec.mask_dtype))
    out = torch.full(spec.out_shape, float("nan"), device="cuda", dtype=dtype)
    args = [tvm.runtime.from_dlpack(t) for t in (q, k, v, *([mask] if mask is not None else []), out)]
    lib["main"](*args)
    torch.cuda.synchronize()
    torch.backends.cuda.matmul.allow_tf32 = False   # the reference in fp32
    ref = _reference(spec, q, k, v, mask)
    if spec.seq_major_out:   # the kernel stores each row's heads side by side
        ref = ref.transpose(-3, -2)
    got = out.float()
    rec["unwritten"] = int(torch.isnan(got).sum())
    rec["rel_error"] = float((got - ref).norm() / ref.norm())
    # fp16 and TF32 keep 10 mantissa bits; fp32 on the CUDA cores is exact to fp32's
    # (x3: three TF32 products a fragment, fp32's accuracy)
    loose = spec.dtype == "float16" or spec.tf32 and not spec.x3
    rec["ok"] = rec["unwritten"] == 0 and rec["rel_error"] <= (1e-2 if loose else 1e-5)
    if time_it and rec["ok"]:
        dev = tvm.cuda(0)
        te = lib.mod.time_evaluator("main", dev, number=10, repeat=5)
        rec["us"] = float(np.median(te(*args).results)) * 1e6
        flops = 4.0 * np.prod(spec.batch) * spec.seq_q * spec.seq_k * spec.head_dim
        rec["tflops"] = flops / (rec["us"] * 1e-6) / 1e12
    return rec


def sdpa_us(spec: AttentionSpec) -> float:
    """SDPA's time at ``spec``'s shape and dtype (fp32: TF32 allowed, with ``spec``'s mask where it has one)."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, spec.dtype)
    torch.backends.cuda.matmul.allow_tf32 = True
    q, k, v = (torch.randn(*spec.batch, spec.seq_q, spec.head_dim, device="cuda", dtype=dtype) for _ in range(3))
    mask = None if spec.mask_shape is None else torch.zeros(*spec.mask_shape, device="cuda", dtype=dtype)
    for _ in range(3):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 10 * 1e3)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="anchor case: the first config only")
    ap.add_argument("--part", choices=["all", "variants", "anchor"], default="all",
                    help="a CUDA error kills the process's context: run the parts in separate processes")
    ap.add_argument("--kind", choices=["all", "mma", "wgmma", "overlap", "tma"], default="all",
                    help="mma.sync configs, Hopper wgmma configs (' h', the overlapped ' hp', the warp-specialized "
                         "' ht' / ' htp' / ' hto'), only the overlapped ones, only the warp-specialized ones, or all")
    ap.add_argument("--configs", nargs="*", default=None, help="only these config names (e.g. 'w4 m1 n64 s1 h')")
    ap.add_argument("--tf32", action="store_true", help="fp32 attention at BERT-base's shape in TF32 (see above)")
    ap.add_argument("--ragged", action="store_true", help="sequences of no whole tiles (see above)")
    ap.add_argument("--x3", action="store_true", help="with --tf32: also every config in three TF32 products")
    a = ap.parse_args()
    if a.tf32:
        return tf32_table(a)
    if a.ragged:
        return ragged_table(a)

    def configs(spec):
        mma = all_configs(spec) if a.kind in ("all", "mma") else []
        hopper = ([c for c in all_configs(spec, wgmma=(True,), overlap=(True,), tma=(0, 1, 2, 3),
                                          max_shared_bytes=227 * 1024)
                   if c.wgmma and (c.overlap or a.kind != "overlap") and (c.tma or a.kind != "tma")]
                  if a.kind != "mma" else [])
        return [c for c in mma + hopper if not a.configs or c.name in a.configs]
    anchor = AttentionSpec(batch=(4, 32), seq_q=4096, seq_k=4096, head_dim=128, head_dim_v=128, dtype="float16",
                           scale=128 ** -0.5, mask_shape=None, k_rows=True)
    variants = [
        ("kT+mask", AttentionSpec(batch=(2, 4), seq_q=256, seq_k=256, head_dim=64, head_dim_v=64, dtype="float16",
                                  scale=0.125, mask_shape=(2, 1, 1, 256), k_rows=False)),
        ("mask-first", AttentionSpec(batch=(2,), seq_q=128, seq_k=192, head_dim=128, head_dim_v=128,
                                     dtype="float16", scale=None, mask_shape=(128, 192), scale_first=False,
                                     k_rows=True)),
        ("heads-out", AttentionSpec(batch=(2, 4), seq_q=256, seq_k=256, head_dim=64, head_dim_v=64, dtype="float16",
                                    scale=0.125, mask_shape=(2, 1, 1, 256), k_rows=True, seq_major_out=True)),
    ]
    rows = []
    for name, spec in variants if a.part in ("all", "variants") else []:
        for cfg in configs(spec):
            try:
                rec = run_config(spec, cfg, time_it=False, seed=1)
            except Exception as err:  # noqa: BLE001 - report and go on
                rec = {"config": cfg.name, "error": str(err)[-300:]}
            rec["case"] = name
            rows.append(rec)
            print(json.dumps(rec), flush=True)
            if "error" in rec:
                break
    sdpa = sdpa_us(anchor) if a.part in ("all", "anchor") and not any("error" in r for r in rows) else float("nan")
    print("sdpa_us", sdpa, flush=True)
    for cfg in configs(anchor)[: 1 if a.quick else None] if a.part in ("all", "anchor") else []:
        try:
            rec = run_config(anchor, cfg, time_it=True, seed=int(time.time()) % 100000)
        except Exception as err:  # noqa: BLE001
            rec = {"config": cfg.name, "error": str(err)[-300:]}
        rec["case"] = "B4 H32 S4096 D128"
        rows.append(rec)
        print(json.dumps(rec), flush=True)
        if "error" in rec:
            break
    if a.json:
        Path(a.json).write_text(json.dumps({"sdpa_us": sdpa, "rows": rows}, indent=1))
    print(f"\n{'case':20s} {'config':18s} {'ok':5s} {'rel err':>9s} {'us':>9s} {'TFLOP/s':>8s} {'x SDPA':>7s}")
    print(f"{'B4 H32 S4096 D128':20s} {'SDPA':18s} {'':5s} {'':>9s} {sdpa:9.0f}")
    for r in rows:
        us, err = r.get("us"), r.get("error", "")[:80]
        timing = f"{us:9.0f} {r['tflops']:8.1f} {sdpa / us:7.2f}" if us else f"{'-':>9s} {'-':>8s} {'-':>7s}"
        print(f"{r['case']:20s} {r['config']:18s} {str(r.get('ok', 'ERR')):5s} "
              f"{r.get('rel_error', float('nan')):9.2e} {timing}  {err}")
    return 0


def tf32_table(a) -> int:
    from dataclasses import replace

    from tvmfuse.kernels.flash.config import configs
    from tvmfuse.kernels.flash.simt import simt_default

    rows = []
    base = AttentionSpec(batch=(8, 12), seq_q=512, seq_k=512, head_dim=64, head_dim_v=64, dtype="float32",
                         scale=0.125, mask_shape=(8, 1, 1, 512), k_rows=False, tf32=True)
    sdpa = sdpa_us(base)
    for k_rows in (False, True):
        spec = replace(base, k_rows=k_rows)
        case = "B8 H12 S512 D64 " + ("K" if k_rows else "Kt")
        todo = [c for c in configs(spec) if not a.configs or c.name in a.configs]
        todo.append((replace(spec, tf32=False), simt_default(replace(spec, tf32=False), 132)))
        if a.x3:
            x3 = replace(spec, x3=True)
            todo += [(x3, c) for c in configs(x3) if not a.configs or c.name in a.configs]
        for item in todo:
            sp, cfg = item if isinstance(item, tuple) else (spec, item)
            _checked_and_timed(sp, cfg, rows, case=case + (" x3" if sp.x3 else "" if sp.tf32 else " fp32"),
                               sdpa_us=sdpa)
    return _table(a, rows)


def _checked_and_timed(spec: AttentionSpec, cfg, rows: list, **fields) -> None:
    """One config checked and timed (an error reported, not raised), its row appended to ``rows`` and printed."""
    try:
        rec = run_config(spec, cfg, time_it=True, seed=7)
    except Exception as err:  # noqa: BLE001 - report and go on
        rec = {"config": cfg.name, "error": str(err)[-300:]}
    rec.update(fields)
    rows.append(rec)
    print(json.dumps(rec), flush=True)


def _table(a, rows: list) -> int:
    """The rows (each with its SDPA time) as a table, last; ``--json``: written there too."""
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))
    print(f"\n{'case':34s} {'config':18s} {'ok':5s} {'rel err':>9s} {'us':>9s} {'SDPA us':>8s} {'÷ SDPA':>7s}")
    for r in rows:
        us, err = r.get("us"), r.get("error", "")[:80]
        timing = f"{us:9.1f} {r['sdpa_us']:8.1f} {us / r['sdpa_us']:7.2f}" if us else f"{'-':>9s} {'-':>8s} {'-':>7s}"
        name = r["config"] + (" (default)" if r.get("default") else "")
        print(f"{r['case']:34s} {name:18s} {str(r.get('ok', 'ERR')):5s} "
              f"{r.get('rel_error', float('nan')):9.2e} {timing}  {err}")
    return 0


def ragged_table(a) -> int:
    from dataclasses import replace

    from tvmfuse.kernels.flash.config import configs, default_config

    cases = [("ViT B8 H12 S197 D64 K", AttentionSpec(batch=(8, 12), seq_q=197, seq_k=197, head_dim=64,
                                                     head_dim_v=64, dtype="float16", scale=0.125, mask_shape=None,
                                                     k_rows=True)),
             ("ViT B8 H12 S197 D64 Kt", AttentionSpec(batch=(8, 12), seq_q=197, seq_k=197, head_dim=64,
                                                      head_dim_v=64, dtype="float16", scale=0.125, mask_shape=None,
                                                      k_rows=False)),
             ("Whisper B8 H8 S1500 Kt+mask", AttentionSpec(batch=(8, 8), seq_q=1500, seq_k=1500, head_dim=64,
                                                           head_dim_v=64, dtype="float16", scale=0.125,
                                                           mask_shape=(8, 1, 1, 1500), k_rows=False)),
             ("causal B8 H12 S200 D64", AttentionSpec(batch=(8, 12), seq_q=200, seq_k=200, head_dim=64, head_dim_v=64,
                                                      dtype="float16", scale=0.125, mask_shape=None, k_rows=True,
                                                      causal=True))]
    rows = []
    for name, spec in cases:
        for sp, tag in ((spec, "fp16"), (replace(spec, dtype="float32", tf32=True), "tf32")):
            sdpa = sdpa_us(replace(sp, causal=False))
            default = default_config(sp, wgmma=True)
            todo = [c for c in configs(sp) if not a.configs or c.name in a.configs]
            for cfg in todo:
                _checked_and_timed(sp, cfg, rows, case=f"{name} {tag}", sdpa_us=sdpa, default=cfg == default)
    return _table(a, rows)


if __name__ == "__main__":
    sys.exit(main())
