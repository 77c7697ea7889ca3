"""The row program's configs: which thread, row and vector splits take a row, and the one an untuned build runs."""
from __future__ import annotations

from tvmfuse.kernels.rows.program import (_SHARED_ROW_BYTES, _STREAM_THREADS, L2, REGISTERS, SHARED, Misfit,
                                          RowConfig, RowProgram, _bytes, analyze)


def configs(prog: RowProgram, *, threads=(32, 64, 128, 256, 512), rows_per_block=(1, 2, 4, 8),
            max_elements: int = 64, staged_bytes: int = _SHARED_ROW_BYTES) -> list[RowConfig]:
    """The configs whose threads split the row into whole vectors, at most ``max_elements`` per thread: 16-byte
    vectors, or where no thread count takes those (a short row), the widest narrower ones some thread count
    takes."""
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
        out += streamed_configs(prog, threads, staged_bytes)
    return out


_STREAM_FROM = 4096   # columns from which the space also offers streamed rows
# columns from which a row no register config takes is streamed untuned; narrower ones keep dlight's schedule,
# which beat the streamed row there on the H200 (LayerNorm 16384 x 4099 fp16: dlight 83 us, streamed 110 us;
# softmax 2048 x 32000: dlight 237 us, streamed 71 us)
_STREAM_DEFAULT_FROM = 16384


def _staged_bytes(prog: RowProgram) -> int:
    """Bytes of one row of every whole-row input: what SHARED stages per block."""
    outs = [o.name for o in prog.outputs]
    return sum(prog.cols * _bytes(p.dtype) for p in prog.params if p.name in prog.full and p.name not in outs)


def staged_limit(shared_per_sm: int) -> int:
    """The bytes of a row a SHARED block may stage on a GPU of ``shared_per_sm`` bytes of shared memory per SM:
    two blocks an SM, less 4 KB each for the reductions' words (110 KB on the H200's 228 KB)."""
    return shared_per_sm // 2 - (4 << 10)


def streamed_configs(prog: RowProgram, threads=_STREAM_THREADS, staged_bytes: int = _SHARED_ROW_BYTES
                     ) -> list[RowConfig]:
    """Configs that stream the row (any width, a row a block): SHARED where a row's inputs fit ``staged_bytes``
    (:func:`staged_limit` of the target's GPU), L2 always."""
    modes = (SHARED, L2) if _staged_bytes(prog) <= staged_bytes else (L2,)
    return [RowConfig(int(t), 1, 0, m) for m in modes for t in threads if int(t) in _STREAM_THREADS]


def default_config(prog: RowProgram, staged_bytes: int = _SHARED_ROW_BYTES) -> RowConfig | None:
    """The config an untuned CUDA build runs: the fewest threads a row whose slices fit (a row a warp where
    they do: no barrier), and rows a block up to 128 threads; a row too wide for registers (from 16384 columns)
    streamed, staged in shared memory where it fits, with the fewest threads that take it in at most 8 vectors
    each. None where no config fits, or none of the registers' fits a row narrower than that."""
    fits = [c for c in configs(prog, staged_bytes=staged_bytes) if c.mode == REGISTERS]
    if not fits and prog.cols < _STREAM_DEFAULT_FROM:
        return None
    if not fits:
        streamed = streamed_configs(prog, staged_bytes=staged_bytes)
        vectors = prog.cols // prog.lanes()
        mode = min(c.mode for c in streamed)
        threads = next((t for t in _STREAM_THREADS if -(-vectors // t) <= 8), _STREAM_THREADS[-1])
        return next(c for c in streamed if c.mode == mode and c.threads == threads)
    fewest = min(c.threads for c in fits)
    return max((c for c in fits if c.threads == fewest and c.threads * c.rows_per_block <= max(128, fewest)),
               key=lambda c: c.rows_per_block)


def untuned_config(func, target=None) -> RowConfig | None:
    """:func:`default_config` of ``func``'s program on ``target``'s GPU (None: the H200): what an untuned CUDA
    build runs and the tuner measures first; None where ``func`` is not a row program or no config fits."""
    try:
        return default_config(analyze(func), staged_bytes_for(target))
    except (Misfit, TypeError):   # (TypeError: a symbolic extent, which no config can split)
        return None




def staged_bytes_for(target) -> int:
    """:func:`staged_limit` of ``target``'s GPU (:func:`tvmfuse.target.device_figures`; None: the H200's)."""
    if target is None:
        return _SHARED_ROW_BYTES
    from tvmfuse.target import device_figures

    return staged_limit(device_figures(target).shared_per_sm)
