"""The second kernel of a K split, shared by the templates that split K over blocks (the GEMV's, wgmma's): each
thread one output element, the sum of the blocks' fp32 partials, stored by the kernel's epilogue."""
from __future__ import annotations

from tvmfuse.kernels.wgmma.ptx import _indent

THREADS = 256   # a block of the sum


def split_sum(rows: int, cols: int, splits: int, store: str, emulate: bool = False) -> str:
    """TVMScript of the sum of ``splits`` partials ``part[sp * rows * cols + e]`` of a ``rows x cols`` output, each
    element stored by ``store`` (a format string: ``{row}``, ``{col}``, ``{acc}``, and ``{bz}`` 0: the split
    kernels are unbatched). ``emulate``: the threads as serial loops (the GEMV template's CPU emulation)."""
    total, e = rows * cols, f"(rb * {THREADS} + rt)"
    red = (f"racc[0] = T.float32(0)\nfor sp in {'T.serial' if emulate else 'T.unroll'}({splits}):\n"
           f"    racc[0] = racc[0] + part[sp * {total} + {e}]\n"
           + store.format(bz="0", row=f"({e} // {cols})", col=f"({e} % {cols})", acc="racc[0]") + "\n")
    red = f"if {e} < {total}:\n" + _indent(red, 4)
    scope = "" if emulate else ", scope='local'"
    loops = (f"for rb, rt in T.grid({-(-total // THREADS)}, {THREADS}):\n" if emulate else
             f"for rb in T.thread_binding({-(-total // THREADS)}, thread='blockIdx.x'):\n"
             f"    for rt in T.thread_binding({THREADS}, thread='threadIdx.x'):\n")
    return loops + _indent(f"racc = T.alloc_buffer((1,), 'float32'{scope})\n" + red, 4 if emulate else 8)
