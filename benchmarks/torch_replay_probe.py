#!/usr/bin/env python3
"""The PyTorch baseline of the whole-model cases, checked: is torch.compile really compiling? (GPU; no TVM needed.)

bench_gpu.py's PyTorch baseline for whole models replays the ONNX graph with torch ops
(``tvmfuse.bench.torch_onnx.build_fn``). Until 2026-12-01 torch.compile traced no graph of that replay and ran
it op by op: ResNet-50 b32 "compiled" took 5095 us against 4921 us eager, built in 0.5 s (this script's first
run, on the H200). This times eager and torch.compile of the replay (NCHW and channels-last for a CNN), counts
the graphs and graph breaks torch._dynamo finds, and lists the heaviest CUDA kernels of the compiled run
(torch.profiler), to show where the time goes.

    python benchmarks/torch_replay_probe.py [--models resnet50,bert_base] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import _bench_torch, top_kernels  # noqa: E402
from tvmfuse.bench.models import MODELS  # noqa: E402
from tvmfuse.bench.torch_onnx import build_fn  # noqa: E402


def _variant(model, label: str, channels_last: bool, x) -> dict:
    import torch

    f = build_fn(model, "cuda", channels_last=channels_last)
    xi = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    row: dict = {"variant": label}
    with torch.no_grad():
        explained = torch._dynamo.explain(f)(xi)
        row["dynamo_graphs"], row["graph_breaks"] = explained.graph_count, explained.graph_break_count
        torch._dynamo.reset()
        row["eager_us"] = _bench_torch(lambda: f(xi)) * 1e6
        c = torch.compile(f)
        t0 = time.time()
        c(xi)
        torch.cuda.synchronize()
        row["compile_build_s"] = round(time.time() - t0, 1)
        row["compile_us"] = _bench_torch(lambda: c(xi)) * 1e6
        row["compile_us_again"] = _bench_torch(lambda: c(xi)) * 1e6
        row["top_kernels"] = top_kernels(lambda: c(xi), k=8)
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert_base")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    import torch

    torch.backends.cudnn.benchmark = True
    results = []
    for name in a.models.split(","):
        model, _, _ = MODELS[name]()
        shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
        cnn = len(shape) == 4
        torch.manual_seed(0)
        x = torch.randn(*shape, device="cuda", dtype=torch.float16)   # images; BERT's embedded tokens
        for cl in ((False, True) if cnn else (False,)):
            row = {"model": name, **_variant(model, "channels_last" if cl else "as exported", cl, x)}
            print(json.dumps(row), flush=True)
            results.append(row)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    print(f"\n{'model':10} {'variant':14} {'graphs':>6} {'breaks':>6} {'eager us':>9} {'compile us':>11} {'again':>7} "
          f"{'build s':>8}")
    for r in results:
        print(f"{r['model']:10} {r['variant']:14} {r['dynamo_graphs']:6} {r['graph_breaks']:6} {r['eager_us']:9.0f} "
              f"{r['compile_us']:11.0f} {r['compile_us_again']:7.0f} {r['compile_build_s']:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
