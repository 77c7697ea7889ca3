"""High-level rewrites on Relax operators, before legalization (phase 1 of the planner).

One rewrite per module, each a Relax module pass (``pass(mod) -> mod``) with a before/after test in
``tests/plan/test_rewrites.py``; the rewrites that are plain functions keep their ``f(mod, ...)`` form too:

- :func:`pairwise_extrema` / :func:`PairwiseExtrema` (``pairwise_extrema``): ONNX's variadic Max / Min / Sum,
  which the importer writes as a reduction over a stacked axis, as pairwise elementwise ops (first: a reduction
  that reduces no row keeps a kernel from the row template and its elementwise neighbours).
- :class:`FoldBatchNorm` (``fold_batchnorm``): conv2d followed by per-channel affine constants (inference
  BatchNorm, which the importer's ``DecomposeOpsForInference`` turned into add/subtract/divide/multiply)
  becomes conv2d with scaled weights plus one bias add; Dropout, the identity at inference, goes first
  (:func:`drop_inference_identities`, ``identities``).
- :func:`trim_dead_taps` / :func:`TrimDeadTaps` (``dead_taps``): dilated convs whose edge taps read only padding
  (DeepLab's atrous pyramid on a small feature map) run on the taps that reach the input.
- :func:`channels_last` / :func:`ChannelsLast` (``channels_last``): 2-D convs run NHWC with OHWI weights, and
  :func:`compose_transposes` / :func:`ComposeTransposes` (``compose_transposes``) removes the transposes that
  undo each other.
- :func:`im2col_narrow_convs` / :func:`Im2colNarrowConvs` (``im2col``): NHWC convs of fewer than 16 input
  channels as an im2col kernel and a GEMM.
- :func:`pointwise_convs_as_gemms` / :func:`PointwiseConvsAsGemms` (``pointwise_convs``): 1x1 NHWC convs that no
  conv template takes (fp32, or a few output pixels) as GEMMs.
- :func:`pad_output_channels` / :func:`PadOutputChannels` (``pad_channels``): GEMMs and convs whose output
  channels no vector divides run on a zero-padded weight, the extra channels sliced off (CPUs).
- :func:`int8_gemms` / :func:`Int8Gemms` (``int8_gemm``): quantized GEMMs (MatMulInteger) on their uint8 / int8
  operands, the zero point's share subtracted after, where the CPU has a VNNI dot product.
- :func:`redundant_requantize` / :func:`RedundantRequantize` (``qdq``): a quantize / dequantize pair whose input is
  on its grid already (a reshape or concatenation of quantized values) dropped; exact.
- :func:`int8_convs` / :func:`Int8Convs`, then :func:`int8_convs_as_gemms` / :func:`Int8ConvsAsGemms`
  (``int8_conv``): QDQ convs as exact integer convs, then (NHWC) uint8 im2col rows by int8 filters, VNNI GEMMs.
- :class:`FuseAttention` (``fuse_attention``): MatMul(Q, Kᵀ) -> scale -> (mask) -> Softmax -> MatMul(·, V)
  becomes one call to an online-softmax kernel (:mod:`tvmfuse.plan.attention`) that never writes the N×N scores;
  a constant causal mask becomes the spec's ``causal`` flag and K/V heads repeated for GQA are read in place
  (``attention_inputs``).
- :class:`GatedGemm` (``gated_gemm``): ``act(x @ Wg) * (x @ Wu)`` (SwiGLU, GeGLU) as one MatMul on the two
  weights' columns interleaved, whose epilogue gates each accumulator pair (GPUs, where the GEMM template takes it).
- :class:`SplitGemm` (``split_gemm``): a GEMM whose output is split along its columns (a fused QKV projection) as
  one GEMM a part on the weight's column blocks, so each part's reshape and transpose fuse into its GEMM's store.
- :class:`HorizontalGemm` (``horizontal_gemm``): MatMuls reading the same input with constant weights become
  one MatMul on concatenated weights plus slices, when the cost model finds it saves bytes.

Shared helpers (reading ``main``'s dataflow block, re-emitting it) are in ``_common``.
"""
from __future__ import annotations

from tvmfuse.plan.rewrites._common import module_pass, rebuild_main
from tvmfuse.plan.rewrites.channels_last import ChannelsLast, channels_last
from tvmfuse.plan.rewrites.compose_transposes import ComposeTransposes, compose_transposes
from tvmfuse.plan.rewrites.dead_taps import TrimDeadTaps, trim_dead_taps
from tvmfuse.plan.rewrites.fold_batchnorm import FoldBatchNorm
from tvmfuse.plan.rewrites.fuse_attention import FuseAttention
from tvmfuse.plan.rewrites.int8_conv import Int8Convs, Int8ConvsAsGemms, int8_convs, int8_convs_as_gemms
from tvmfuse.plan.rewrites.gated_gemm import GatedGemm
from tvmfuse.plan.rewrites.int8_gemm import Int8Gemms, int8_gemms
from tvmfuse.plan.rewrites.horizontal_gemm import HorizontalGemm
from tvmfuse.plan.rewrites.identities import DropInferenceIdentities, drop_inference_identities
from tvmfuse.plan.rewrites.im2col import Im2colNarrowConvs, im2col_narrow_convs
from tvmfuse.plan.rewrites.pad_channels import PadOutputChannels, pad_output_channels
from tvmfuse.plan.rewrites.pairwise_extrema import PairwiseExtrema, pairwise_extrema
from tvmfuse.plan.rewrites.pointwise_convs import PointwiseConvsAsGemms, pointwise_convs_as_gemms
from tvmfuse.plan.rewrites.qdq import RedundantRequantize, redundant_requantize
from tvmfuse.plan.rewrites.split_gemm import SplitGemm

__all__ = [
    "ChannelsLast", "ComposeTransposes", "DropInferenceIdentities", "FoldBatchNorm", "FuseAttention",
    "GatedGemm", "HorizontalGemm", "Im2colNarrowConvs", "channels_last", "compose_transposes",
    "drop_inference_identities",
    "im2col_narrow_convs", "module_pass", "PadOutputChannels", "pad_output_channels", "PairwiseExtrema",
    "pairwise_extrema", "PointwiseConvsAsGemms", "pointwise_convs_as_gemms", "rebuild_main", "TrimDeadTaps",
    "trim_dead_taps", "Int8Gemms", "int8_gemms", "Int8Convs", "int8_convs", "Int8ConvsAsGemms", "int8_convs_as_gemms",
    "RedundantRequantize", "redundant_requantize", "SplitGemm",
]
