"""Flash attention on the CUDA cores: the planner's attention without N×N scores where the tensor-core template
cannot take it (fp32 inputs).

fp32 has no fp32-exact tensor-core ``mma`` (TF32 keeps 10 mantissa bits: fp16's error, not fp32's), so unfused fp32
attention writes the batch × heads × N × N scores to HBM and reads them twice (softmax, then ``P @ V``): at 8 × 512
tokens and 4 heads, 128 MB a layer. This kernel keeps them on chip, one key tile at a time:

* a thread block owns ``block_m`` query rows of one (batch, head); ``lanes`` adjacent threads of a warp share a row
  (each holds the whole query row and an output accumulator in registers) and ``rows`` rows share a thread;
* each step stages ``block_n`` keys of K and V in shared memory (fp32, rows padded by 4 floats so the lanes of a row,
  reading different keys, hit different banks, and 16-byte aligned for ``ld.shared.v4``); lane ``p`` of a row takes
  keys ``p, p + lanes, ...`` of the tile, so one shared read feeds ``rows`` FMAs and the lanes split the keys, not
  the dot products;
* the online softmax keeps each lane's running sum and output over its keys against the row's running max (one
  shuffle reduction over the lanes a step); at the end the lanes' sums and outputs are added by shuffles and one
  lane stores each part of the row.

Rows and keys need not be whole tiles: a ragged last tile is guarded (keys past the end are -inf, rows past the end
are computed and not stored). Causal masks walk only the key tiles up to the block's diagonal, GQA reads K/V head
``h // kv_group``, the additive mask and the scale are the tensor-core kernel's (:func:`softmax._score`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tvmfuse.kernels.flash.softmax import _SHFL, _indent, _score, batch_indices, kv_index
from tvmfuse.plan.attention import AttentionSpec, simt_gpu_misfit

REGISTER_BUDGET = 168   # fp32 registers a thread's query rows, outputs and scores may take (of 255), leaving the rest
#                         for addresses and the loaded K/V vector: the kernel must not spill its accumulators
SHARED_LIMIT = 48 * 1024  # static shared memory: no opt-in attribute needed on any CUDA GPU
THREADS_PER_SM = 1024   # the threads the default wants on each SM: half of the 2048 an SM holds (sm_70 to sm_90),
#                         enough warps to hide the shared loads' latency


@dataclass(frozen=True)
class SimtConfig:
    threads: int = 128   # threads per block
    rows: int = 1        # query rows per thread (each shared-memory read of K or V feeds that many FMAs)
    lanes: int = 1       # threads per query row, splitting the keys of each tile
    block_n: int = 32    # keys per step

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def block_m(self) -> int:
        return self.threads // self.lanes * self.rows

    @property
    def name(self) -> str:
        # "c": CUDA cores; the letters are the knobs the cost model's features and the mutator read
        return f"c t{self.threads} r{self.rows} l{self.lanes} n{self.block_n}"

    def registers(self, spec: AttentionSpec) -> int:
        return self.rows * (spec.head_dim + spec.head_dim_v + self.block_n // self.lanes + 4)

    def shared_bytes(self, spec: AttentionSpec) -> int:
        return 4 * self.block_n * (spec.head_dim + 4 + spec.head_dim_v + 4)


def simt_configs(spec: AttentionSpec, threads=(64, 128, 256), rows=(1, 2, 4), lanes=(1, 2, 4, 8, 16),
                 block_n=(16, 32, 64)) -> list[SimtConfig]:
    """The configs (from the given choices) whose registers and shared memory fit: every lane takes at least one
    key of a tile. Every spec :func:`simt_gpu_misfit` accepts has one (64 threads, 16 lanes a row, 16 keys a step)."""
    if simt_gpu_misfit(spec) is not None:
        return []
    out = []
    for t in threads:
        for r in rows:
            for p in lanes:
                for n in block_n:
                    c = SimtConfig(int(t), int(r), int(p), int(n))
                    if (n % p == 0 and 32 % p == 0 and c.registers(spec) <= REGISTER_BUDGET
                            and c.shared_bytes(spec) <= SHARED_LIMIT):
                        out.append(c)
    return out


def simt_default(spec: AttentionSpec, sm_count: int) -> SimtConfig:
    """The untuned config for a GPU of ``sm_count`` SMs: 128 threads, 32 keys a step, the fewest lanes per row that
    give every SM :data:`THREADS_PER_SM` threads (a row's keys split among up to 8 lanes), then two rows a thread
    where that still leaves them and the registers allow."""
    options = simt_configs(spec)
    active_threads = sm_count * THREADS_PER_SM
    rows_total = math.prod(spec.batch) * spec.seq_q
    lanes = 1
    while lanes < 8 and rows_total * lanes < active_threads:
        lanes *= 2
    want = [SimtConfig(128, r, p, 32) for r in ((2, 1) if rows_total * lanes >= 2 * active_threads else (1,))
            for p in (lanes, lanes // 2 or 1, 1)]
    for c in want:
        if c in options:
            return c
    return options[0]


def parse_simt(name: str) -> SimtConfig:
    fields = {part[0]: int(part[1:]) for part in name.split() if part != "c"}
    return SimtConfig(threads=fields["t"], rows=fields["r"], lanes=fields["l"], block_n=fields["n"])


def simt_source(spec: AttentionSpec, cfg: SimtConfig, kernel) -> str:
    """TVMScript of the CUDA-core flash kernel for ``spec`` with ``cfg`` (``kernel``: the grid wrapper,
    :func:`tvmfuse.kernels.flash.source._kernel`)."""
    D, DV, BN, NT, R, P = spec.head_dim, spec.head_dim_v, cfg.block_n, cfg.threads, cfg.rows, cfg.lanes
    KP, BM, KS, VS = BN // P, cfg.block_m, D + 4, DV + 4
    bidx = batch_indices(spec)
    kvidx = kv_index(spec, bidx)
    kvb = spec.kv_batch
    q_shape, v_shape, o_shape = (*spec.batch, spec.seq_q, D), (*kvb, spec.seq_k, DV), spec.out_shape
    k_shape = (*kvb, spec.seq_k, D) if spec.k_rows else (*kvb, D, spec.seq_k)
    dt = spec.dtype   # float32 (simt_gpu_misfit)
    buf = lambda name, shp, t=dt: f"{name}: T.Buffer({tuple(shp)!r}, '{t}')"  # noqa: E731
    params = [buf("q", q_shape), buf("k", k_shape), buf("v", v_shape)]
    params += [buf(name, shape, t) for name, shape, t in spec.additive()]
    params.append(buf("out", o_shape))

    grp, lane = f"(tx // {P})", f"(tx % {P})" if P > 1 else "0"
    row = f"(bx * {BM} + r * {NT // P} + {grp})"              # query row r of this thread
    ragged_q, ragged_k = spec.seq_q % BM != 0, spec.seq_k % BN != 0
    nsteps = -(-spec.seq_k // BN)
    if spec.causal:   # the block's last row sees keys up to its diagonal: the tiles past it hold nothing it sees
        steps = f"T.min({nsteps}, (bx * {BM} + {BM - 1 + spec.causal_offset}) // {BN} + 1)"
    else:
        steps = str(nsteps)
    col = f"(j * {BN} + t * {P} + {lane})"                       # the key of this lane's score t
    # a row or key past the end reads the mask at the last one (its score is dropped or -inf)
    mrow_ = f"T.min({row}, {spec.seq_q - 1})" if ragged_q else row
    mcol = f"T.min({col}, {spec.seq_k - 1})" if ragged_k else col
    score = _score(spec, bidx, mrow_, mcol, f"sc[r * {KP} + t]", seen_row=row)
    if ragged_k:
        score = f"T.Select({col} >= {spec.seq_k}, T.float32('-inf'), {score})"

    def tile(dst: str, src: str, width: int, stride: int, keys_first: bool) -> str:
        """Copy this step's ``block_n`` keys of ``src`` into shared ``dst`` (rows of ``stride`` floats): consecutive
        threads read consecutive elements of the source (keys first where keys are its last axis)."""
        n = BN * width
        rounds, guard = -(-n // NT), n % NT != 0
        e = f"(it * {NT} + tx)"
        key, d = (f"({e} % {BN})", f"({e} // {BN})") if keys_first else (f"({e} // {width})", f"({e} % {width})")
        at = [*kvidx, f"j * {BN} + {key}", d] if not keys_first else [*kvidx, d, f"j * {BN} + {key}"]
        src_at = src + "[" + ", ".join(at) + "]"
        store = f"{dst}[{key} * {stride} + {d}] = {src_at}\n"
        if ragged_k:
            store = (f"if j * {BN} + {key} < {spec.seq_k}:\n" + _indent(store, 4)
                     + f"else:\n    {dst}[{key} * {stride} + {d}] = T.float32(0)\n")
        if guard:
            store = f"if {e} < {n}:\n" + _indent(store, 4)
        return f"for it in T.unroll({rounds}):\n" + _indent(store, 4)

    q_load = f"""for r in T.unroll({R}):
    for d in T.unroll({D}):
        qr[r * {D} + d] = T.float32(0)
"""
    q_at = "q[" + ", ".join([*bidx, row, "d"]) + "]"
    q_row = f"for d in T.unroll({D}):\n    qr[r * {D} + d] = {q_at}\n"
    q_load += _indent(f"if {row} < {spec.seq_q}:\n" + _indent(q_row, 4) if ragged_q else q_row, 4)

    def reduce_lanes(v: str, op: str) -> str:
        out, m = "", 1
        while m < P:
            out += f"{v} = {op.format(a=v, b=_SHFL.format(v=v, m=m))}\n"
            m *= 2
        return out

    def per_key(tile_buf: str, stride: int, width: int, acc: str, other: str) -> str:
        """For each of this lane's keys of the tile, its row of ``tile_buf`` read 4 floats at a time, each float
        multiplied into ``acc`` with ``other`` (of row ``r``, element ``d4 * 4 + e``)."""
        return f"""for t in T.unroll({KP}):
    for d4 in T.unroll({width // 4}):
        for e in T.vectorized(4):
            kv[e] = {tile_buf}[(t * {P} + {lane}) * {stride} + d4 * 4 + e]
        for r in T.unroll({R}):
            for e in T.unroll(4):
                {acc} = {acc} + {other} * kv[e]
"""

    step = f"""T.tvm_storage_sync("shared")
{tile("ks", "k", D, KS, not spec.k_rows)}{tile("vs", "v", DV, VS, False)}T.tvm_storage_sync("shared")
for i in T.unroll({R * KP}):
    sc[i] = T.float32(0)
{per_key("ks", KS, D, f"sc[r * {KP} + t]", f"qr[r * {D} + d4 * 4 + e]")}for r in T.unroll({R}):
    red[r] = T.float32(-1e30)
    for t in T.unroll({KP}):
        sc[r * {KP} + t] = {score}
        red[r] = T.max(red[r], sc[r * {KP} + t])
{_indent(reduce_lanes("red[r]", "T.max({a}, {b})"), 4)}    red[r] = T.max(mrow[r], red[r])
    alpha[r] = T.exp2(mrow[r] - red[r])
    mrow[r] = red[r]
    lrow[r] = lrow[r] * alpha[r]
    for t in T.unroll({KP}):
        sc[r * {KP} + t] = T.exp2(sc[r * {KP} + t] - mrow[r])
        lrow[r] = lrow[r] + sc[r * {KP} + t]
    for e in T.unroll({DV}):
        acc[r * {DV} + e] = acc[r * {DV} + e] * alpha[r]
{per_key("vs", VS, DV, f"acc[r * {DV} + d4 * 4 + e]", f"sc[r * {KP} + t]")}"""
    part = DV // P   # lane p of a row stores elements [p * part, (p + 1) * part) of it
    out_val = f"acc[r * {DV} + {'c * ' + str(part) + ' + ' if P > 1 else ''}e] * lrow[r]"
    out_at = f"out[{', '.join(spec.out_index(bidx, row, f'c * {part} + e' if P > 1 else 'e'))}]"
    store = f"for e in T.unroll({part}):\n    {out_at} = {out_val}\n"
    if P > 1:   # a constant register index in each branch: a lane-dependent one would put acc in local memory
        store = f"for c in T.unroll({P}):\n    if {lane} == c:\n" + _indent(store, 8)
    if ragged_q:
        store = f"if {row} < {spec.seq_q}:\n" + _indent(store, 4)
    add_lanes = "" if P == 1 else (f"for e in T.unroll({DV}):\n"
                                   + _indent(reduce_lanes(f"acc[r * {DV} + e]", "{a} + {b}"), 4))
    finish = f"""for r in T.unroll({R}):
{_indent(reduce_lanes("lrow[r]", "{a} + {b}"), 4)}    lrow[r] = T.float32(1) / lrow[r]
{_indent(add_lanes, 4)}{_indent(store, 4)}"""
    body = f"""ks = T.alloc_buffer(({BN * KS},), "float32", scope="shared", align=16)
vs = T.alloc_buffer(({BN * VS},), "float32", scope="shared", align=16)
qr = T.alloc_buffer(({R * D},), "float32", scope="local")
acc = T.alloc_buffer(({R * DV},), "float32", scope="local")
sc = T.alloc_buffer(({R * KP},), "float32", scope="local")
kv = T.alloc_buffer((4,), "float32", scope="local", align=16)
mrow = T.alloc_buffer(({R},), "float32", scope="local")
lrow = T.alloc_buffer(({R},), "float32", scope="local")
red = T.alloc_buffer(({R},), "float32", scope="local")
alpha = T.alloc_buffer(({R},), "float32", scope="local")
{q_load}for i in T.unroll({R * DV}):
    acc[i] = T.float32(0)
for r in T.unroll({R}):
    mrow[r] = T.float32(-1e30)
    lrow[r] = T.float32(0)
for j in T.serial({steps}):
{_indent(step, 4)}{finish}"""
    return kernel(spec, cfg, params, body)
