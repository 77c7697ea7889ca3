"""Profitability: is a legal fusion worth taking? A replaceable cost model returning a comparable score.

The default model weighs HBM bytes saved (from shapes and dtypes), kernel launches saved (as bytes the
target could have moved in a launch's time), a register / shared-memory pressure estimate (a hard limit)
and the parallelism the fused kernel leaves against the target's SMs or cores.
Subclass :class:`CostModel` (or pass any object with ``score``) to change the taste, not the legality.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tvmfuse.plan.cluster import bytes_fused, external_inputs
from tvmfuse.plan.graph import CONV, GEMM, INJECTIVE_K, NORM, REDUCE, Graph, Node, tensor_shape
from tvmfuse.target import TargetInfo, has_vnni, vector_lanes


def _gpu_attention_decline(spec) -> str | None:
    from tvmfuse.plan.attention import gpu_misfit

    why = gpu_misfit(spec)
    return None if why is None else (f"{why}; without a flash kernel the fused kernel is scalar, "
                                     f"60x slower than the unfused tensor-core GEMMs on the H200")


def gpu_tf32_attention_decline(spec) -> str | None:
    """(``--precision tf32``) as :func:`_gpu_attention_decline`, for fp32 attention the TF32 flash kernel computes
    (:mod:`tvmfuse.kernels.flash.tf32`; the planner marks it so after partitioning, ``tvmfuse.plan.tf32``)."""
    from dataclasses import replace

    return _gpu_attention_decline(replace(spec, tf32=True) if spec.dtype == "float32" else spec)


def gpu_x3_attention_decline(spec) -> str | None:
    """(an fp32 build on Hopper) as :func:`gpu_tf32_attention_decline`, for the TF32 flash kernel in three products
    (``AttentionSpec.x3``: fp32's accuracy), or the CUDA-core kernel where that does not fit."""
    from dataclasses import replace

    return _gpu_attention_decline(replace(spec, tf32=True, x3=True) if spec.dtype == "float32" else spec)


def _reorders(n: Node) -> bool:
    """A transpose that moves elements: its non-unit axes come out in another order (a pooled 1 x 1 x C back to
    C is a reshape in effect; a square transpose reads as none, and is let through)."""
    src = tensor_shape(n.inputs[0].ty) if n.kind == INJECTIVE_K and "transpose" in n.op and n.inputs else None
    if src is None or n.out_shape is None:
        return False
    return [d for d in src if d != 1] != [d for d in n.out_shape if d != 1]


@dataclass(frozen=True, order=True)
class Score:
    """Comparable: a feasible fusion beats an infeasible one, then the larger ``gain`` wins.

    ``gain`` is in bytes: HBM bytes saved plus launches saved x ``launch_bytes``, scaled down when the
    fused kernel leaves fewer parallel units than the target needs.
    """

    feasible: bool
    gain: float
    bytes_saved: int = 0
    launches_saved: int = 0
    pressure: int = 0
    parallel_units: int = 0
    reason: str = ""

    @property
    def profitable(self) -> bool:
        return self.feasible and self.gain > 0


@dataclass(frozen=True)
class CostModel:
    """The default cost model.

    Attributes
    ----------
    launch_bytes : bytes the device moves in one kernel launch's overhead (~5 µs x HBM bandwidth on a GPU)
    max_live_tensors : pressure limit: distinct tensors one fused kernel may stream (registers / address
        registers per thread)
    max_ops : pressure limit: operators one fused kernel may hold
    shared_memory_bytes : for a normalization with a prologue, one row of every full-size input is staged
        on chip; it must fit
    min_parallel_units : parallel units (rows, output tiles) the target needs to be busy
    attention_decline : why the fused attention kernel is not formed on this target (None: it is), or a
        function of its :class:`~tvmfuse.plan.attention.AttentionSpec` giving the reason
    conv_layout : "NHWC" to run 2-D convolutions channels-last (the tensor-core template's implicit GEMM then
        reads its operands contiguously along K), or None to keep the model's layout
    conv_kernel_layout : the filters' layout in a channels-last conv: OHWI (GPUs: K contiguous for the implicit
        GEMM) or HWIO (CPUs: output channels contiguous, the axis the CPU default vectorises)
    depthwise_kernel_layout : HWIO: depthwise convs' filters stored so (GPUs, whose OHWI is for the tensor-core
        template, which takes no grouped conv: adjacent threads read adjacent weights); None: as the rest
    conv1d_kernel_layout : with ``conv_layout`` set, 1-D convolutions run NWC with filters in this layout (WIO on
        CPUs; OWI on GPUs, where the wgmma conv template reads an NWC conv as an NHWC one of height 1: Whisper's
        stem had run dlight's CUDA-core matmul rule, in fp32 and fp16); None keeps them as the model has them
    im2col_k : channels-last convs with fewer than 16 input channels (a stem's 3) run as an im2col kernel and a
        GEMM where their K, padded to 64, is at most this; 0: never
    narrow_conv_pad : with ``im2col_k`` set, a narrow conv of these input types keeps its conv on its channels
        zero-padded to whole 16-byte copies instead (the conv template's K steps span taps), no im2col rows (fp16
        on sm_90a, the wgmma conv template's; a TF32 conv of 4 channels has not run on a GPU: fp32 keeps im2col)
    im2col_pixels : with ``im2col_k`` set, convs of at most this many output pixels (any channels, type and K) run
        as im2col + GEMM too: a GEMM of that few rows is the gemv template's
    im2col_untemplated_pixels : the same for convs of a type no conv template takes (fp32), up to this many pixels
        (the gemv template takes small fp32 GEMMs of up to 256 rows)
    tensor_core_dtypes : the input types the tensor-core GEMM and conv templates take (fp16; fp32 too under
        ``--precision tf32``): a narrow conv (a stem) of these runs as im2col rows and a tensor-core GEMM
    gemm_conv_rows : 1x1 channels-last convs run as GEMMs where they have at most this many output pixels, or
        inputs of a type the tensor-core conv template does not take (fp32); 0: never
    pad_channels_to : GEMMs and channels-last convs with a constant weight whose output channels this many lanes
        do not divide run on the weight zero-padded to a multiple of them (the CPU's vector width); 0: never
    broadcast_anchor_results : a GEMM's or conv's small result (a squeeze-excitation scale, ``[n, 1, 1, c]``) may be
        broadcast in its kernel's epilogue over a larger tensor (``x * sigmoid(se)``), the kernel then computing the
        GEMM's dot products again for each output element. GPUs: no (EfficientNet-B0's excitation over a 112 x 112
        map took 316 us so on an H100, where its 51 MB would take about 17 at copy speed): the scale is stored and a
        pointwise kernel applies it
    gated_gemm_rows : ``act(x @ Wg) * (x @ Wu)`` of at least this many rows of ``x`` runs as one GEMM on the
        weights' columns interleaved, gating its accumulator pairs (``rewrites.gated_gemm``); 0: never. Hopper's
        wgmma template takes that epilogue; at 64 rows or fewer (decode, the GEMV template's range) the two GEMMs
        stay apart
    reduction_results : the most results a kernel holding a reduction may store (0: no limit). The GPU's row
        templates and the CPU default's row rules store one; a second (an embedding's sum kept as the residual
        beside its RMSNorm) left the kernel to dlight's Fallback, one thread an output, or on the CPU to TVM's
        plain lowering
    int8_dot : the target multiplies uint8 by int8 vectors into int32 sums (x86 VNNI): quantized GEMMs are rewritten
        to read their 8-bit operands (``rewrites.int8_gemm``)
    rows_keep_order : a kernel holding a normalization or reduction takes no transpose (CPUs: the CPU default's
        row rules read and write rows along the output's innermost axis; a LayerNorm or GroupNorm whose result is
        transposed for a channels-last conv or a window partition, Swin's and wav2vec2's, kept TVM's plain
        lowering: 4.8 ms of wav2vec2-base's 43, where the norm alone and the transpose alone take 0.3 ms)
    """

    launch_bytes: int = 1 << 20
    max_live_tensors: int = 24
    max_ops: int = 48
    shared_memory_bytes: int = 48 * 1024
    min_parallel_units: int = 132
    attention_decline: object = None   # a reason (str), or a function of the AttentionSpec giving one
    conv_layout: str | None = None
    conv_kernel_layout: str = "OHWI"
    depthwise_kernel_layout: str | None = None
    conv1d_kernel_layout: str | None = None
    im2col_k: int = 0
    im2col_pixels: int = 0
    narrow_conv_pad: tuple[str, ...] = ()
    im2col_untemplated_pixels: int = 0
    tensor_core_dtypes: tuple = ("float16",)
    gemm_conv_rows: int = 0
    pad_channels_to: int = 0
    broadcast_anchor_results: bool = True
    gated_gemm_rows: int = 0
    reduction_results: int = 0
    rows_keep_order: bool = False
    int8_dot: bool = False

    @classmethod
    def for_target(cls, target: TargetInfo, **overrides) -> "CostModel":
        attrs = target.target.attrs if hasattr(target.target, "attrs") else {}
        if target.is_gpu:
            smem = int(attrs.get("max_shared_memory_per_block", 48 * 1024)) if attrs else 48 * 1024
            # Measured on the H200 (BENCHMARKS.md), B4 H32 S4096 D128: the tensor-core flash
            # template 3.6-5.2 ms; the unfused ops (tensor-core GEMMs, N x N scores through HBM) 19 ms; the
            # scalar fused kernel (one query row per thread) 1209 ms. So attention is fused on GPUs exactly
            # where the flash template fits its shape.
            from tvmfuse.target import device_figures

            # a wave of blocks over the target GPU's SMs (tvmfuse.target.device_figures)
            base = cls(launch_bytes=5e-6 * 4e12, shared_memory_bytes=smem,
                       min_parallel_units=device_figures(target).sm_count,
                       attention_decline=_gpu_attention_decline,
                       # NCHW made the implicit GEMM's input reads gathers: 3.6 ms vs torch.compile's 0.4 ms (NHWC)
                       conv_layout="NHWC", conv1d_kernel_layout="OWI", im2col_k=512, im2col_pixels=16,
                       # (the padded conv is for the wgmma conv template: sm_90a only)
                       narrow_conv_pad=("float16",) if str(attrs.get("arch", "")) == "sm_90a" else (),
                       im2col_untemplated_pixels=256, gemm_conv_rows=64, reduction_results=1,
                       broadcast_anchor_results=False, depthwise_kernel_layout="HWIO",
                       gated_gemm_rows=65 if str(attrs.get("arch", "")) == "sm_90a" else 0)
        else:
            cores = int(attrs.get("num-cores", 2)) if attrs else 2
            # channels-last with HWIO filters: the CPU default (tvmfuse/kernels/cpu) vectorises a conv along its
            # output channels, contiguous in both the output and the filter; NCHW left it the image's width
            # (7 or 4 pixels in a MobileNet's last stages) to vectorise
            # attention unfused: its GEMMs and softmax take the CPU default; the fused online-softmax kernel has no
            # CPU schedule and ran scalar (BERT-style 2x128, hidden 256: 14 ms a layer against 2 ms unfused)
            # a row kernel storing two results (LLaMA's embedding kept as the residual beside its RMSNorm) is
            # none the CPU default's row rules read: it ran TVM's plain lowering, scalar and on one thread
            # (417 us at 128 x 2048); split, each part takes a default
            base = cls(launch_bytes=64 * 1024, shared_memory_bytes=1 << 20, min_parallel_units=max(cores, 1),
                       reduction_results=1, rows_keep_order=True, int8_dot=has_vnni(target.target),
                       conv_layout="NHWC", conv_kernel_layout="HWIO", conv1d_kernel_layout="WIO",
                       pad_channels_to=vector_lanes(target.target),
                       attention_decline="on CPUs the unfused GEMMs and softmax run the CPU default schedules, "
                                         "the fused attention kernel has none")
        return base if not overrides else cls(**{**base.__dict__, **overrides})

    # -- estimates -------------------------------------------------------------------------------------
    def pressure(self, members: list[Node]) -> int:
        """Distinct tensors the fused kernel streams (inputs read plus the one it writes)."""
        return len(external_inputs(members)) + 1

    def row_bytes(self, members: list[Node]) -> int:
        """On-chip bytes a normalization with a prologue stages per row (one row of each full-size input)."""
        norms = [n for n in members if n.kind in (NORM, REDUCE)]
        if not norms or len(members) == len(norms):
            return 0
        anchor = norms[0]
        shape = anchor.inputs[0].ty.shape if anchor.inputs else None
        try:
            row = int(shape.values[-1]) * np.dtype(str(anchor.inputs[0].ty.dtype)).itemsize
        except (AttributeError, TypeError):
            return 0
        full = [v for v in external_inputs(members)
                if hasattr(v.ty, "shape") and v.ty.shape is not None and len(v.ty.shape.values) == len(shape.values)]
        return row * max(1, len(full))

    def parallel_units(self, members: list[Node]) -> int:
        """Independent work units: rows of a normalization, else output elements / 1024."""
        out = max(members, key=lambda n: n.index)
        numel = int(np.prod(out.out_shape)) if out.out_shape else 1
        if any(n.kind in (NORM, REDUCE) for n in members) and out.out_shape:
            return max(1, numel // max(1, out.out_shape[-1]))
        return max(1, numel // 1024)

    # -- the decision ----------------------------------------------------------------------------------
    def score(self, graph: Graph, a: list[Node], b: list[Node]) -> Score:
        """Score fusing the kernels ``a`` and ``b`` into one."""
        merged = a + b
        saved = bytes_fused(graph, a) + bytes_fused(graph, b) - bytes_fused(graph, merged)
        pressure = self.pressure(merged)
        units = self.parallel_units(merged)
        if pressure > self.max_live_tensors:
            return Score(False, 0.0, saved, 1, pressure, units,
                         f"pressure: {pressure} live tensors > limit {self.max_live_tensors}")
        if len(merged) > self.max_ops:
            return Score(False, 0.0, saved, 1, pressure, units, f"pressure: {len(merged)} ops > limit {self.max_ops}")
        if self.rows_keep_order and any(n.kind in (NORM, REDUCE) for n in merged) \
                and any(_reorders(n) for n in merged):
            return Score(False, 0.0, saved, 1, pressure, units,
                         "a normalization's rows and a transpose: the row rules keep the rows' order")
        if not self.broadcast_anchor_results:
            anchor = next((n for n in merged if n.kind in (GEMM, CONV) and n.out_shape), None)
            widest = max((n for n in merged if n.out_shape), key=lambda n: int(np.prod(n.out_shape)), default=None)
            if anchor is not None and widest is not None and np.prod(widest.out_shape) > np.prod(anchor.out_shape):
                return Score(False, 0.0, saved, 1, pressure, units,
                             f"{widest.op} broadcasts {anchor.op}'s result {anchor.out_shape} to {widest.out_shape}: "
                             f"the kernel would compute its dot products again for each output")
        smem = self.row_bytes(merged)
        if smem > self.shared_memory_bytes:
            return Score(False, 0.0, saved, 1, pressure, units,
                         f"shared memory: a row needs {smem} B on chip > {self.shared_memory_bytes} B")
        gain = float(saved + self.launch_bytes)
        before = min(self.parallel_units(a), self.parallel_units(b))
        if units < self.min_parallel_units and units < before:
            gain *= units / min(before, self.min_parallel_units)
        reason = "" if gain > 0 else f"no gain: {saved} B saved"
        return Score(True, gain, saved, 1, pressure, units, reason)

    def score_horizontal(self, *, shared_input_bytes: int, branches: int, extra_bytes: int,
                         extra_launches: int) -> Score:
        """Score merging ``branches`` GEMMs that read one input into one GEMM on concatenated weights.

        Saves ``branches - 1`` reads of the input and launches; costs ``extra_bytes`` (branch results that
        were an epilogue of their GEMM and now go through memory to a slice) and ``extra_launches``.
        """
        saved = (branches - 1) * shared_input_bytes - extra_bytes
        launches = branches - 1 - extra_launches
        gain = float(saved + launches * self.launch_bytes)
        reason = "" if gain > 0 else (f"no gain: reads {branches - 1}x{shared_input_bytes} B less, but the split "
                                      f"costs {extra_bytes} B and {extra_launches} more launches")
        return Score(True, gain, saved, launches, 0, 0, reason)
