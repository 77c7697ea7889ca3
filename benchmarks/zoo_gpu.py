#!/usr/bin/env python3
"""The model zoo on a GPU machine, one table: export, tune within a time budget, bench beside PyTorch (issue 19).

Each row is one (model, precision, batch) and runs where PyTorch, torchvision and transformers are installed (the
H200 machine has them; this one has no torchvision):
1. ``scripts/model_zoo.py``'s export (``--size small|full``, random weights) into a scratch folder;
2. ``tvmfuse tune MODEL --target cuda --time-budget B --precision P --keep-going`` into one database (``--db``,
   carried between calls: a row whose kernels were all tuned is not tuned again);
3. ``tvmfuse bench MODEL --against torch-eager,torch-compile,torch-compile-ro,torch-compile-max``, which checks every
   backend's outputs against onnxruntime and times them in one process.
Rows already in ``--results`` (the JSON this script writes, carried back in) are skipped, so a long sweep continues
across calls of at most 10 minutes; ``--deadline-s`` stops starting rows that would not end before it (a row takes
its tune budget plus ``--row-extra-s``, then the longest extra time a row of this call took: the export, tune's
start and the bench, where torch.compile's max-autotune compiles for minutes), and the tune and bench of a row that
runs late are stopped at the deadline, so the call's results always come back.

    python benchmarks/zoo_gpu.py --models resnet50,gpt2 --precisions fp32,fp16 --batches 1,32 --budget 120
    python benchmarks/zoo_gpu.py --models uf:roberta,uf:mistral,uf:swin --size full --batches 1 --budget 0

``uf:NAME`` rows are ``scripts/user_form.py`` exports (TorchScript, dynamic axes, attention mask and token types),
bound at the row's batch and sequence length.
Writes ``$OUT/zoo_gpu.json`` (each row's failed kernels and failed checks under ``problems``) and ``$OUT/zoo.db``;
prints the table last. ``--precisions fp16`` converts with onnxconverter-common, which the H200 machine lacks: carry
its wheel (pure Python) in ``.whl/`` with the bundle's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="zoo_gpu-"))
OUT.mkdir(parents=True, exist_ok=True)
T0 = time.time()
BASELINES = "torch-eager,torch-compile,torch-compile-ro,torch-compile-max"


def log(msg: str) -> None:
    print(f"[zoo_gpu {time.time() - T0:6.0f}s] {msg}", flush=True)


def _cli(*args: str, timeout: float) -> tuple[int, dict | None, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # a session of its own: a command stopped at its timeout takes its worker processes (tune's pools, inductor's
    # compile workers) with it, so they do not hold the GPU or the cores for the next row
    p = subprocess.Popen([sys.executable, "-m", "tvmfuse.cli.main", *args, "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return 124, None, f"timed out after {timeout:.0f} s"
    try:
        return p.returncode, json.loads(stdout), stderr[-400:]
    except json.JSONDecodeError:
        return p.returncode, None, (stderr or stdout).strip()[-400:]


def _is_image(model: str) -> bool:
    from model_zoo import OTHER_VISION, VISION   # images have no sequence length
    from user_form import AUDIO, IMAGES

    return model in VISION + OTHER_VISION or (model.startswith("uf:") and model[3:] in IMAGES + AUDIO)


def row_key(model: str, size: str, precision: str, batch: int, seq: int, torch_tf32: str = "auto") -> str:
    return (f"{model}/{size}/{precision}/b{batch}" + ("" if _is_image(model) else f"s{seq}")
            + ("" if torch_tf32 == "auto" else f"/torch-tf32-{torch_tf32}"))


def _export(model: str, size: str, batch: int, seq: int, work: Path,
            onnx_dir: Path | None = None) -> tuple[str, list[str]]:
    """(ONNX path, --input-shape values): a ``model_zoo`` export, or for ``uf:NAME`` a ``scripts/user_form.py`` one
    (TorchScript, dynamic axes, the tokenizer's inputs) bound at ``batch`` x ``seq``: the one in ``onnx_dir`` where
    it is there (the H200 machine has no transformers to export it with)."""
    if model.startswith("uf:"):
        import user_form

        name, full = model[3:], size == "full"
        carried = onnx_dir / f"{name}{'_full' if full else ''}.onnx" if onnx_dir else None
        if carried and carried.exists():
            if name.endswith("_past"):   # optimum's decoder with its KV cache: one new token after seq cached ones
                return str(carried), _decode_step(carried, batch, seq)
            return str(carried), user_form.input_shapes(name, batch, seq, full)
        if user_form.export(work, [name], tiny=False, full=full):
            raise RuntimeError(f"user_form could not export {name}")
        return str(work / f"{name}{'_full' if full else ''}.onnx"), user_form.input_shapes(name, batch, seq, full)
    from model_zoo import export

    image = _is_image(model)
    # the fp32 export, converted by --precision fp16 where asked: the form users have their models in
    return str(export(work, [model], size, None if image else seq, batch, ("float32",))[0]), []


def _decode_step(path: Path, batch: int, past: int) -> list[str]:
    """``--input-shape`` values for one generation step of an optimum export: ``batch`` sequences, one new token,
    ``past`` tokens in the KV cache."""
    import onnx

    sizes = {"batch_size": batch, "sequence_length": 1, "past_sequence_length": past,
             "past_sequence_length + sequence_length": past + 1}
    model = onnx.load(str(path), load_external_data=False)
    return [vi.name + "=" + "x".join(str(d.dim_value if d.HasField("dim_value") else sizes[d.dim_param])
                                     for d in vi.type.tensor_type.shape.dim) for vi in model.graph.input]


def run_row(model: str, size: str, precision: str, batch: int, seq: int, budget: float, db: Path, work: Path,
            deadline: float, baselines: str = BASELINES, onnx_dir: Path | None = None,
            torch_tf32: str = "auto") -> dict:
    row: dict = {"model": model, "size": size, "precision": precision, "batch": batch,
                 "seq": None if _is_image(model) else seq}
    t0 = time.time()
    onnx_path, shapes = _export(model, size, batch, seq, work, onnx_dir)
    row["export_s"] = time.time() - t0
    bound = [a for s in shapes for a in ("--input-shape", s)]
    if budget > 0:
        err = _tune_row(row, onnx_path, precision, budget, db, deadline, bound)
        if err:
            row["error"] = f"tune: {err}"
            return row
    rc, rep, err = _cli("bench", onnx_path, *bound, "--target", "cuda", "--db", str(db), "--precision", precision,
                        "--against", baselines, "--repeat", "20", "--number", "5", "--torch-tf32", torch_tf32,
                        timeout=min(420, max(deadline - time.time(), 1)))
    row["bench_rc"] = rc
    if rep is None:
        row["error"] = f"bench: {err}"
        return row
    row["bench"] = rep
    ours = next((r for r in rep.get("results", []) if r["backend"] == "tvmfuse"), {})
    if ours.get("available") is False:   # the baselines ran; tvmfuse's build did not (its reason names the kernel)
        row["error"] = f"tvmfuse: {ours.get('reason', '')}"
    return row


def _tune_row(row: dict, onnx_path: str, precision: str, budget: float, db: Path, deadline: float,
              bound: list[str] | None = None) -> str | None:
    """Tune one row's model into ``db``, its statuses and problems into ``row``; the error, or None."""
    t0 = time.time()
    rc, rep, err = _cli("tune", onnx_path, *(bound or []), "--target", "cuda", "--db", str(db), "--time-budget", str(budget),
                        "--precision", precision, "--keep-going", "--trials-per-kernel", "16",
                        timeout=min(budget + 240, max(deadline - time.time(), 1)))
    row["tune_s"] = time.time() - t0
    row["tune_rc"] = rc
    if rep is None:
        return err
    kernels = rep.get("kernels", [])
    row["kernels"] = len(kernels)
    row["status"] = {s: sum(1 for k in kernels if k["status"] == s) for s in {k["status"] for k in kernels}}
    row["cost_model"] = rep.get("cost_model")
    # what went wrong, kernel by kernel: the status counts alone left the GPT-2 / BERT rows' failed kernels
    # unexplained once the call's output was gone
    row["problems"] = [{"name": k["name"], "status": k["status"], "message": k.get("message", ""),
                        "space": (k.get("space") or {}).get("space"), "check": k.get("check")}
                       for k in kernels if k["status"] == "failed" or (k.get("check") or {}).get("ok") is False]
    return None


def _summary(row: dict) -> dict:
    res = {r["backend"]: r for r in row.get("bench", {}).get("results", [])}
    tf = res.get("tvmfuse", {})
    torch_ms = {k: v.get("median_ms") for k, v in res.items() if k.startswith("torch") and v.get("median_ms")}
    best = min((k for k in torch_ms if k != "torch-eager"), key=lambda k: torch_ms[k], default=None)
    # bench's verification puts ok and rel_error on each backend's result (``floor``: ok within torch eager's own
    # error on the same converted graph, past the dtype's tolerance)
    # (``tf32_floor``: the same graph's error with TF32 operands, onnxruntime; a tf32 row passes within 1.5x it)
    ver = row.get("bench", {}).get("verification") or {}
    floor = ver.get("floor") if tf.get("floor") else None
    return {"tvmfuse_ms": tf.get("median_ms"), "eager_ms": torch_ms.get("torch-eager"), "best_compile": best,
            "best_compile_ms": torch_ms.get(best) if best else None, "verify": tf.get("ok"),
            "rel_error": tf.get("rel_error"), "floor": floor and floor["rel_error"],
            "tf32_floor": ver.get("tf32_floor"), "untuned": tf.get("untuned_kernels")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,mobilenet_v2,efficientnet_b0,convnext_tiny,bert,gpt2,vit,"
                                        "t5_encoder,llama,whisper_encoder")
    ap.add_argument("--size", default="small", choices=("small", "full"))
    ap.add_argument("--precisions", default="fp32,fp16", help="comma-separated: model, fp32, tf32, fp16")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--budget", type=float, default=120.0,
                    help="tune --time-budget per row, seconds; 0: no tuning, every kernel on its untuned default")
    ap.add_argument("--baselines", default=BASELINES,
                    help="bench --against (torch-compile-max alone compiles for minutes a model)")
    ap.add_argument("--db", type=Path, default=None, help="a database carried in (copied to $OUT/zoo.db)")
    ap.add_argument("--results", type=Path, default=None, help="an earlier zoo_gpu.json carried in: its rows are kept")
    ap.add_argument("--onnx-dir", type=Path, default=None,
                    help="carried user_form exports (uf:NAME rows read NAME.onnx, or NAME_full.onnx with --size full)")
    ap.add_argument("--deadline-s", type=float, default=540.0)
    ap.add_argument("--torch-tf32", default="auto", choices=("auto", "on", "off"),
                    help="bench's --torch-tf32: off times PyTorch at fp32's accuracy (its convs default to TF32)")
    ap.add_argument("--row-extra-s", type=float, default=None,
                    help="a row's time beyond its tune budget, before one has been measured in this call (default "
                         "300 s with torch-compile-max among the baselines, else 150: an untuned CNN row with "
                         "reduce-overhead took 60-115 s on the H100, its export included)")
    a = ap.parse_args()

    db = OUT / "zoo.db"
    if a.db and a.db.exists() and a.db.resolve() != db.resolve():
        shutil.copy(a.db, db)
    rows: dict = json.loads(a.results.read_text()).get("rows", {}) if a.results and a.results.exists() else {}
    work = Path(tempfile.mkdtemp(prefix="zoo-"))
    extra = a.row_extra_s if a.row_extra_s is not None else 300.0 if "torch-compile-max" in a.baselines else 150.0
    measured: list = []   # the rows of this call: once one ran, the longest of them is the estimate
    for model in a.models.split(","):
        for precision in a.precisions.split(","):
            for batch in (int(b) for b in a.batches.split(",")):
                key = row_key(model, a.size, precision, batch, a.seq, a.torch_tf32)
                if key in rows and "error" not in rows[key]:
                    continue
                if time.time() - T0 + a.budget + extra > a.deadline_s:
                    log(f"{key}: left for the next call (it takes about {a.budget + extra:.0f} s)")
                    continue
                t_row = time.time()
                log(f"{key}: export, " + (f"tune ({a.budget:.0f} s), " if a.budget > 0 else "untuned, ") + "bench")
                try:
                    rows[key] = run_row(model, a.size, precision, batch, a.seq, a.budget, db, work,
                                        T0 + a.deadline_s, a.baselines, a.onnx_dir, a.torch_tf32)
                except Exception as err:  # noqa: BLE001 - one row's failure is that row's entry
                    rows[key] = {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}"}
                measured.append(time.time() - t_row - a.budget)
                extra = max(measured)
                rows[key]["summary"] = _summary(rows[key])
                log(f"{key}: {rows[key]['summary']} {rows[key].get('error', '')}")
                (OUT / "zoo_gpu.json").write_text(json.dumps({"rows": rows}, indent=1, default=str))
    (OUT / "zoo_gpu.json").write_text(json.dumps({"rows": rows}, indent=1, default=str))
    print()
    print(f"{'row':34} {'verify':>7} {'kernels':>8} {'status':30} {'tvmfuse ms':>10} {'eager':>8} "
          f"{'best compile':>22} {'ratio':>6}")
    for key, r in rows.items():
        s = r.get("summary") or _summary(r)
        best = f"{s['best_compile_ms']:.3f} {s['best_compile']}" if s.get("best_compile_ms") else "-"
        ratio = (f"{s['tvmfuse_ms'] / s['best_compile_ms']:.2f}" if s.get("tvmfuse_ms") and s.get("best_compile_ms")
                 else "-")
        tf = f"{s['tvmfuse_ms']:.3f}" if s.get("tvmfuse_ms") else "-"
        eager = f"{s['eager_ms']:.3f}" if s.get("eager_ms") else "-"
        print(f"{key:34} {str(s.get('verify')):>7} {r.get('kernels', '-')!s:>8} {json.dumps(r.get('status', {}))[:30]:30} "
              f"{tf:>10} {eager:>8} {best:>22} {ratio:>6}  {r.get('error', '')[:60]}")
    print("(ratio = tvmfuse time / best torch.compile time: below 1, tvmfuse is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
