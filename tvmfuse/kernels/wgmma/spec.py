"""What the wgmma template reads off a planner kernel: a GEMM's shape and operand layouts, and an NHWC conv
read as an implicit GEMM."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ConvGeometry:
    """An NHWC conv read as an implicit GEMM: input ``[n, h, w, c]``, filter ``[f, r, s, c]`` (OHWI), output
    ``[n, oh, ow, f]``. GEMM row ``(n, oh, ow)``, column ``f``, K ``(r, s, c)`` in the filter's order, so the
    filter is a K-major B as stored; A's element ``(row, k)`` is the input at ``(n, oh * stride - pad + r *
    dilation, ...)``, zero outside it. ``c`` is a multiple of the K step (64): each K step has one ``(r, s)``
    and reads 64 contiguous channels of a pixel, whole 16-byte copies."""

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
    """

    batch: tuple[int, ...]
    m: int
    n: int
    k: int
    a_batched: bool
    b_batched: bool
    b_kmajor: bool
    conv: ConvGeometry | None = None   # A is a conv's input read as im2col rows (implicit GEMM)

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
