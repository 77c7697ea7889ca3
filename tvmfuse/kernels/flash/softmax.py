"""What every flash kernel shares: the online softmax on the score registers, the scaled and masked score, the
normalized store, and TVMScript text helpers."""
from __future__ import annotations

import math
from dataclasses import replace

from tvmfuse.plan.attention import AttentionSpec, key_vector

_LOG2E = 1.4426950408889634


def _flat(shape: tuple[int, ...], idx: list[str]) -> str:
    """Row-major flattened offset of ``idx`` (expressions) into a buffer of ``shape``."""
    terms = []
    for k, e in enumerate(idx):
        stride = math.prod(shape[k + 1:])
        terms.append(f"({e}) * {stride}" if stride != 1 else f"({e})")
    return " + ".join(terms)


def _indent(text: str, n: int) -> str:
    return "".join(" " * n + line + "\n" if line.strip() else "\n" for line in text.splitlines())


_SHFL = "T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), {v}, {m}, 32, 32)"


def _online_softmax(M: int, SB: int, OB: int, score: str, acc: str, p_store: str | None = None,
                    rescale: bool = True) -> str:
    """One key step of the online softmax on the score accumulators ``acc`` (an element expression of ``mt`` and
    ``i``; ``score`` its scaled, masked value): the running row max and sum, P in ``pf`` (fp16; ``p_store``: the
    statement that stores P instead), O rescaled (``rescale`` False: not yet, :func:`rescale_o` does it)."""
    p_store = p_store or f'pf[mt * {SB} + i] = T.Cast("float16", {acc})'
    scaled = f"oacc[mt * {OB} + i] = oacc[mt * {OB} + i] * alpha[mt * 2 + i % 4 // 2]"
    tail = f"    for i in T.unroll({OB}):\n        {scaled}\n" if rescale else ""
    return f"""# online softmax on the registers: element i of tile mt is in row g (i % 4 < 2) or g + 8 of its 16
for h in T.unroll({2 * M}):
    red[h] = T.float32(-1e30)
for mt in T.unroll({M}):
    for i in T.unroll({SB}):
        {acc} = {score}
        red[mt * 2 + i % 4 // 2] = T.max(red[mt * 2 + i % 4 // 2], {acc})
for h in T.unroll({2 * M}):
    red[h] = T.max(red[h], {_SHFL.format(v="red[h]", m=1)})
    red[h] = T.max(red[h], {_SHFL.format(v="red[h]", m=2)})
    red[h] = T.max(mrow[h], red[h])
    alpha[h] = T.exp2(mrow[h] - red[h])
    mrow[h] = red[h]
    lrow[h] = lrow[h] * alpha[h]
for mt in T.unroll({M}):
    for i in T.unroll({SB}):
        {acc} = T.exp2({acc} - mrow[mt * 2 + i % 4 // 2])
        lrow[mt * 2 + i % 4 // 2] = lrow[mt * 2 + i % 4 // 2] + {acc}
        {p_store}
{tail}"""


def rescale_o(M: int, OB: int) -> str:
    """O's rows scaled by ``alpha``, the factor the step's new row max gives the old sums."""
    return f"""for mt in T.unroll({M}):
    for i in T.unroll({OB}):
        oacc[mt * {OB} + i] = oacc[mt * {OB} + i] * alpha[mt * 2 + i % 4 // 2]
"""


def _normalize_and_store(M: int, OB: int, out_at: str, dtype: str = "float16", guard: str | None = None) -> str:
    """The rows' sums across their four lanes, and O / sum stored as ``dtype`` (``out_at``: the output element of
    ``mt``, ``i``; ``guard``: the condition it is stored under, a ragged last tile's rows in the tensor)."""
    store = f'{out_at} = T.Cast("{dtype}", oacc[mt * {OB} + i] * lrow[mt * 2 + i % 4 // 2])\n'
    if guard is not None:
        store = f"if {guard}:\n" + _indent(store, 4)
    return f"""for h in T.unroll({2 * M}):
    lrow[h] = lrow[h] + {_SHFL.format(v="lrow[h]", m=1)}
    lrow[h] = lrow[h] + {_SHFL.format(v="lrow[h]", m=2)}
    lrow[h] = T.float32(1) / lrow[h]
for mt in T.unroll({M}):
    for i in T.unroll({OB}):
{_indent(store, 8)}"""


def key_steps(spec: AttentionSpec, block_m: int, block_n: int, multiple: int = 1) -> str:
    """The key steps query tile ``bx`` walks, as an expression: every ``seq_k / block_n`` of them, or with a causal
    mask only those up to the tile's diagonal (its last row's last visible key), rounded up to ``multiple`` (the
    overlapped kernel takes steps in pairs; a step past the diagonal is wholly masked and adds nothing)."""
    nsteps = -(-spec.seq_k // block_n)   # a ragged last step included
    if not spec.causal:
        return str(nsteps)
    upto = f"(bx * {block_m} + {block_m + spec.causal_offset + block_n - 1}) // {block_n}"
    if multiple > 1:
        upto = f"({upto} + {multiple - 1}) // {multiple} * {multiple}"
    return f"T.min({nsteps}, {upto})"


def full_steps(spec: AttentionSpec, block_m: int, block_n: int) -> str:
    """The key steps of query tile ``bx`` that every row of it sees whole, as an expression: the whole tiles of keys,
    and with a causal mask only those before the first step holding a key past its first row's diagonal. They need
    no mask."""
    if not spec.causal:
        return str(spec.seq_k // block_n)
    return f"T.min({spec.seq_k // block_n}, (bx * {block_m} + {spec.causal_offset + 1}) // {block_n})"


def tile_scores(spec: AttentionSpec, bidx: list[str], row: str, col: str, acc: str, block_m: int,
                block_n: int) -> tuple[str, str]:
    """The score of ``acc`` (query ``row``, key ``col``) in the key steps every row sees whole
    (:func:`full_steps`), and in the others: past a causal diagonal, or past the keys' end in a ragged last step
    (-inf, its mask read at the last key). A ragged last query tile reads the mask at the last row."""
    mrow = f"T.min({row}, {spec.seq_q - 1})" if spec.seq_q % block_m else row
    mcol = f"T.min({col}, {spec.seq_k - 1})" if spec.seq_k % block_n else col
    plain = _score(replace(spec, causal=False), bidx, mrow, mcol, acc)
    masked = _score(spec, bidx, mrow, mcol, acc, seen_row=row)
    if spec.seq_k % block_n:
        masked = f"T.Select({col} >= {spec.seq_k}, T.float32('-inf'), {masked})"
    return plain, masked


def key_loop(spec: AttentionSpec, block_m: int, block_n: int, step) -> str:
    """The loop over query tile ``bx``'s key steps ``j``: ``step(masked)`` gives a step's body, where only the steps
    past :func:`full_steps` (a causal diagonal's, a ragged last one) apply the mask."""
    nsteps, full = key_steps(spec, block_m, block_n), full_steps(spec, block_m, block_n)
    if not spec.causal and spec.seq_k % block_n == 0:
        return f"for j in T.serial({nsteps}):\n{step(False)}"
    return f"for j in T.serial({full}):\n{step(False)}for j in T.serial({full}, {nsteps}):\n{step(True)}"


def query_read(spec: AttentionSpec, row: str, read, zero: str, ragged: bool) -> str:
    """``read(row)`` (a load of Q at query ``row``), or where the last query tile is ``ragged``, the load at the row
    clamped into the tensor and ``zero`` for the rows past its end."""
    if not ragged:
        return read(row)
    return f"T.if_then_else({row} < {spec.seq_q}, {read(f'T.min({row}, {spec.seq_q - 1})')}, {zero})"


def kv_index(spec: AttentionSpec, bidx: list[str]) -> list[str]:
    """K's and V's batch indices for query batch indices ``bidx``: query head h reads K/V head h // kv_group."""
    return bidx if spec.kv_group == 1 else [*bidx[:-1], f"({bidx[-1]}) // {spec.kv_group}"]


def kt_vector(spec: AttentionSpec) -> int:
    """Elements of Kᵀ (``[d, key]``, not ``k_rows``) a thread copies at a time (:func:`key_vector`; ViT's 197 keys:
    one, under ``cp.async``'s least 4 bytes, so no two-stage config). K as rows and V always take 16 bytes."""
    return key_vector(spec.seq_k, spec.dtype)


def kv_tile_copies(spec: AttentionSpec, tiles, step: str, slot: str, threads: int, block_n: int, copy,
                   zero: str | None) -> str:
    """A key step's K and V tiles copied into shared memory by ``threads`` threads, one vector a thread a round.

    ``tiles``: (shared buffer, source, rows, columns, shared row stride, tile elements, key axis, vector width) of
    each tile, the key axis 0 (keys as rows) or 1 (Kᵀ); ``copy(dst, at, src, index, width)``: the statements that
    copy one vector (``at``: its shared offset; ``index``: the source's [row, column]); ``zero``: the zero of the
    shared dtype, which fills the vectors of keys past the end in a ragged last step (None: no fill). A tile of
    vectors that does not split evenly over the threads (a 32x48 tile is 192 vectors for 128 threads) guards its
    last round."""
    out = ""
    for dst, src, rows, cols, stride, tile, key_axis, width in tiles:
        vec = cols // width
        n = rows * vec
        rounds = -(-n // threads)
        r, c = f"(it * {threads} + tx) // {vec}", f"(it * {threads} + tx) % {vec} * {width}"
        index = [r, c]
        index[key_axis] = f"({step}) * {block_n} + {index[key_axis]}"
        at = f"{slot} * {tile} + ({r}) * {stride} + {c}"
        body = copy(dst, at, src, index, width)
        if zero is not None and spec.seq_k % block_n:   # a vector's keys are all in or all out: width divides seq_k
            body = (f"if {index[key_axis]} < {spec.seq_k}:\n" + _indent(body, 4)
                    + f"else:\n    for e in T.vectorized({width}):\n        {dst}[{at} + e] = {zero}\n")
        if n % threads:
            body = f"if it * {threads} + tx < {n}:\n" + _indent(body, 4)
        out += f"for it in T.unroll({rounds}):\n" + _indent(body, 4)
    return out


def batch_indices(spec: AttentionSpec) -> list[str]:
    """The per-dim indices of ``spec.batch`` in ``by``, the block index that walks the flattened batch dims."""
    bidx, rest = [], "by"
    for k in range(len(spec.batch)):
        inner = math.prod(spec.batch[k + 1:])
        bidx.append(f"({rest}) // {inner}" if inner > 1 else rest)
        rest = f"({rest}) % {inner}" if inner > 1 else rest
    return bidx


def _score(spec: AttentionSpec, bidx: list[str], row: str, col: str, acc: str, seen_row: str | None = None) -> str:
    """The score of accumulator element ``acc`` (query ``row``, key ``col``) in base 2: log2(e) * (scale * s +
    mask), or log2(e) * scale * (s + mask) when the mask comes first. ``seen_row``: the query row a causal mask
    compares, where ``row`` (the mask's read) is clamped into the tensor (a ragged last tile's rows)."""
    score = _scaled_masked(spec, bidx, row, col, acc)
    if spec.causal:
        # keys past the diagonal are -inf before the running max: their exp2 is 0, and every row sees key 0 (in
        # the first step, offset >= 0), so no row's max stays -inf and no 0 / 0 can come of it
        score = f"T.Select(({col}) > ({seen_row or row}) + {spec.causal_offset}, T.float32('-inf'), {score})"
    return score


def _scaled_masked(spec: AttentionSpec, bidx: list[str], row: str, col: str, acc: str) -> str:
    terms = []
    for name, shape, dtype in spec.additive():   # the mask, and a bias added with it
        at = f"{name}[{', '.join(spec.term_index(shape, [*bidx, row, col]))}]"
        terms.append(at if dtype == "float32" else f"T.Cast('float32', {at})")
    mask = None if not terms else terms[0] if len(terms) == 1 else f"({' + '.join(terms)})"
    scale = 1.0 if spec.scale is None else float(spec.scale)
    if mask is None:
        return f"{acc} * T.float32({scale * _LOG2E!r})"
    if spec.scale_first:
        score = f"({acc} * T.float32({scale!r}) + {mask}) * T.float32({_LOG2E!r})"
    else:
        score = f"({acc} + {mask}) * T.float32({scale * _LOG2E!r})"
    # a mask of float32's lowest value (-3.4e38) overflows to -inf in base 2: clamp to the running max's
    # start, so a row masked everywhere gets softmax's uniform weights, as the reference does, not 0 / 0
    return f"T.max({score}, T.float32(-1e30))"
