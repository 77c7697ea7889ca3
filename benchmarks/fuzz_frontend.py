"""Fuzz tvmfuse's frontend with 10,000 hostile inputs (issue 6): mutated protobuf bytes and mutated graphs.

    /work/venv/bin/python benchmarks/fuzz_frontend.py [--examples 10000] [--benchmarks BENCHMARKS.md]

The fuzzing runs in a child process so that a crash (segfault, abort) of TVM or onnx is seen and
reported with the input that caused it (kept in ``--crash-dir``), instead of taking this script down.
The contract per input: ``load_model`` + ``import_model`` return or raise ModelError (one line), within
60 s. Strategies: benchmarks/fuzzing.py.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(examples: int, kind: str, seed: int, scratch: Path) -> None:
    """Run ``examples`` inputs of one kind; print a JSON summary."""
    sys.path.insert(0, str(ROOT))
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    from benchmarks.fuzzing import check_contract, mutated_bytes, mutated_models

    counts = {"ok": 0, "ModelError": 0}
    slowest = [0.0]

    def one(data: bytes) -> None:
        (scratch / "current.onnx").write_bytes(data)  # left behind if the process dies
        t0 = time.time()
        counts[check_contract(data, scratch)] += 1
        slowest[0] = max(slowest[0], time.time() - t0)

    strategy = mutated_bytes() if kind == "bytes" else mutated_models().map(lambda m: m.SerializeToString())
    test = settings(max_examples=examples, deadline=None, database=None, phases=["generate"],
                    suppress_health_check=list(HealthCheck))(given(data=strategy)(one))
    hseed(seed)(test)()
    print(json.dumps({"kind": kind, **counts, "slowest_s": round(slowest[0], 2)}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=10_000, help="total, split between bytes and graphs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--crash-dir", type=Path, default=Path(tempfile.gettempdir()) / "tvmfuse-fuzz-crashes")
    ap.add_argument("--benchmarks", type=Path, default=None, help="record the result in this BENCHMARKS.md")
    ap.add_argument("--child", nargs=3, metavar=("N", "KIND", "SCRATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1], args.seed, Path(args.child[2]))
        return 0
    results, failures = [], []
    t0 = time.time()
    for kind in ("bytes", "graphs"):
        with tempfile.TemporaryDirectory() as scratch:
            n = args.examples // 2
            proc = subprocess.run([sys.executable, __file__, "--seed", str(args.seed), "--child", str(n), kind, scratch],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                args.crash_dir.mkdir(parents=True, exist_ok=True)
                cur = Path(scratch) / "current.onnx"
                keep = args.crash_dir / f"{kind}-crash.onnx"
                if cur.exists():
                    keep.write_bytes(cur.read_bytes())
                why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
                failures.append(f"{kind}: {why}; input kept in {keep}; {proc.stderr.strip().splitlines()[-1:]}")
                print(proc.stdout[-2000:], proc.stderr[-4000:])
                continue
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(results[-1], flush=True)
    took = time.time() - t0
    total = sum(r["ok"] + r["ModelError"] for r in results)
    parts = ", ".join("{kind}: {ok} imported, {ModelError} ModelError, slowest {slowest_s} s".format(**r) for r in results)
    summary = (f"Fuzz (`benchmarks/fuzz_frontend.py --examples {args.examples} --seed {args.seed}`): {total} inputs "
               f"({parts}); "
               f"{'no crash, no hang, no other exception' if not failures else 'FAILURES: ' + '; '.join(failures)}; "
               f"{took / 60:.1f} min.")
    print(summary)
    if args.benchmarks is not None:
        args.benchmarks.with_name(".fuzz_frontend.md").write_text(summary + "\n")
        sys.path.insert(0, str(ROOT / "scripts"))
        from model_zoo import write_section

        text = args.benchmarks.read_text() if args.benchmarks.exists() else ""
        heading = "## ONNX model coverage (issue 6)"
        if heading in text:
            start = text.index(heading)
            end = text.find("\n## ", start + 1)
            section = text[start:end if end >= 0 else len(text)]
            lines = [ln for ln in section.splitlines()[1:] if not ln.startswith("Fuzz (")]
            write_section(args.benchmarks, heading, "\n".join(lines).rstrip() + "\n\n" + summary)
        else:
            write_section(args.benchmarks, heading, summary)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
