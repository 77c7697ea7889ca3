"""Hugging Face models exported the way most published ONNX files were made: the TorchScript exporter
(``dynamo=False``), opset 17, dynamic ``batch`` / ``sequence`` axes, and the inputs a tokenizer gives
(``input_ids``, ``attention_mask``, ``token_type_ids`` where the model takes them).

``scripts/model_zoo.py`` exports static single-input graphs with the dynamo exporter; these exports compute every
reshape and mask from ``Shape`` of their inputs, and their position ids from a cumsum of the mask (RoBERTa, OPT),
which is what tvmfuse's frontend has to fold (``tvmfuse/frontend/fold.py``). Random weights, seed 0.

    /tmp/xvenv/bin/python scripts/user_form.py --out /tmp/hf                      # every architecture, small
    /tmp/xvenv/bin/python scripts/user_form.py --out tests/fixtures/user_form --tiny --models roberta bert gemma swin
    /tmp/xvenv/bin/python scripts/user_form.py --out /tmp/hff --full                # base sizes, 1 x 128 tokens
    /tmp/xvenv/bin/python scripts/user_form.py --out /tmp/tv --torchvision          # torchvision, dynamic batch
    /tmp/xvenv/bin/python scripts/user_form.py --out /tmp/kv --optimum              # decoders with their KV cache
    tvmfuse bench /tmp/hf/roberta.onnx --target llvm --against onnxruntime \\
        --input-shape input_ids=2x16 --input-shape attention_mask=2x16

Each export writes ``<name>.onnx`` and ``<name>.inputs.npz`` (batch 2, 16 tokens, the second sequence padded).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

TEXT2 = ["distilbert", "roberta", "deberta_v2", "mpnet", "opt", "gpt_neo", "bloom", "falcon", "mistral", "qwen2",
         "phi", "gemma", "clip_text"]
TEXT3 = ["bert", "albert", "electra", "mobilebert"]           # also token_type_ids
IMAGES = ["deit", "swin", "convnextv2", "segformer", "beit", "dinov2"]
AUDIO = ["wav2vec2"]
MODELS = TEXT2 + TEXT3 + IMAGES + AUDIO
BATCH, SEQ, VOCAB = 2, 16, 1000
OPSET = 17


def _build(tf, name: str, tiny: bool):
    width, ffn, layers = (32, 64, 1) if tiny else (64, 128, 2)
    common = dict(hidden_size=width, num_attention_heads=4, intermediate_size=ffn, num_hidden_layers=layers)
    text = dict(vocab_size=VOCAB)
    builders = {
        "distilbert": lambda: tf.DistilBertModel(tf.DistilBertConfig(dim=width, n_heads=4, hidden_dim=ffn,
                                                                     n_layers=layers, **text)),
        "roberta": lambda: tf.RobertaModel(tf.RobertaConfig(**common, **text), add_pooling_layer=False),
        "deberta_v2": lambda: tf.DebertaV2Model(tf.DebertaV2Config(**common, **text)),
        "mpnet": lambda: tf.MPNetModel(tf.MPNetConfig(**common, **text), add_pooling_layer=False),
        "opt": lambda: tf.OPTModel(tf.OPTConfig(hidden_size=width, num_attention_heads=4, ffn_dim=ffn,
                                                num_hidden_layers=layers, word_embed_proj_dim=width, use_cache=False,
                                                **text)),
        "gpt_neo": lambda: tf.GPTNeoModel(tf.GPTNeoConfig(hidden_size=width, num_heads=4, num_layers=2,
                                                          attention_types=[[["global", "local"], 1]], window_size=8,
                                                          use_cache=False, **{"max_position_embeddings": 128,
                                                                              **text})),
        "bloom": lambda: tf.BloomModel(tf.BloomConfig(hidden_size=width, n_head=4, n_layer=layers, use_cache=False,
                                                      **text)),
        "falcon": lambda: tf.FalconModel(tf.FalconConfig(hidden_size=width, num_attention_heads=4,
                                                         num_hidden_layers=layers, use_cache=False, **text)),
        # grouped K/V heads, rotary embeddings, RMSNorm, SwiGLU
        "mistral": lambda: tf.MistralModel(tf.MistralConfig(num_key_value_heads=2, use_cache=False, **common, **text)),
        "qwen2": lambda: tf.Qwen2Model(tf.Qwen2Config(num_key_value_heads=2, use_cache=False, **common, **text)),
        "phi": lambda: tf.PhiModel(tf.PhiConfig(use_cache=False, **common, **text)),
        "gemma": lambda: tf.GemmaModel(tf.GemmaConfig(num_key_value_heads=1, head_dim=width // 4, use_cache=False,
                                                      **common, **text)),
        "clip_text": lambda: tf.CLIPTextModel(tf.CLIPTextConfig(**common, **text)),
        "bert": lambda: tf.BertModel(tf.BertConfig(**common, **text), add_pooling_layer=False),
        "albert": lambda: tf.AlbertModel(tf.AlbertConfig(embedding_size=width // 2, **common, **text),
                                         add_pooling_layer=False),
        "electra": lambda: tf.ElectraModel(tf.ElectraConfig(embedding_size=width // 2, **common, **text)),
        "mobilebert": lambda: tf.MobileBertModel(tf.MobileBertConfig(
            hidden_size=width, embedding_size=width // 2, num_attention_heads=4, intermediate_size=ffn,
            num_hidden_layers=layers, intra_bottleneck_size=width // 2, true_hidden_size=width // 2, **text),
            add_pooling_layer=False),
        "deit": lambda: tf.DeiTModel(tf.DeiTConfig(image_size=32, patch_size=8, **common), add_pooling_layer=False),
        "swin": lambda: tf.SwinModel(tf.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1],
                                                   num_heads=[2, 2], window_size=4)),
        "convnextv2": lambda: tf.ConvNextV2Model(tf.ConvNextV2Config(hidden_sizes=[16, 32, 32, 32],
                                                                     depths=[1, 1, 1, 1], image_size=32)),
        "segformer": lambda: tf.SegformerModel(tf.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
            decoder_hidden_size=32)),
        "beit": lambda: tf.BeitModel(tf.BeitConfig(image_size=32, patch_size=8, use_relative_position_bias=True,
                                                   **common), add_pooling_layer=False),
        "dinov2": lambda: tf.Dinov2Model(tf.Dinov2Config(image_size=32, patch_size=8, **common)),
        "wav2vec2": lambda: tf.Wav2Vec2Model(tf.Wav2Vec2Config(
            **common, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4)),
    }
    return builders[name]()


# --full: the published base sizes (random weights); decoders of billions of parameters are left out
FULL = ["distilbert", "roberta", "bert", "albert", "electra", "mpnet", "opt", "gpt_neo", "clip_text", "deit", "swin",
        "beit", "dinov2", "convnextv2", "wav2vec2"]


def _build_full(tf, name: str):
    base = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=12)
    builders = {
        "distilbert": lambda: tf.DistilBertModel(tf.DistilBertConfig()),                  # distilbert-base
        "roberta": lambda: tf.RobertaModel(tf.RobertaConfig(vocab_size=50265, max_position_embeddings=514,
                                                            pad_token_id=1, type_vocab_size=1),
                                           add_pooling_layer=False),                       # roberta-base
        "bert": lambda: tf.BertModel(tf.BertConfig(), add_pooling_layer=False),            # bert-base-uncased
        "albert": lambda: tf.AlbertModel(tf.AlbertConfig(embedding_size=128, **base), add_pooling_layer=False),
        "electra": lambda: tf.ElectraModel(tf.ElectraConfig(embedding_size=768, **base)),  # electra-base
        "mpnet": lambda: tf.MPNetModel(tf.MPNetConfig(), add_pooling_layer=False),        # mpnet-base
        "opt": lambda: tf.OPTModel(tf.OPTConfig(use_cache=False)),                         # opt-125m
        "gpt_neo": lambda: tf.GPTNeoModel(tf.GPTNeoConfig(hidden_size=768, num_layers=12, num_heads=12,
                                                          attention_types=[[["global", "local"], 6]],
                                                          use_cache=False)),               # gpt-neo-125M
        "clip_text": lambda: tf.CLIPTextModel(tf.CLIPTextConfig()),                        # clip-vit-base's text
        "deit": lambda: tf.DeiTModel(tf.DeiTConfig(), add_pooling_layer=False),            # deit-base, 224
        "swin": lambda: tf.SwinModel(tf.SwinConfig()),                                     # swin-tiny, 224
        "beit": lambda: tf.BeitModel(tf.BeitConfig(use_relative_position_bias=True), add_pooling_layer=False),
        "dinov2": lambda: tf.Dinov2Model(tf.Dinov2Config(hidden_size=384, num_attention_heads=6,
                                                         image_size=224)),                 # dinov2-small
        "convnextv2": lambda: tf.ConvNextV2Model(tf.ConvNextV2Config()),                   # convnextv2-tiny, 224
        "wav2vec2": lambda: tf.Wav2Vec2Model(tf.Wav2Vec2Config()),                         # wav2vec2-base
    }
    return builders[name]()


# --torchvision: torchvision's models as its users export them (TorchScript, a dynamic batch axis); "seg_" names
# are its segmentation models (their "out" head), at 128 x 128, the rest at 224 x 224 (Inception-v3 at 299)
TORCHVISION = ["seg_fcn_resnet50", "seg_deeplabv3_mobilenet_v3_large", "seg_lraspp_mobilenet_v3_large",
               "efficientnet_v2_s", "swin_t", "maxvit_t", "inception_v3", "vgg11", "alexnet", "regnet_x_400mf",
               "wide_resnet50_2", "convnext_small", "mobilenet_v3_large"]


def export_torchvision(out: Path, names: list[str], opset: int = OPSET) -> int:
    import torch
    import torchvision

    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in names:
        torch.manual_seed(0)
        if name.startswith("seg_"):
            inner = getattr(torchvision.models.segmentation, name[4:])(weights=None, weights_backbone=None)

            class Out(torch.nn.Module):   # the segmentation map alone (the models return a dict)
                def __init__(self, m):
                    super().__init__()
                    self.m = m

                def forward(self, x):
                    return self.m(x)["out"]

            model, side = Out(inner), 128
        else:
            model, side = getattr(torchvision.models, name)(weights=None), 299 if name == "inception_v3" else 224
        failed += not _save(torch, model, [torch.randn(1, 3, side, side)], ["input"], {"input": {0: "batch"}},
                            out / name, opset)
    return 1 if failed else 0


def _save(torch, model, tensors: list, names: list[str], axes: dict, stem: Path, opset: int) -> bool:
    """``model`` exported the TorchScript way to ``<stem>.onnx`` with its inputs in ``<stem>.inputs.npz``; an
    export that fails is reported and skipped (the rest go on)."""
    t0 = time.time()
    try:
        with torch.no_grad():
            torch.onnx.export(model.eval(), tuple(tensors), f"{stem}.onnx", input_names=names, output_names=["output"],
                              dynamic_axes={**axes, "output": {0: "batch"}}, opset_version=opset, dynamo=False)
    except Exception as err:  # noqa: BLE001 - report the model and go on with the rest
        print(f"FAILED {stem.name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
        return False
    np.savez(f"{stem}.inputs.npz", **{n: t.numpy() for n, t in zip(names, tensors)})
    print(f"exported {stem.name}.onnx ({time.time() - t0:.1f} s)", flush=True)
    return True


CLIP_POSITIONS = 77   # CLIP's context length


def _sizes(full: bool) -> tuple[int, int]:
    """(image side, audio samples) of an export: the published input, or the small one."""
    return (224, 16000) if full else (32, 1600)


def _inputs(torch, name: str, full: bool = False):
    """(tensors, input names, dynamic axes) as a tokenizer or an image / audio pipeline hands them over."""
    side, samples = _sizes(full)
    batch, seq = (1, 128) if full else (BATCH, SEQ)
    if name == "clip_text":
        seq = min(seq, CLIP_POSITIONS)
    if name in IMAGES:
        return [torch.randn(batch, 3, side, side)], ["pixel_values"], {"pixel_values": {0: "batch"}}
    if name in AUDIO:
        return [torch.randn(batch, samples)], ["input_values"], {"input_values": {0: "batch", 1: "samples"}}
    ids = torch.randint(0, VOCAB, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.int64)
    if batch > 1:
        mask[-1, seq - seq // 4:] = 0   # the last sequence is padded
    tensors, names = [ids, mask], ["input_ids", "attention_mask"]
    if name in TEXT3:
        tensors.append(torch.zeros(batch, seq, dtype=torch.int64))
        names.append("token_type_ids")
    return tensors, names, {n: {0: "batch", 1: "sequence"} for n in names}


def input_shapes(name: str, batch: int, seq: int, full: bool = False) -> list[str]:
    """``--input-shape`` values binding an export's dynamic axes at ``batch`` x ``seq`` (images and audio: their
    export's size; CLIP's text: at most its 77 positions)."""
    side, samples = _sizes(full)
    if name in IMAGES:
        return [f"pixel_values={batch}x3x{side}x{side}"]
    if name in AUDIO:
        return [f"input_values={batch}x{samples}"]
    seq = min(seq, CLIP_POSITIONS) if name == "clip_text" else seq
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if name in TEXT3 else [])
    return [f"{n}={batch}x{seq}" for n in names]


def export(out: Path, names: list[str], tiny: bool, full: bool = False, opset: int = OPSET) -> int:
    import torch
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in names:
        torch.manual_seed(0)
        model = _build_full(tf, name) if full else _build(tf, name, tiny)
        if hasattr(model, "config"):
            model.config._attn_implementation = "eager"   # the attention users export, not SDPA's fused op
        tensors, input_names, axes = _inputs(torch, name, full)

        class FirstOutput(torch.nn.Module):   # keyword inputs: GPT-Neo / BLOOM / Falcon take past_key_values second
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, *args):
                out = self.inner(**dict(zip(input_names, args)))
                return out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state

        failed += not _save(torch, FirstOutput(model), tensors, input_names, axes,
                            out / (f"{name}_full" if full else name), opset)
    return 1 if failed else 0


# --optimum: causal LMs through Hugging Face optimum's exporter (``optimum-cli export onnx --task
# text-generation-with-past``), the way most published decoder ONNX files were made: input_ids, attention_mask,
# position_ids and every layer's past_key_values.N.key / .value in, the logits and present.N.* out, the past's
# length a dynamic axis (0 on the first step)
OPTIMUM = ["llama", "gpt2", "t5", "bart"]
SEQ2SEQ = ["t5", "bart"]   # encoder_model.onnx, decoder_model.onnx, decoder_with_past_model.onnx and the merged one


def export_optimum(out: Path, names: list[str], tiny: bool) -> int:
    import tempfile

    import torch
    import transformers as tf
    from optimum.exporters.onnx import main_export

    width, vocab = (32, 256) if tiny else (64, 1000)
    builders = {
        # grouped K/V heads, rotary embeddings
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=width, num_attention_heads=4,
                                                            num_key_value_heads=2, intermediate_size=2 * width,
                                                            num_hidden_layers=2, vocab_size=vocab)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=width, n_head=4, n_layer=2, vocab_size=vocab,
                                                         n_positions=256)),
        # relative-position bias, cross-attention
        "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(d_model=width, d_ff=2 * width, num_layers=2,
                                                                num_decoder_layers=2, num_heads=4,
                                                                d_kv=width // 4, vocab_size=vocab)),
        "bart": lambda: tf.BartForConditionalGeneration(tf.BartConfig(
            d_model=width, encoder_ffn_dim=2 * width, decoder_ffn_dim=2 * width, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=vocab)),
    }
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in names:
        torch.manual_seed(0)
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            builders[name]().save_pretrained(f"{tmp}/model")
            task = "text2text-generation-with-past" if name in SEQ2SEQ else "text-generation-with-past"
            try:
                main_export(f"{tmp}/model", f"{tmp}/onnx", task=task)  # its default opset
            except Exception as err:  # noqa: BLE001 - report the model and go on with the rest
                print(f"FAILED {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                failed += 1
                continue
            if name in SEQ2SEQ:   # optimum merges these itself
                made = {"encoder_model": "encoder", "decoder_model_merged": "merged"}
                for stem, suffix in made.items():
                    Path(f"{tmp}/onnx/{stem}.onnx").replace(out / f"{name}_{suffix}.onnx")
            else:
                Path(f"{tmp}/onnx/model.onnx").replace(out / f"{name}_past.onnx")
                _merge(out / f"{name}_past.onnx", out / f"{name}_merged.onnx")
        print(f"exported {name} ({time.time() - t0:.1f} s)", flush=True)
    return 1 if failed else 0


def _merge(with_past: Path, merged: Path) -> None:
    """optimum 1.x's ``decoder_model_merged.onnx``: the first step (no past inputs; the logits and the new KV
    cache out) and the later steps under one ``If`` on a ``use_cache_branch`` input, weights shared. The first
    step is the with-past graph reading an empty cache it makes itself (TorchScript cannot trace transformers
    4.57's first-step masks), which is what it computes."""
    import onnx
    from onnx import helper as h
    from optimum.onnx.graph_transformations import merge_decoders

    first = onnx.load(str(with_past))
    pasts = [vi for vi in first.graph.input if vi.name.startswith("past_key_values.")]
    made = [h.make_node("Shape", ["input_ids"], ["first_step/batch"], start=0, end=1)]
    for vi in pasts:
        rest = [d.dim_value for d in vi.type.tensor_type.shape.dim][1:]
        rest[-2] = 0   # (batch, heads, past 0, head dim)
        made += [h.make_node("Constant", [], [f"{vi.name}/rest"], value=onnx.numpy_helper.from_array(
                     np.array(rest, np.int64), f"{vi.name}/rest")),
                 h.make_node("Concat", ["first_step/batch", f"{vi.name}/rest"], [f"{vi.name}/shape"], axis=0),
                 h.make_node("ConstantOfShape", [f"{vi.name}/shape"], [f"first_step/{vi.name}"])]
    for node in first.graph.node:   # one name each across the two branches (SSA holds over the If's scopes)
        node.input[:] = [f"first_step/{n}" if n.startswith("past_key_values.") else n for n in node.input]
    kept = [vi for vi in first.graph.input if vi not in pasts]
    del first.graph.input[:]
    first.graph.input.extend(kept)
    nodes = made + list(first.graph.node)
    del first.graph.node[:]
    first.graph.node.extend(nodes)
    merge_decoders(first, onnx.load(str(with_past)), save_path=str(merged))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=None, choices=MODELS + TORCHVISION + OPTIMUM)
    ap.add_argument("--torchvision", action="store_true", help="torchvision's models (TORCHVISION) instead")
    ap.add_argument("--optimum", action="store_true", help="causal LMs with their KV cache through optimum "
                    "(OPTIMUM; needs optimum-onnx, which wants transformers < 4.58)")
    ap.add_argument("--tiny", action="store_true", help="hidden 32, one layer: the test fixtures")
    ap.add_argument("--opset", type=int, default=OPSET, help="older exports: 11 (Unsqueeze's axes an attribute, "
                    "ReduceSum's too), 13, 14")
    ap.add_argument("--full", action="store_true", help="the published base sizes (FULL), batch 1, 128 tokens, "
                    "224 x 224 images, 1 s of 16 kHz audio")
    args = ap.parse_args()
    if args.torchvision:
        return export_torchvision(args.out, args.models or TORCHVISION, args.opset)
    if args.optimum:
        return export_optimum(args.out, args.models or OPTIMUM, args.tiny)
    args.models = args.models or MODELS
    if args.full and set(args.models) - set(FULL):
        ap.error("--full exports only " + " ".join(FULL))
    return export(args.out, args.models, args.tiny, args.full, args.opset)


if __name__ == "__main__":
    sys.exit(main())
