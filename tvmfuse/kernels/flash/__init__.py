"""A flash-attention TIR template on tensor cores: the planner's attention group without N×N scores.

The planner's attention PrimFunc (``tvmfuse.plan.attention``) is correct everywhere but scalar: one
query row per thread. On CUDA targets with fp16 inputs this package writes the same computation as a
FlashAttention-2 style kernel, with its tiles as parameters (:class:`FlashConfig`):

* a thread block owns ``16 * m_tiles * warps`` query rows of one (batch, head); each warp owns
  ``16 * m_tiles`` of them. With one 16-row tile per warp its Q fragments are loaded once into registers;
  with two, the block's Q tile is staged in shared memory and reloaded by ``ldmatrix`` at each step, and
  every K and V fragment feeds both tiles (half the shared-memory reads per ``mma``);
* the keys are walked ``block_n`` at a time: the K and V tiles go through shared memory (rows padded
  by 16 bytes, so every ``ldmatrix`` phase hits 32 distinct banks), optionally double-buffered by
  ``cp.async`` so the next tile's copy overlaps this tile's tensor-core work;
* ``S = Q·Kᵀ`` runs as ``mma.sync.m16n8k16`` (fp16 in, fp32 accumulate) into registers; the online
  softmax (running row max and sum, base-2 exponent) works on those registers, with two lane shuffles
  for the row max; ``P`` is converted to fp16 in place, and since an m16n8 accumulator has the layout of
  the A operand's half, it feeds ``O += P·V`` without leaving registers;
* ``O`` stays in registers, is rescaled per row as the max moves, and is divided by the row sum once,
  at the store.

On Hopper (``sm_90a``) a config may instead be a wgmma kernel (``FlashConfig.wgmma``, names ending ``" h"``):
each warpgroup computes ``S`` for 64 query rows with ``wgmma`` from 128-byte-swizzled Q and K tiles, and
feeds ``P`` from its registers to the ``O += P·V`` wgmma; the softmax and the store are the same code. Its
warp-specialized form (``FlashConfig.tma``, :mod:`tvmfuse.kernels.flash.tma`) loads the tiles by TMA from a producer
warpgroup, FlashAttention-3's structure.

Causal attention (``AttentionSpec.causal``): query tile ``bx`` walks the key steps up to its diagonal only
(:func:`tvmfuse.kernels.flash.softmax.key_steps`), its scores past the diagonal set to -inf before the running
max, and the tiles launch heaviest first (``blockIdx.y`` reversed). GQA (``kv_group``): K and V are read at head
``h // kv_group``, never repeated.

The scores exist only as one warp's ``16 * m_tiles`` x ``block_n`` registers at a time. The Hopper kernels take whole
tiles of rows and keys; the ``mma.sync`` ones any sequence lengths: a ragged last query tile reads zeros and stores
only its rows, a ragged last key step holds zeros past the end and scores them -inf, and Kᵀ of an odd key count is
copied in narrower vectors (:func:`tvmfuse.kernels.flash.softmax.kt_vector`).

fp32 attention, which no tensor-core kernel computes to fp32's precision, runs a CUDA-core flash kernel instead
(:mod:`tvmfuse.kernels.flash.simt`), or under ``--precision tf32`` this kernel with 32-bit operands
(:mod:`tvmfuse.kernels.flash.tf32`); the planner keeps attention none fits unfused on GPUs. Tuning picks a config
among :func:`configs` (MetaSchedule samples its index; the builder expands it, see :func:`expand`).

The package: ``config`` (the tile configs, which fit, the default), ``softmax`` (what every flash kernel shares),
``source`` (the kernel for a config, the swap for a tuned sketch), ``tf32`` (the TF32 kernel), ``wgmma_tiles`` (the
Hopper kernels' tiles and their overlapped variant) and ``sketch`` (the attention class's MetaSchedule sketch).
"""
from __future__ import annotations

import math

from tvmfuse.kernels.base import KernelTemplate
from tvmfuse.kernels.flash.config import (ANNOTATION, CANDIDATES, FlashConfig, all_configs, annotated_config, config_at,
                                          configs, default_config, parse_config, spec_of)
from tvmfuse.kernels.flash.simt import SimtConfig
from tvmfuse.kernels.flash.sketch import template_attention
from tvmfuse.kernels.flash.source import expand, flash_kernel, flash_primfunc, flash_source

__all__ = ["ANNOTATION", "CANDIDATES", "FlashConfig", "FlashTemplate", "SimtConfig", "all_configs",
           "annotated_config", "config_at", "configs", "default_config", "expand", "flash_kernel", "flash_primfunc",
           "flash_source", "parse_config", "spec_of", "template_attention"]


def _wgmma(target) -> bool:
    from tvmfuse.kernels.wgmma.config import supports

    return supports(target)


def _sm_count(target) -> int:
    from tvmfuse.target import device_figures

    return device_figures(target).sm_count


class FlashTemplate(KernelTemplate):
    """FlashAttention-2 on tensor cores for the planner's attention kernels, written whole from a tile config; the
    attention class's sketch (the planner's scalar schedule) samples its configs on CUDA."""

    name = "flash"
    targets = ("cuda",)
    kernel_classes = ("attention",)
    sketch_name = "attention"
    searched_in = "attention"
    candidates_key, index_key = CANDIDATES, ANNOTATION
    config_field = "flash_config"
    config_words = ("the flash template with tiles {config} (warps, 16-row query tiles per warp, keys per step, K/V "
                    "stages; h: Hopper's wgmma, hp: overlapped, ht: warp-specialized by TMA, htp: and ping-pong, "
                    "hto: and the softmax beside P·V; or on CUDA cores: threads, rows a thread, lanes a row, keys "
                    "per step)")
    knobs = ("threads", "unroll", *(f"flash_{k}" for k in ("warps", "m_tiles", "block_n", "stages", "wgmma",
                                                           "overlap", "tma")),
             *(f"flash_simt_{k}" for k in ("threads", "rows", "lanes", "block_n")))

    def fits(self, func, target) -> str | None:
        from tvmfuse.plan.attention import gpu_misfit

        if target.kind.name not in self.targets:
            return super().fits(func, target)
        # the planner forms attention on CUDA only where a flash kernel fits; a module planned elsewhere may not
        spec = spec_of(func)
        return "not the planner's attention kernel" if spec is None else gpu_misfit(spec)

    def configs(self, func, target, space=None) -> list:
        if self.fits(func, target) is not None:
            return []
        return all_configs(spec_of(func), wgmma=_wgmma(target))

    def default_config(self, func, target):
        if self.fits(func, target) is not None:
            return None
        return default_config(spec_of(func), wgmma=_wgmma(target), sm_count=_sm_count(target))

    def default_kernel(self, func, target, space=None):
        if self.fits(func, target) is not None:
            return None
        return flash_kernel(func, wgmma=_wgmma(target), sm_count=_sm_count(target))

    def config_of(self, func) -> str | None:
        cfg = annotated_config(func)
        return None if cfg is None else cfg.name

    def config_figures(self, func, name: str) -> dict | None:
        spec = spec_of(func)
        if spec is None:
            return None
        cfg = parse_config(name)
        if spec.tf32 and isinstance(cfg, FlashConfig):
            from tvmfuse.kernels.flash.tf32 import shared_bytes
            shared = shared_bytes(spec, cfg)
        else:
            shared = cfg.shared_bytes(spec)
        q_tiles, k_tiles = -(-spec.seq_q // cfg.block_m), -(-spec.seq_k // cfg.block_n)
        keys = spec.seq_k if not spec.causal else (spec.seq_k + 1) / 2   # a causal row reads half the keys
        return {"blocks": math.prod(spec.batch) * q_tiles, "threads": cfg.threads, "shared_bytes": shared,
                "padding": q_tiles * cfg.block_m * k_tiles * cfg.block_n / (spec.seq_q * spec.seq_k) - 1.0,
                "work": cfg.block_m * keys * (spec.head_dim + spec.head_dim_v)}

    def schedule(self, sch, space, info: dict) -> list:
        return template_attention(sch, space, info)

    def expand(self, mod):
        return expand(mod)
