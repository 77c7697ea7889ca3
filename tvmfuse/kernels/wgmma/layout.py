"""Where a wgmma kernel's data lives: the shared tiles' layouts and their matrix descriptors, the tile a block
computes, and A's element addresses (a conv's window, the rows past the last whole tile)."""
from __future__ import annotations

from tvmfuse.kernels.wgmma.config import WgmmaConfig, pixel_tile, tiles_m, tiles_n
from tvmfuse.kernels.wgmma.spec import GemmSpec


def desc(buf: str, offset: str, lbo: int, sbo: int, swizzle: int) -> str:
    """A wgmma shared-memory matrix descriptor for ``buf[offset]``: the start address, the leading and stride
    byte offsets (16-byte units; their meaning depends on the layout, see the PTX ISA's "Shared Memory Matrix
    Layout") and the swizzle mode (bits 62-63: 0 none, 1 128-byte)."""
    addr = (f"T.Cast('uint64', T.call_extern('uint32', '__cvta_generic_to_shared', "
            f"T.address_of({buf}[{offset}])))")
    const = ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | ((1 if swizzle == 128 else 0) << 62)
    return f"(((({addr}) & T.uint64(0x3FFFF)) >> T.uint64(4)) | T.uint64({const}))"


def tile_layout(swizzle: int, kmajor: bool, outer: int, kext: int):
    """How a ``[outer, kext]`` (K-major) or ``[kext, outer]`` (MN-major) fp16 tile sits in shared memory for wgmma.

    Returns ``(chunk, desc)``: ``chunk(c)`` -> (outer index, k index, element offset) expressions for the
    tile's 16-byte chunk ``c`` (consecutive chunks: consecutive 16 bytes of one global row, so a warp's
    copies are coalesced, and eight consecutive threads fill one 128-byte line of shared memory: no bank
    conflicts); ``desc(kk)`` -> (element offset of K slice ``kk`` (16 deep), LBO, SBO) for the descriptor.
    With the 128-byte swizzle the K-major extent, or the MN-major ``outer``, must be a multiple of 64.
    """
    if swizzle == 128:   # 8-row x 128-byte atoms, each 16-byte chunk XOR-ed with its row within the atom
        if kmajor:       # K in blocks of 64 (one 128-byte atom row), each block [outer, 64]; atoms 1024 B apart
            nkb = kext // 64

            def chunk(c):
                r, kc = f"({c} // {8 * nkb})", f"({c} % 8)"
                kb = f"({c} // 8 % {nkb})"
                return (r, f"{kb} * 64 + {kc} * 8" if nkb > 1 else f"{kc} * 8",
                        (f"{kb} * {outer * 64} + " if nkb > 1 else "") + f"{r} * 64 + T.bitwise_xor({kc}, {r} % 8) * 8")
            return chunk, lambda kk: (kk // 4 * outer * 64 + kk % 4 * 16, 16, 1024)
        # MN-major: row = k, 64 MN values per atom row; atoms along K 1024 bytes apart, 64-wide MN blocks
        # kext * 128 bytes apart
        per_row = outer // 8

        def chunk(c):
            k, nc = f"({c} // {per_row})", f"({c} % {per_row})"
            off = f"{nc} // 8 * {kext * 64} + {k} * 64 + T.bitwise_xor({nc} % 8, {k} % 8) * 8"
            return f"{nc} * 8", k, off
        return chunk, lambda kk: (kk * 2 * 512, kext * 128, 1024)
    # no swizzle: 8 x 16-byte core matrices of 128 contiguous bytes, chunk c at element c * 8
    if kmajor:   # c = (row // 8) * K + (k // 8) * 8 + row % 8; core matrices along K 128 B apart, along M K*16
        def chunk(c):
            return f"({c} // {kext} * 8 + {c} % 8)", f"({c} // 8 % {kext // 8} * 8)", f"{c} * 8"
        return chunk, lambda kk: (kk * 128, 128, kext * 16)

    def chunk(c):   # c = (k // 8) * outer + (n // 8) * 8 + k % 8; along K outer * 16 B apart, along N 128 B
        return f"({c} // 8 % {outer // 8} * 8)", f"({c} // {outer} * 8 + {c} % 8)", f"{c} * 8"
    return chunk, lambda kk: (kk * 2 * outer * 8, outer * 16, 128)


def _batch_offsets(spec: GemmSpec) -> tuple[str, str]:
    """Flat element offsets of batch ``bz`` in A and in B (0 where not batched, or where the batch folds into
    the rows)."""
    return (f"bz * {spec.m * spec.k}" if spec.a_batched and not spec.fold_batch else "0",
            f"bz * {spec.n * spec.k}" if spec.b_batched else "0")


def _a_read(spec: GemmSpec, row: str, kbase: str, kin: str, tail: bool,
            k_inside: str | None = None) -> tuple[str | None, str]:
    """A's element (``row``, ``kbase + kin``) as (a predicate, None where it always holds; its flat offset in A),
    for ``kbase`` a multiple of a K step (64 in 16-bit units; 32 for the reference's fp32 elements) and ``kin``
    below it. False on rows past ``spec.rows`` (``tail``: a partial last tile row), where ``k_inside`` (a
    partial last K step's condition) is false and, for a conv, on window taps outside the input: the element is
    zero there."""
    conds = ([f"{row} < {spec.rows}"] if tail else []) + ([k_inside] if k_inside else [])
    if spec.conv is None:
        a_batch, _ = _batch_offsets(spec)
        return _all(conds), f"{a_batch} + {row} * {spec.k} + {kbase} + {kin}"
    g = spec.conv
    (sh, sw), (pt, pl), (dh, dw) = g.stride, g.pad, g.dilation
    # the filter tap (r, s): the K step's where c is a multiple of 64, else each chunk's (c a multiple of 8: a
    # chunk's channels lie in one tap)
    kk = f"({kbase})" if g.c % 64 == 0 else f"({kbase} + {kin})"
    rs = f"{kk} // {g.c}"
    ih = f"({row} // {g.ow} % {g.oh} * {sh} + {rs} // {g.s} * {dh} - {pt})"
    iw = f"({row} % {g.ow} * {sw} + {rs} % {g.s} * {dw} - {pl})"
    if g.padded:
        conds += [f"0 <= {ih}", f"{ih} < {g.h}", f"0 <= {iw}", f"{iw} < {g.w}"]
    pixel = f"({row} // {g.oh * g.ow} * {g.h} + {ih}) * {g.w} + {iw}"
    channel = f"({kbase}) % {g.c} + {kin}" if g.c % 64 == 0 else f"{kk} % {g.c}"
    return _all(conds), f"({pixel}) * {g.c} + {channel}"


def _all(conds: list[str]) -> str | None:
    """TVMScript of the conjunction of ``conds`` (None for none)."""
    if not conds:
        return None
    return conds[0] if len(conds) == 1 else f"T.And({conds[0]}, {_all(conds[1:])})"


def _tile_coords(spec: GemmSpec, cfg: WgmmaConfig, tile: str = "bx") -> tuple[str, str]:
    """The tile row and column (``pid_m``, ``pid_n``) of tile number ``tile``: groups of ``raster`` tile rows walk
    the columns together (a short last group would leave tiles unwritten: refused)."""
    R, cols, rows = cfg.raster, tiles_n(spec, cfg), tiles_m(spec, cfg)   # (a partial last tile column included)
    if rows % R:
        raise ValueError(f"wgmma: groups of {R} tile rows do not divide the {rows} tile rows: tiles would be left "
                         f"unwritten ({cfg.name})")
    return (f"({tile} // {R * cols} * {R} + {tile} % {R * cols} % {R})",
            f"({tile} % {R * cols} // {R})")


def _pixel_origin(spec: GemmSpec, patch: str) -> tuple[str, str, str]:
    """(image, first output row, first output column) of a TMA conv's patch number ``patch``."""
    g = spec.conv
    bh, bw = pixel_tile(spec)
    ph, pw = -(-g.oh // bh), -(-g.ow // bw)
    return f"({patch} // {ph * pw})", f"({patch} // {pw} % {ph} * {bh})", f"({patch} % {pw} * {bw})"
