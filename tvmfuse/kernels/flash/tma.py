"""The warp-specialized Hopper flash kernel (``FlashConfig.tma``; names ending ``" ht"``, ``" htp"``, ``" hto"``):
FlashAttention-3's division of labour on tvmfuse's wgmma tiles.

A block owns 128 query rows of one (batch, head): two computing warpgroups of 64 rows each and a producer warpgroup,
one thread of which loads Q once and then each key step's K and V tiles by TMA (``cp.async.bulk.tensor``, 128-byte
swizzled: the layouts of :class:`tvmfuse.kernels.flash.wgmma_tiles._WgmmaTiles`) into ``stages`` slots. Each slot
has four mbarriers: ``kfull`` and ``vfull`` (the producer's arrival with the tile's byte count, completed by TMA) and
``kempty`` and ``vempty`` (every computing thread arrives once its wgmma that read the tile is done); the producer
waits for a slot's ``empty`` before refilling it. No thread waits for the whole block inside the loop, and the
computing warps issue no loads: their registers (224 each, the producer's 56; ``setmaxnreg``) hold the scores, P and O.

Key step ``j`` of a computing warpgroup issues ``S_j = Q·K_jᵀ`` and the previous step's ``O += P_{j-1}·V_{j-1}``
back to back, waits for both, releases ``K_j`` and ``V_{j-1}``, and runs the online softmax of ``S_j`` (P stays in
registers until the next step's issue); the last ``P·V`` follows the loop. With ping-pong (``tma`` 2) the two
warpgroups take turns at issuing (named barriers 1 and 2): one's wgmmas run while the other computes its softmax,
where without it the two may fall into step and leave the tensor cores idle together. With overlap too (``tma`` 3)
a warpgroup waits for ``S_j`` alone and computes its softmax while ``P_{j-1}·V_{j-1}`` still runs (FlashAttention-3's
intra-warpgroup pipelining); O is rescaled and P packed after the second wait.

The host encodes the three tensor maps before the launch (3-D: the flattened batch outermost); causal tiles, GQA
heads and additive masks as in the other flash kernels (:mod:`tvmfuse.kernels.flash.softmax`). Whole tiles only.
"""
from __future__ import annotations

import math

from tvmfuse.kernels.flash.config import FlashConfig
from tvmfuse.kernels.flash.softmax import (_flat, _indent, _normalize_and_store, _online_softmax, batch_indices,
                                           full_steps, key_steps, kv_index, rescale_o, tile_scores)
from tvmfuse.kernels.flash.wgmma_tiles import _WgmmaTiles, pack_p, warpgroup_registers
from tvmfuse.kernels.wgmma.ptx import _ptx
from tvmfuse.kernels.wgmma.tma import encode_map
from tvmfuse.plan.attention import AttentionSpec

TURN_BARRIERS = (1, 2)   # named barriers of the ping-pong (0 is __syncthreads)


def tma_maps(spec: AttentionSpec, cfg: FlashConfig) -> dict[str, dict]:
    """Q's, K's and V's tensor maps, innermost dimension first: ``dims`` (elements), ``strides`` (bytes, all but the
    first), ``box`` (elements of one load) and ``loads(step)`` -> [(element offset in the tile, [c0, c1, c2])]
    (``step`` the key step; Q's ignores it). Each box is 64 elements (128 bytes, the swizzle's span) wide: Q
    ``[64, block_m]`` per 64 of the head dim, K ``[64, block_n]`` per 64 of the head dim (keys as rows) or
    ``[64 keys, d]`` per 64 keys (Kᵀ), V ``[64, block_n]`` per 64 of the value dim."""
    D, DV, BN, BM = spec.head_dim, spec.head_dim_v, cfg.block_n, cfg.block_m
    nq, nkv = math.prod(spec.batch), math.prod(spec.kv_batch)
    bidx = batch_indices(spec)
    kvflat = _flat(spec.kv_batch, kv_index(spec, bidx)) if len(spec.kv_batch) > 1 else kv_index(spec, bidx)[0]
    q = {"dims": [D, spec.seq_q, nq], "strides": [2 * D, 2 * D * spec.seq_q], "box": [64, BM, 1],
         "loads": lambda step: [(kb * BM * 64, [str(kb * 64), f"bx * {BM}", "by"]) for kb in range(D // 64)]}
    if spec.k_rows:
        k = {"dims": [D, spec.seq_k, nkv], "strides": [2 * D, 2 * D * spec.seq_k], "box": [64, BN, 1],
             "loads": lambda step: [(kb * BN * 64, [str(kb * 64), f"({step}) * {BN}", kvflat])
                                    for kb in range(D // 64)]}
    else:
        k = {"dims": [spec.seq_k, D, nkv], "strides": [2 * spec.seq_k, 2 * spec.seq_k * D], "box": [64, D, 1],
             "loads": lambda step: [(nb * D * 64, [f"({step}) * {BN} + {nb * 64}", "0", kvflat])
                                    for nb in range(BN // 64)]}
    v = {"dims": [DV, spec.seq_k, nkv], "strides": [2 * DV, 2 * DV * spec.seq_k], "box": [64, BN, 1],
         "loads": lambda step: [(nb * BN * 64, [str(nb * 64), f"({step}) * {BN}", kvflat]) for nb in range(DV // 64)]}
    return {"q": q, "k": k, "v": v}


def tma_body(spec: AttentionSpec, cfg: FlashConfig, out_at: str, row: str, tig: str) -> tuple[str, str]:
    """(the host's tensor-map encodes, the block's body) of the warp-specialized kernel for ``spec`` and ``cfg``."""
    S, BN, BM = cfg.stages, cfg.block_n, cfg.block_m
    SB, OB, NC = BN // 2, spec.head_dim_v // 2, 32 * cfg.warps
    bidx = batch_indices(spec)
    tiles = _WgmmaTiles(spec, cfg, bidx, S)
    maps = tma_maps(spec, cfg)
    bars = 2 * tiles.elems   # byte offset of the mbarriers: qfull, then kfull, vfull, kempty, vempty (S each)

    def bar(kind: str, slot: str = "0") -> str:
        at = {"q": 0, "kfull": 8, "vfull": 8 + 8 * S, "kempty": 8 + 16 * S, "vempty": 8 + 24 * S}[kind]
        return f"smem_base + T.uint32({bars + at} + ({slot}) * 8)"

    encode = "".join(encode_map(name, name, m) for name, m in maps.items())

    def loads(name: str, step: str, base: int, tile: int, slot: str, full: str) -> str:
        out = _ptx("tvmfuse_mbar_expect_tx", full, str(2 * tile))
        for off, coords in maps[name]["loads"](step):
            dst = f"smem_base + T.uint32(({base} + ({slot}) * {tile} + {off}) * 2)"
            out += _ptx("tvmfuse_tma_load_3d", dst, f"T.address_of({name}map)", *coords, full)
        return out

    def refill(name: str, base: int, tile: int) -> str:
        """Step ``j``'s K or V tile into its slot, once the slot's last reader has released it."""
        slot = f"j % {S}"
        released = _ptx("tvmfuse_mbar_wait", bar(f"{name}empty", slot), f"(j // {S} + 1) % 2")
        return f"if j >= {S}:\n" + _indent(released, 4) + loads(name, "j", base, tile, slot, bar(f"{name}full", slot))

    nsteps = key_steps(spec, BM, BN)
    producer = (loads("q", "0", tiles.q_base, tiles.q_tile, "0", bar("q")) + f"for j in T.serial({nsteps}):\n"
                + _indent(refill("k", tiles.k_base, tiles.k_tile) + refill("v", tiles.v_base, tiles.v_tile), 4))

    pingpong, overlap = cfg.tma >= 2, cfg.tma == 3
    wg = "(tx // 128)"

    def turn(issue: str, last: bool = False) -> str:
        """``issue`` (wgmmas) in this warpgroup's turn: wait for it, issue, hand the turn on (after its last turn the
        second warpgroup hands nothing on: every wait was matched by one arrival, the first one's at the start)."""
        if not pingpong:
            return issue
        first, second = TURN_BARRIERS   # warpgroup w waits at barrier first + w and hands on at the other
        sync = _ptx("tvmfuse_bar_sync", f"{first} + {wg}", "256")
        hand = _ptx("tvmfuse_bar_arrive_if", f"{second} - {wg}", "256", f"T.Cast('int32', {wg} == 0)" if last else "1")
        return sync + issue + hand

    wait = "T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))\n"
    prev = f"(j - 1) % {S}"
    v_prev_ready = _ptx("tvmfuse_mbar_wait", bar("vfull", prev), f"(j - 1) // {S} % 2")

    def step(score: str, first: bool = False) -> str:
        """Key step ``j``'s body (``first``: step 0, which has no P·V before it)."""
        head = (_ptx("tvmfuse_mbar_wait", bar("kfull", f"j % {S}"), f"j // {S} % 2")
                + f"for i in T.unroll({SB}):\n    sacc[i] = T.float32(0)\n")
        issue = tiles.s_wgmma("sacc", f"j % {S}") + ("" if first else v_prev_ready + tiles.pv_wgmma(None, prev))
        release_k = _ptx("tvmfuse_mbar_arrive_if", bar("kempty", f"j % {S}"), "1")
        release_v = "" if first else _ptx("tvmfuse_mbar_arrive_if", bar("vempty", prev), "1")
        pack = pack_p("sacc", SB, pin=True, rounded=True)
        if not overlap or first:
            return (head + turn(issue) + wait + release_k + release_v
                    + _online_softmax(1, SB, OB, score, f"sacc[mt * {SB} + i]", p_store="T.evaluate(0)") + pack)
        # S_j and P_{j-1}·V_{j-1} are two groups: the softmax of S_j runs while P·V is in flight, which reads P's
        # registers and accumulates O, so O is rescaled and the new P packed only after the last wait
        return (head + turn(issue) + "T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(1))\n" + release_k
                + _online_softmax(1, SB, OB, score, f"sacc[mt * {SB} + i]", p_store="T.evaluate(0)", rescale=False)
                + wait + release_v + rescale_o(1, OB) + pack)

    col = f"j * {BN} + i // 4 * 8 + {tig} * 2 + i % 2"
    plain, masked = tile_scores(spec, bidx, row, col, f"sacc[mt * {SB} + i]", BM, BN)
    # step 0 on its own (masked: the mask is right at every step), so no step's wgmmas sit behind a branch (ptxas
    # injects a fence at a branch's join and may serialize the wgmmas after it); then the steps every row sees
    # whole, unmasked, and a causal tile's diagonal ones
    keys = "for j in T.serial(1):\n" + _indent(step(masked, first=True), 4)
    if spec.causal:
        whole = f"T.max({full_steps(spec, BM, BN)}, 1)"
        keys += (f"for j in T.serial(1, {whole}):\n" + _indent(step(plain), 4)
                 + f"for j in T.serial({whole}, {nsteps}):\n" + _indent(step(masked), 4))
    else:
        keys += f"for j in T.serial(1, {nsteps}):\n" + _indent(step(plain), 4)
    last = f"({nsteps} - 1)"
    start = (_ptx("tvmfuse_bar_arrive_if", str(TURN_BARRIERS[0]), "256", f"T.Cast('int32', {wg} == 1)")
             if pingpong else "")
    consumer = (_ptx("tvmfuse_regs_take_224")
                + _ptx("tvmfuse_mbar_wait", bar("q"), "0")
                + f"for i in T.unroll({OB}):\n    oacc[i] = T.float32(0)\n"
                + "for h in T.unroll(2):\n    mrow[h] = T.float32(-1e30)\n    lrow[h] = T.float32(0)\n"
                + start + keys
                + _ptx("tvmfuse_mbar_wait", bar("vfull", f"{last} % {S}"), f"{last} // {S} % 2")
                + turn(tiles.pv_wgmma(None, f"{last} % {S}"), last=True) + wait
                + _normalize_and_store(1, OB, out_at))
    init = (_ptx("tvmfuse_mbar_init", bar("q"), "1")
            + "".join(_ptx("tvmfuse_mbar_init", bar(kind, str(s)), "1" if kind.endswith("full") else str(NC))
                      for kind in ("kfull", "vfull", "kempty", "vempty") for s in range(S))
            + _ptx("tvmfuse_mbar_init_fence"))
    size = tiles.elems + 4 * cfg.mbarriers   # (fp16 elements: 4 an mbarrier)
    body = f"""hs = T.alloc_buffer(({size},), "float16", scope="shared.dyn", align=1024)
{warpgroup_registers(SB, None, OB)}smem_base = T.call_extern("uint32", "__cvta_generic_to_shared", T.address_of(hs[0]))
if tx == 0:
    # a store TVM's shared-memory planner sees, at the buffer's last element (the last mbarrier, initialized next):
    # it sizes an allocation by the accesses it sees, and TMA, the descriptors and the mbarriers are none
    hs[{size - 1}] = T.float16(0)
{_indent(init, 4)}T.tvm_storage_sync("shared")
if tx < {NC}:
{_indent(consumer, 4)}else:
{_indent(_ptx("tvmfuse_regs_give_56"), 4)}    if tx == {NC}:
{_indent(producer, 8)}"""
    return encode, body
