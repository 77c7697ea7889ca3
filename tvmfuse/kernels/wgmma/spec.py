"""What the wgmma template reads off a planner kernel: a GEMM's shape and operand layouts, and an NHWC conv
read as an implicit GEMM."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class ConvGeometry:
    """An NHWC conv read as an implicit GEMM: input ``[n, h, w, c]``, filter ``[f, r, s, c]`` (OHWI), output
    ``[n, oh, ow, f]``. GEMM row ``(n, oh, ow)``, column ``f``, K ``(r, s, c)`` in the filter's order, so the
    filter is a K-major B as stored; A's element ``(row, k)`` is the input at ``(n, oh * stride - pad + r *
    dilation, ...)``, zero outside it. ``c`` is a multiple of 8 (16 bytes): each 16-byte copy reads channels of
    one pixel at one tap; where ``c`` is a multiple of the K step (64), each K step has one ``(r, s)`` and reads 64
    contiguous channels of a pixel (TMA's box), else a K step spans taps (24 channels: 2.67 taps a step)."""

    n: int
    h: int
    w: int
    c: int
    oh: int
    ow: int
    r: int
    s: int
    stride: tuple[int, int]
    pad: tuple[int, int]        # top, left (bottom / right padding: reads past the input, zero like the rest)
    dilation: tuple[int, int]

    @property
    def padded(self) -> bool:
        """Whether some window reads outside the input (needs the zero fill)."""
        (sh, sw), (pt, pl), (dh, dw) = self.stride, self.pad, self.dilation
        return (pt > 0 or pl > 0 or (self.oh - 1) * sh + (self.r - 1) * dh - pt >= self.h
                or (self.ow - 1) * sw + (self.s - 1) * dw - pl >= self.w)


@dataclass(frozen=True)
class GemmSpec:
    """What the template needs of a planner GEMM kernel: ``out[b, i, j] = epilogue(sum_k A[b?, i, k] B[b?, .])``.

    ``batch``: the output's leading dims; A may carry them or not (``a_batched``), B likewise. With B shared by
    the batch and A batched, the batch folds into the rows (``rows = prod(batch) * m``).
    ``b_kmajor``: B stored ``[.., N, K]`` (weights of a Linear, transB); else ``[.., K, N]``.
    ``dtype``: the operands' type: ``float16``, or ``float32`` read by the tensor cores as TF32 (a kernel the
    planner marked ``tvmfuse.tf32``; K-major operands only); ``tf32``: a ``float32`` spec counted in 16-bit units
    (:meth:`halves`), the kernel generator's view of it. ``float32x3`` (``tf32x3`` halved): fp32 operands each
    split into two TF32 parts, ``big + small``, and the products of three wgmmas summed (``a.B + A.b + A.B``,
    the error of the dropped ``a.b`` under fp32's rounding): fp32 accuracy on the tensor cores (a kernel the
    planner marked ``tvmfuse.fp32x3``).
    """

    batch: tuple[int, ...]
    m: int
    n: int
    k: int
    a_batched: bool
    b_batched: bool
    b_kmajor: bool
    conv: ConvGeometry | None = None   # A is a conv's input read as im2col rows (implicit GEMM)
    dtype: str = "float16"

    def halves(self) -> "GemmSpec":
        """The spec in 16-bit units, the unit the kernel generator counts K, addresses and shared tiles in: an fp32
        ``[rows, K]`` operand is, byte for byte, an fp16 ``[rows, 2K]`` one, so a TF32 kernel's copies, tile
        layouts, descriptors and TMA boxes are the fp16 kernel's at twice the K (and a conv's channels); only the
        wgmma instruction differs (K 8 in TF32 per 32 bytes, against K 16 in fp16)."""
        if self.dtype not in ("float32", "float32x3"):
            return self
        conv = None if self.conv is None else replace(self.conv, c=2 * self.conv.c)
        return replace(self, k=2 * self.k, conv=conv, dtype="tf32x3" if self.x3 else "tf32")

    @property
    def x3(self) -> bool:
        """Whether the kernel sums three TF32 products a K step for fp32's accuracy (``float32x3``)."""
        return self.dtype in ("float32x3", "tf32x3")

    @property
    def tf32(self) -> bool:
        """Whether the (halved) kernel's wgmmas read TF32 operands: ``tf32`` or ``tf32x3``."""
        return self.dtype in ("tf32", "tf32x3")

    @property
    def fold_batch(self) -> bool:
        return self.a_batched and not self.b_batched

    @property
    def rows(self) -> int:
        return self.m * math.prod(self.batch) if self.fold_batch else self.m

    @property
    def grid_batch(self) -> int:
        return 1 if self.fold_batch else math.prod(self.batch)

    @property
    def a_elements(self) -> int:
        """A's size in elements (a conv's: its input's)."""
        if self.conv is not None:
            g = self.conv
            return g.n * g.h * g.w * g.c
        return (self.grid_batch * self.m if self.a_batched else self.rows) * self.k

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "batch": list(self.batch)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "GemmSpec":
        d = json.loads(text)
        conv = d.get("conv")
        if conv is not None:
            conv = ConvGeometry(**{k: tuple(v) if isinstance(v, list) else v for k, v in conv.items()})
        return cls(**{**d, "batch": tuple(d["batch"]), "conv": conv})
