"""Compiled artifacts of one model and onnxruntime, timed in one process in interleaved rounds (CPU).

    python benchmarks/cpu_artifacts_ab.py MODEL.onnx INPUTS.npz ARTIFACT [ARTIFACT ...] [--rounds 25] [--calls 5]

Each round times ``--calls`` calls of every artifact and of onnxruntime, in turn; a round's figure is the median of
its calls. Printed per backend: the median over the rounds, and the median of the rounds' ratios to onnxruntime, so
a load that comes and goes on a shared machine slows every backend of a round alike (tuned against untuned builds,
builds from two databases). Artifacts come from ``tvmfuse compile MODEL --target llvm --db DB --output DIR``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("inputs", type=Path, help=".npz keyed by the model's input names")
    ap.add_argument("artifacts", type=Path, nargs="+")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    for path in (args.model, args.inputs, *args.artifacts):
        if not path.exists():
            sys.exit(f"not found: {path}")

    from tvmfuse.threads import apply_threads

    threads = apply_threads(None)   # TVM's pool on the physical cores, before anything runs; onnxruntime the same
    import onnxruntime as ort

    # each backend's round starts after the other runtime's threads stopped spinning, and runs warm first
    from tvmfuse.bench import settle
    from tvmfuse.runtime.loaded import load_artifact

    feeds = dict(np.load(args.inputs))
    loaded = {str(a): load_artifact(a) for a in args.artifacts}
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(args.model), sess_options=opts, providers=["CPUExecutionProvider"])
    ref = sess.run(None, feeds)
    for name, art in loaded.items():
        out = art.run(feeds)
        err = max(float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30)) for o, r in zip(out, ref))
        print(f"{name}: rel. error {err:.1e} against onnxruntime")
        art.benchmark(feeds, repeat=3)

    def ort_round() -> float:
        settle(lambda: sess.run(None, feeds))
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    rounds: dict[str, list[float]] = {name: [] for name in [*loaded, "onnxruntime"]}
    for _ in range(args.rounds):
        for name, art in loaded.items():
            settle(lambda: art.run(feeds))
            rounds[name].append(float(np.median(art.benchmark(feeds, repeat=args.calls, warmup=0))))
        rounds["onnxruntime"].append(ort_round())
    base = np.asarray(rounds["onnxruntime"])
    print(f"{'backend':40} {'median ms':>10} {'/ onnxruntime':>14}  ({threads} threads, {args.rounds} rounds)")
    for name, times in rounds.items():
        ratio = float(np.median(np.asarray(times) / base))
        print(f"{name:40} {np.median(times) * 1e3:10.3f} {ratio:14.2f}")


if __name__ == "__main__":
    main()
