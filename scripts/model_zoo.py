"""Real-model ONNX coverage for tvmfuse's frontend (issue 6).

Two steps in two environments, because torch is not a tvmfuse dependency:

    /work/venv-torch/bin/python scripts/model_zoo.py export --out /work/zoo      # torch, torchvision, transformers
    /work/venv/bin/python       scripts/model_zoo.py verify --zoo /work/zoo --benchmarks BENCHMARKS.md

``export`` writes ``<model>.<dtype>.onnx`` (+ external data where the exporter chooses it) and
``<model>.inputs.npz`` for every architecture below, with random weights (seed 0) at small sizes so
each compiles in minutes on 2 CPU cores; fp16 is the same fp32 weights ``.half()``-ed.
``verify`` runs load -> import -> plan.partition (the default tvmfuse planner) -> tvmfuse.compile.build (untuned, llvm) ->
Relax VM and compares with onnxruntime: relative error ||a-b||/||b|| < 1e-4 (fp32), < 1e-2 (fp16).
When onnxruntime's CPU EP cannot run the fp16 model, the fp16 result is compared with the fp32
model's onnxruntime output at the fp16 tolerance ("ref fp32" in the table).
``--tiny`` exports the test fixtures (tests/fixtures/) at tiny configs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np

IMG = 64
SEQ = 16
VISION = ["resnet50", "mobilenet_v2", "efficientnet_b0", "convnext_tiny", "squeezenet1_0"]
# torchvision CNNs outside the default zoo, exported by name (--models): shapes no default or prior was fitted to
OTHER_VISION = ["squeezenet1_1", "mobilenet_v3_small", "resnet18", "resnet34", "shufflenet_v2_x1_0",
                "regnet_y_400mf"]
TEXT = ["bert", "gpt2", "vit", "t5_encoder", "llama", "whisper_encoder"]
# --size: "tiny" the test fixtures; "small" hidden 64, 2 layers (minutes on 2 CPU cores); "full" the published
# architectures (bert-base, gpt2, vit-base/16 at 224, t5-small's encoder, a TinyLlama-1.1B-shaped decoder with
# grouped K/V heads, whisper-base's encoder, torchvision's CNNs at 224), random weights: the shapes users bring
SIZES = ("tiny", "small", "full")
TOL = {"float32": 1e-4, "float16": 1e-2}


# ----------------------------------------------------------------------------------------------- export
def _build(name: str, size: str, seq: int | None = None, batch: int = 1, layers: int | None = None):
    import torch

    tiny, full = size == "tiny", size == "full"
    img = 224 if full else IMG

    torch.manual_seed(0)
    if name == "tinycnn":  # test fixture: conv-bn-relu, a residual block, depthwise conv, pool, linear
        nn = torch.nn

        class TinyCNN(nn.Module):
            def __init__(self):
                super().__init__()
                self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
                self.block = nn.Sequential(nn.Conv2d(8, 8, 3, 1, 1, groups=8), nn.BatchNorm2d(8), nn.ReLU6(),
                                           nn.Conv2d(8, 8, 1))
                self.head = nn.Linear(8, 10)

            def forward(self, x):
                x = self.stem(x)
                x = torch.nn.functional.gelu(x + self.block(x))
                return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1)).softmax(-1)

        return TinyCNN(), (torch.randn(1, 3, 16, 16),), ["image"]
    if name in VISION + OTHER_VISION:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None)
        # random init leaves BatchNorm's running stats at (0, 1): activations shrink layer by layer until
        # the output is ~1e-9 (0 in fp16), which would make any comparison pass. Calibrate the stats on
        # random images so every layer sees O(1) activations, as a trained model does.
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.momentum = None
        model.train()
        with torch.no_grad():
            for _ in range(2):
                model(torch.randn(4, 3, img, img))
        model.eval()
        return model, (torch.randn(batch, 3, img, img),), ["image"]
    import transformers as tf

    if full:
        return _build_full(tf, name, seq or 128, batch, layers)
    small = dict(hidden_size=32 if tiny else 64, num_attention_heads=2 if tiny else 4,
                 intermediate_size=64 if tiny else 128)
    layers = layers or (1 if tiny else 2)
    vocab = 64 if tiny else 1000
    ids = torch.randint(0, vocab, (batch, seq or (8 if tiny else SEQ)))
    if name == "whisper_encoder":  # log-mel frames in, two convs (the second stride 2), then the encoder layers
        frames = 2 * (seq or (8 if tiny else SEQ))
        cfg = tf.WhisperConfig(d_model=small["hidden_size"], encoder_layers=layers, decoder_layers=1,
                               encoder_attention_heads=small["num_attention_heads"], decoder_attention_heads=2,
                               encoder_ffn_dim=small["intermediate_size"], decoder_ffn_dim=64, num_mel_bins=80,
                               max_source_positions=frames // 2)
        return tf.WhisperModel(cfg).encoder, (torch.randn(batch, 80, frames),), ["input_features"]
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=max(64, seq or 0), **small)
        return tf.BertModel(cfg, add_pooling_layer=False), (ids,), ["input_ids"]
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=small["hidden_size"], n_layer=layers,
                            n_head=small["num_attention_heads"], n_positions=max(64, seq or 0), use_cache=False)
        return tf.GPT2Model(cfg), (ids,), ["input_ids"]
    if name == "vit":
        cfg = tf.ViTConfig(image_size=32, patch_size=8, num_hidden_layers=layers, **small)
        return tf.ViTModel(cfg, add_pooling_layer=False), (torch.randn(1, 3, 32, 32),), ["pixel_values"]
    if name == "t5_encoder":
        cfg = tf.T5Config(vocab_size=vocab, d_model=small["hidden_size"], d_kv=16, d_ff=small["intermediate_size"],
                          num_layers=layers, num_heads=small["num_attention_heads"], use_cache=False)
        return tf.T5EncoderModel(cfg), (ids,), ["input_ids"]
    if name == "llama":  # RMSNorm + SwiGLU MLP + rotary embeddings
        cfg = tf.LlamaConfig(vocab_size=vocab, num_hidden_layers=layers, num_key_value_heads=small["num_attention_heads"],
                             max_position_embeddings=max(64, seq or 0), use_cache=False, **small)
        return tf.LlamaModel(cfg), (ids,), ["input_ids"]
    raise ValueError(name)


def _build_full(tf, name: str, seq: int, batch: int, layers: int | None):
    """The published architecture of ``name`` with random weights (``layers`` overrides its depth)."""
    import torch

    def depth(cfg, attr):
        if layers:
            setattr(cfg, attr, layers)
        return cfg

    ids = lambda vocab: torch.randint(0, vocab, (batch, seq))  # noqa: E731
    if name == "bert":  # bert-base-uncased
        cfg = depth(tf.BertConfig(max_position_embeddings=max(512, seq)), "num_hidden_layers")
        return tf.BertModel(cfg, add_pooling_layer=False), (ids(cfg.vocab_size),), ["input_ids"]
    if name == "gpt2":  # gpt2 (124M)
        cfg = depth(tf.GPT2Config(n_positions=max(1024, seq), use_cache=False), "n_layer")
        return tf.GPT2Model(cfg), (ids(cfg.vocab_size),), ["input_ids"]
    if name == "vit":  # vit-base-patch16-224
        cfg = depth(tf.ViTConfig(), "num_hidden_layers")
        return tf.ViTModel(cfg, add_pooling_layer=False), (torch.randn(batch, 3, 224, 224),), ["pixel_values"]
    if name == "t5_encoder":  # t5-small's encoder
        cfg = depth(tf.T5Config(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, use_cache=False),
                    "num_layers")
        return tf.T5EncoderModel(cfg), (ids(cfg.vocab_size),), ["input_ids"]
    if name == "llama":  # TinyLlama-1.1B's shape: RMSNorm, SwiGLU, rotary embeddings, 32 query / 4 K/V heads
        cfg = depth(tf.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                   num_attention_heads=32, num_key_value_heads=4,
                                   max_position_embeddings=max(2048, seq), use_cache=False), "num_hidden_layers")
        return tf.LlamaModel(cfg), (ids(cfg.vocab_size),), ["input_ids"]
    if name == "whisper_encoder":  # whisper-base's encoder: 30 s of audio, 3000 log-mel frames
        cfg = depth(tf.WhisperConfig(d_model=512, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048,
                                     decoder_layers=6, decoder_attention_heads=8, decoder_ffn_dim=2048,
                                     num_mel_bins=80, max_source_positions=1500), "encoder_layers")
        return tf.WhisperModel(cfg).encoder, (torch.randn(batch, 80, 3000),), ["input_features"]
    raise ValueError(name)


class _FirstOutput:
    """Wrap a transformers model so the export has one tensor output (last_hidden_state)."""

    def __new__(cls, model):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                out = self.inner(x)
                if isinstance(out, torch.Tensor):
                    return out
                return out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state

        return Wrapped(model)


def export(out: Path, names: list[str], size: str = "small", seq: int | None = None, batch: int = 1,
           dtypes: tuple[str, ...] = ("float32", "float16"), layers: int | None = None) -> list[Path]:
    """Export each model in ``names`` as ``<stem>.<dtype>.onnx`` plus ``<stem>.inputs.npz``; the paths written."""
    import torch

    tiny = size == "tiny"
    written = []
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        model, args, input_names = _build(name, size, seq, batch, layers)
        if name in TEXT and hasattr(model, "config"):
            model.config._attn_implementation = "eager"
        model = _FirstOutput(model).eval()
        stem = f"tiny_{name}" if tiny else name
        if size == "full":
            stem += "_full" + (f"_l{layers}" if layers else "")
        if name in VISION + OTHER_VISION and batch != 1:
            stem += f"_b{batch}"
        elif seq or batch != 1:
            stem += f"_b{batch}s{seq or SEQ}"
        np.savez(out / f"{stem}.inputs.npz", **{n: a.numpy() for n, a in zip(input_names, args)})
        for dtype in dtypes:
            m = model.half() if dtype == "float16" else model.float()
            a = tuple(x.half() if x.is_floating_point() and dtype == "float16" else x for x in args)
            path = out / f"{stem}.{dtype}.onnx"
            t0 = time.time()
            try:
                with torch.no_grad():
                    torch.onnx.export(m, a, str(path), input_names=input_names, output_names=["output"],
                                      dynamo=True, external_data=not tiny, optimize=True)
                how = "dynamo"
            except Exception as err:  # noqa: BLE001 - fall back to the TorchScript exporter
                print(f"  dynamo export of {name} {dtype} failed ({type(err).__name__}: {str(err)[:200]}); TorchScript exporter")
                with torch.no_grad():
                    torch.onnx.export(m, a, str(path), input_names=input_names, output_names=["output"],
                                      dynamo=False, opset_version=17)
                how = "torchscript"
            print(f"exported {path.name} ({how}, {time.time() - t0:.1f}s)", flush=True)
            written.append(path)
    return written


# ----------------------------------------------------------------------------------------------- verify
def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _ort_run(model_path: Path, feeds: dict) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def verify_one(path: Path, feeds: dict, ref32: Path | None) -> dict:
    """load -> import -> partition -> compile -> run; compare with onnxruntime. Returns one table row."""
    from tvmfuse._tvm import relax, tvm
    from tvmfuse.errors import TvmfuseError
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.compile import build
    from tvmfuse.plan.partition import DEFAULT_PLANNER, fused_functions, partition
    from tvmfuse.target import resolve_target

    name, dtype = path.name.split(".")[:2]
    row = {"model": name, "dtype": dtype, "import": "no", "ops": "-", "kernels": "-", "rel_err": "-",
           "status": "", "seconds": 0.0, "fixups": ""}
    t0 = time.time()
    try:
        loaded = load_model(path)
        row["ops"] = len(loaded.proto.graph.node)
        row["fixups"] = ", ".join(loaded.fixups)
        mod = import_model(loaded)
        row["import"] = "yes"
        target = resolve_target("llvm")
        fused, _plan = partition(mod, target=target, planner=DEFAULT_PLANNER)
        row["kernels"] = len(fused_functions(fused))
        built = build(fused, target=target, database=None)  # tvmfuse's own (untuned) build path
        vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
        args = [tvm.runtime.tensor(feeds[s.name].astype(s.dtype)) for s in loaded.inputs]
        out = vm["main"](*args, *built.lifted_params)
        got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    except TvmfuseError as err:
        row["status"] = f"FAIL: {err}"[:160]
        row["seconds"] = round(time.time() - t0, 1)
        return row
    except Exception as err:  # noqa: BLE001 - report, go on with the next model
        row["status"] = f"FAIL ({type(err).__name__}): {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"[:160]
        row["seconds"] = round(time.time() - t0, 1)
        return row
    ref_note = ""
    try:
        ref = _ort_run(path, {k: v.astype(s.dtype) for s in loaded.inputs for k, v in feeds.items() if k == s.name})
    except Exception:  # noqa: BLE001 - onnxruntime's CPU EP lacks some fp16 kernels
        if ref32 is None:
            raise
        ref = _ort_run(ref32, {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in feeds.items()})
        ref_note = " (ref fp32)"
    err = _rel_err(got, ref)
    row["rel_err"] = f"{err:.1e}"
    ok = err < TOL[dtype] and np.isfinite(got).all()
    row["status"] = ("ok" if ok else f"FAIL: rel err above {TOL[dtype]:.0e}") + ref_note
    if dtype == "float16" and not ref_note and ref32 is not None:
        # the fp16 noise floor: how far onnxruntime's own fp16 run is from its fp32 run
        ref_fp32 = _ort_run(ref32, {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in feeds.items()})
        row["status"] += f" (ort fp16 vs fp32: {_rel_err(ref, ref_fp32):.1e}; tvm fp16 vs ort fp32: {_rel_err(got, ref_fp32):.1e})"
    rms = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2)))
    if not rms > 1e-3:  # a vanishing reference makes every comparison pass
        row["status"] = f"FAIL: degenerate reference (rms {rms:.1e})"
    row["seconds"] = round(time.time() - t0, 1)
    return row


def _table(rows: list[dict]) -> str:
    head = "| model | dtype | import ok | ops | kernels | rel err | status | fix-ups | s |\n|---|---|---|---|---|---|---|---|---|\n"
    return head + "".join(
        f"| {r['model']} | {r['dtype']} | {r['import']} | {r['ops']} | {r['kernels']} | {r['rel_err']} | "
        f"{r['status']} | {r['fixups'] or '-'} | {r['seconds']} |\n" for r in rows)


def _machine() -> str:
    cpu = "cpu"
    try:
        for line in open("/proc/cpuinfo", encoding="ascii"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, {platform.system()} {platform.machine()}"


def write_section(benchmarks: Path, heading: str, body: str) -> None:
    """Replace (or append) the ``heading`` section of BENCHMARKS.md, leaving other sections alone."""
    text = benchmarks.read_text() if benchmarks.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    section = f"{heading}\n{body.rstrip()}\n\n"
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    benchmarks.write_text(text)


def verify(zoo: Path, names: list[str], benchmarks: Path | None) -> int:
    rows = []
    for name in names:
        feeds_path = zoo / f"{name}.inputs.npz"
        if not feeds_path.exists():
            print(f"skip {name}: no {feeds_path.name}")
            continue
        feeds = dict(np.load(feeds_path))
        for dtype in ("float32", "float16"):
            path = zoo / f"{name}.{dtype}.onnx"
            if not path.exists():
                continue
            ref32 = zoo / f"{name}.float32.onnx"
            row = verify_one(path, feeds, ref32 if dtype == "float16" else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    table = _table(rows)
    print(table)
    if benchmarks is not None:
        n_ok = sum(r["status"].startswith("ok") for r in rows)
        body = (f"Measured {datetime.date.today().isoformat()} on {_machine()} with `scripts/model_zoo.py` "
                f"(random weights, batch 1, images {IMG}x{IMG} (ViT 32x32), sequence {SEQ}; import -> "
                f"`plan.partition` (tvmfuse planner) -> untuned `tvmfuse.compile.build` on llvm -> onnxruntime). "
                f"ops = ONNX nodes, kernels = fused PrimFuncs, rel err = ||tvm - ort|| / ||ort||; tolerance "
                f"1e-4 fp32, 1e-2 fp16. {n_ok}/{len(rows)} ok.\n\n" + table)
        fuzz_note = benchmarks.with_name(".fuzz_frontend.md")
        if fuzz_note.exists():
            body += "\n" + fuzz_note.read_text()
        write_section(benchmarks, "## ONNX model coverage (issue 6)", body)
    return 0 if all(r["status"].startswith("ok") for r in rows) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--out", type=Path, default=Path("/work/zoo"))
    e.add_argument("--models", nargs="*", default=VISION + TEXT)
    e.add_argument("--tiny", action="store_true", help="tiny configs for tests/fixtures (--size tiny)")
    e.add_argument("--size", choices=SIZES, default="small", help="tiny (fixtures), small (hidden 64, 2 layers; "
                   "the default) or full (the published architectures, random weights)")
    e.add_argument("--layers", type=int, default=None, help="override the text models' depth")
    e.add_argument("--dtypes", default="float32,float16")
    e.add_argument("--seq", type=int, default=None, help="tokens per sequence of the text models (default %d)" % SEQ)
    e.add_argument("--batch", type=int, default=1, help="batch of the text models' inputs")
    v = sub.add_parser("verify")
    v.add_argument("--zoo", type=Path, default=Path("/work/zoo"))
    v.add_argument("--models", nargs="*", default=VISION + TEXT)
    v.add_argument("--benchmarks", type=Path, default=None)
    args = ap.parse_args()
    if args.cmd == "export":
        export(args.out, args.models, "tiny" if args.tiny else args.size, args.seq, args.batch,
               tuple(d for d in args.dtypes.split(",") if d), args.layers)
        return 0
    return verify(args.zoo, args.models, args.benchmarks)


if __name__ == "__main__":
    sys.exit(main())
