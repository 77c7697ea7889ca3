"""The row program's configs: which thread, row and vector splits take a row, and the one an untuned build runs."""
from __future__ import annotations

from dataclasses import dataclass

from tvmfuse.kernels.rows.program import (_SHARED_ROW_BYTES, _STREAM_THREADS, L2, REGISTERS, SHARED, Misfit,
                                          RowConfig, RowProgram, _bytes, analyze)


@dataclass(frozen=True)
class Room:
    """What the streamed configs and the default read of a GPU (:func:`room_for`): the bytes of a row a block
    stages two blocks an SM (:func:`staged_limit`), the most one block may stage (its opt-in shared memory less
    4 KB), its SMs and L2."""
    staged_bytes: int = _SHARED_ROW_BYTES
    block_bytes: int = (227 - 4) << 10
    sm_count: int = 132
    l2_bytes: int = 50 << 20


def configs(prog: RowProgram, *, threads=(32, 64, 128, 256, 512), rows_per_block=(1, 2, 4, 8),
            max_elements: int = 64, staged_bytes: int | None = None, room: Room | None = None) -> list[RowConfig]:
    """The configs whose threads split the row into whole vectors, at most ``max_elements`` per thread: 16-byte
    vectors, or where no thread count takes those (a short row), the widest narrower ones some thread count
    takes. Rows that no register config takes, or from 4096 columns, are also offered streamed."""
    room = _room(room, staged_bytes)
    lanes, out = prog.lanes(), []
    while lanes >= 1 and not out:
        for t in threads:
            t = int(t)
            if prog.cols % (t * lanes) or prog.cols // t > max_elements:
                continue
            for r in rows_per_block:
                r = int(r)
                # at most 512 threads a block: 128 registers each (1024 threads leave 64, and 128 threads x 8
                # rows of add+LayerNorm's 64-element slices spilled)
                if prog.rows % r == 0 and t * r <= 512:
                    out.append(RowConfig(t, r, 0 if lanes == prog.lanes() else lanes))
        lanes //= 2
    if prog.cols >= _STREAM_FROM or not out:
        out += streamed_configs(prog, threads, room=room)
    return out


_STREAM_FROM = 4096   # columns from which the space also offers streamed rows
# columns from which a row no register config takes is streamed untuned; narrower ones keep dlight's schedule,
# which beat the streamed row there on the H200 (LayerNorm 16384 x 4099 fp16: dlight 83 us, streamed 110 us;
# softmax 2048 x 32000: dlight 237 us, streamed 71 us) unless the row fits its threads' registers (RAGGED_ELEMENTS)
_STREAM_DEFAULT_FROM = 16384
_KEEP = (2, 4)             # vectors a thread may keep in registers beside a staged or re-read rest
_KEEP_ELEMENTS = 32        # ... at most this many elements of its inputs (16 registers of fp16)
_RAGGED_ELEMENTS = 64      # a ragged row held whole in registers: at most this many input elements a thread
_RAGGED_THREADS = (64, 128, 256, 512, 1024)


def _inputs(prog: RowProgram) -> list:
    outs = [o.name for o in prog.outputs]
    return [p for p in prog.params if p.name in prog.full and p.name not in outs]


def _staged_bytes(prog: RowProgram, cfg: RowConfig | None = None) -> int:
    """Bytes of one row of every whole-row input that a SHARED block under ``cfg`` stages in shared memory (None:
    the whole row): what its vectors kept in registers leave, and an unaligned row's head and tail."""
    if cfg is None:
        return sum(prog.cols * _bytes(p.dtype) for p in _inputs(prog))
    lanes = cfg.lanes or prog.lanes()
    vectors = prog.cols // lanes
    elements = max(vectors - cfg.keep * cfg.threads, 0) * lanes + (2 * lanes if prog.cols % lanes else 0)
    return sum(elements * _bytes(p.dtype) for p in _inputs(prog))


def staged_limit(shared_per_sm: int) -> int:
    """The bytes of a row a SHARED block may stage on a GPU of ``shared_per_sm`` bytes of shared memory per SM:
    two blocks an SM, less 4 KB each for the reductions' words (110 KB on the H200's 228 KB)."""
    return shared_per_sm // 2 - (4 << 10)


def _room(room: Room | None, staged_bytes: int | None) -> Room:
    room = room or Room()
    if staged_bytes is not None:
        room = Room(staged_bytes, room.block_bytes, room.sm_count, room.l2_bytes)
    return room


def streamed_configs(prog: RowProgram, threads=_STREAM_THREADS, staged_bytes: int | None = None,
                     room: Room | None = None) -> list[RowConfig]:
    """Configs that stream the row (any width, a row a block): SHARED where a row's inputs fit ``staged_bytes``
    (:func:`staged_limit` of the target's GPU), L2 always; each also keeping 2 or 4 vectors a thread in
    registers (SHARED then up to a block's own limit, one block an SM: a row neither the register file nor
    shared memory holds alone stays on chip), a ragged row held whole in registers where its threads' take it
    (``keep`` all its vectors), and each with the online max and sum where the program has them."""
    from tvmfuse.kernels.rows.stream import online_pairs

    room = _room(room, staged_bytes)
    lanes = prog.lanes()
    vectors, per = prog.cols // lanes, lanes * len(_inputs(prog))
    online = (0, 1) if online_pairs(prog) else (0,)
    base = [RowConfig(int(t), 1, 0, m) for m in (SHARED, L2) for t in threads if int(t) in _STREAM_THREADS
            if m == L2 or _staged_bytes(prog) <= room.staged_bytes]
    kept = []
    for t in sorted({int(t) for t in threads} | set(_RAGGED_THREADS)):
        steps = -(-vectors // t)
        if t in _STREAM_THREADS:
            for k in _KEEP:
                if k < steps and k * per <= _KEEP_ELEMENTS:
                    for m in (SHARED, L2):
                        c = RowConfig(t, 1, 0, m, k)
                        if m == L2 or _staged_bytes(prog, c) <= room.block_bytes:
                            kept.append(c)
        if steps * per <= _RAGGED_ELEMENTS and (prog.cols % (t * lanes) or t in _STREAM_THREADS):
            kept.append(RowConfig(t, 1, 0, SHARED, steps))   # the whole row in registers (a ragged one too)
    return [RowConfig(c.threads, 1, 0, c.mode, c.keep, o) for c in base + kept for o in online]


def default_config(prog: RowProgram, staged_bytes: int | None = None, room: Room | None = None
                   ) -> RowConfig | None:
    """The config an untuned CUDA build runs: the fewest threads a row whose slices fit (a row a warp where
    they do: no barrier), and rows a block up to 128 threads. A row no register config takes (a width no thread
    count splits into whole vectors, or a row too wide) is streamed, with the online max and sum where it has
    them: under 16384 columns, held whole in its threads' registers where the fewest threads that take it hold at
    most 32 elements each (else dlight's schedule); from 16384 columns, staged in shared memory where it fits two blocks an SM (the fewest threads
    that take it in at most 8 vectors each); else where re-reading it through L2 would overflow the L2 (two rows
    an SM in flight) and a block's shared memory with 2 or 4 vectors a thread in registers holds it, there at
    1024 threads, one block an SM; else re-read through L2 keeping 4 vectors a thread. None where no config
    fits, or none of the registers' fits a row narrower than 16384 that registers cannot hold."""
    room = _room(room, staged_bytes)
    fits = [c for c in configs(prog, room=room) if c.mode == REGISTERS]
    if fits:
        fewest = min(c.threads for c in fits)
        return max((c for c in fits if c.threads == fewest and c.threads * c.rows_per_block <= max(128, fewest)),
                   key=lambda c: c.rows_per_block)
    streamed = streamed_configs(prog, room=room)
    online = max((c.online for c in streamed), default=0)
    lanes = prog.lanes()
    vectors, per = prog.cols // lanes, lanes * len(_inputs(prog))
    ragged = [c for c in streamed if c.online == online and c.mode == SHARED and c.keep
              and c.keep * c.threads >= vectors and c.keep * per <= 32]
    if prog.cols < _STREAM_DEFAULT_FROM:
        # (from 16384 columns 32 elements a thread take 1024 threads a row and a block an SM of their registers:
        # the staged row below keeps more rows in flight). One reduction only: on the H200 the ragged row in
        # registers took RMSNorm 16384 x 4099 fp16 to 79.8 us (86% of copy; dlight 147.3) but LayerNorm, two
        # reductions and two unaligned parameter rows, to 102.1 us, where dlight took 83.8 (softmax's max and sum, an
        # online pair, count as one: dlight's softmax is far slower, 1118 us at 4096 x 50257 against 273)
        from tvmfuse.kernels.rows.stream import online_pairs

        if sum(s.kind == "reduce" for s in prog.steps) - len(online_pairs(prog)) > 1:
            return None
        return min(ragged, key=lambda c: c.threads) if ragged else None
    threads = next((t for t in _STREAM_THREADS if -(-vectors // t) <= 8), _STREAM_THREADS[-1])
    # a row staged whole: the plain passes (on the H200 the online max and sum took 2048 x 32000 softmax from 71.0
    # to 72.7 us and 4096 x 50257 from 271.5 to 293.5; on the 128256-wide rows staged with kept vectors it did not
    # cost: 172 us, 74% of the copy, where re-reading through L2 took 262)
    plain = [c for c in streamed if not c.online and not c.keep and c.threads == threads]
    if any(c.mode == SHARED for c in plain):
        return next(c for c in plain if c.mode == SHARED)
    row_bytes = _staged_bytes(prog)
    chip = [c for c in streamed if c.online == online and c.mode == SHARED and c.keep and c.threads == 1024
            and c.keep * c.threads < vectors]
    if chip and 2 * room.sm_count * row_bytes > room.l2_bytes:
        return min(chip, key=lambda c: c.keep)
    l2 = [c for c in streamed if c.online == online and c.mode == L2 and c.threads == threads]
    return max(l2, key=lambda c: c.keep)


def untuned_config(func, target=None) -> RowConfig | None:
    """:func:`default_config` of ``func``'s program on ``target``'s GPU (None: the H200): what an untuned CUDA
    build runs and the tuner measures first; None where ``func`` is not a row program or no config fits."""
    try:
        return default_config(analyze(func), room=room_for(target))
    except (Misfit, TypeError):   # (TypeError: a symbolic extent, which no config can split)
        return None


def room_for(target) -> Room:
    """The :class:`Room` of ``target``'s GPU (:func:`tvmfuse.target.device_figures`; None: the H200's)."""
    if target is None:
        return Room()
    from tvmfuse.target import device_figures

    fig = device_figures(target)
    return Room(staged_limit(fig.shared_per_sm), fig.shared_per_block - (4 << 10), fig.sm_count, fig.l2_bytes)


def room_of(info: dict) -> Room | None:
    """The :class:`Room` of a sketch's target figures (``kernels.space.sketch_info``), or None (the H200's)."""
    if not info or "shared_per_sm" not in info:
        return None
    d = Room()
    return Room(staged_limit(int(info["shared_per_sm"])),
                int(info.get("shared_per_block", d.block_bytes + (4 << 10))) - (4 << 10),
                int(info.get("sm_count", d.sm_count)), int(info.get("l2_bytes", d.l2_bytes)))


def staged_bytes_for(target) -> int:
    """:func:`staged_limit` of ``target``'s GPU (:func:`tvmfuse.target.device_figures`; None: the H200's)."""
    return room_for(target).staged_bytes
