"""The wgmma kernel's scalar twin: the same addressing and epilogue, one output element per iteration, built for
the CPU to check a kernel's spec and epilogue where wgmma cannot run."""
from __future__ import annotations

from tvmfuse.kernels.wgmma.analysis import _param_decls, analyze
from tvmfuse.kernels.wgmma.layout import _a_read, _batch_offsets
from tvmfuse.kernels.wgmma.ptx import _indent, parse
from tvmfuse.kernels.wgmma.spec import GemmSpec


def reference_source(spec: GemmSpec, params: list[str], a: str, b: str, store: str) -> str:
    """TVMScript of a scalar twin of :func:`gemm_source` for any target: the same flat A/B addressing (batch
    folding included) and the same ``store``, one output element per iteration. Built for the CPU, it checks
    a kernel's spec and epilogue translation numerically where wgmma cannot run."""
    M, N, K = spec.rows, spec.n, spec.k
    _, b_batch = _batch_offsets(spec)
    b_at = f"{b_batch} + col * {K} + kk" if spec.b_kmajor else f"{b_batch} + kk * {N} + col"
    tail = M % 64 != 0   # rows run on to a whole 64-row tile, through the kernel's predicates
    step = 64 if spec.dtype == "float16" else 32   # K per stage: 128 bytes of a row
    dtype = "float16" if spec.dtype == "float16" else "float32"
    pred, a_at = _a_read(spec, "row", f"kk // {step} * {step}", f"kk % {step}", tail)
    if "{acc0}" in store:   # gated: one output of an even column and the next, stored once both sums are in
        h = "col % 2"
        stored = "if col % 2 == 1:\n" + _indent(store.format(bz="bz", row="row", col="(col - 1)", acc0="acc[0]",
                                                             acc1="acc[1]"), 4)
    else:
        h, stored = "0", store.format(bz="bz", row="row", col="col", acc="acc[0]")
    mac = f"acc[{h}] = acc[{h}] + T.Cast('float32', af[{a_at}]) * T.Cast('float32', bf[{b_at}])"
    if pred is not None:
        mac = f"if {pred}:\n    {mac}"
    if tail:
        stored = f"if row < {M}:\n" + _indent(stored, 4)
    return f"""
@T.prim_func(s_tir=True)
def main({", ".join(params)}):
    T.func_attr({{"tirx.noalias": True}})
    acc = T.alloc_buffer((2,), "float32")
    af = T.decl_buffer(({spec.a_elements},), "{dtype}", data={a}.data)
    bf = T.decl_buffer(({(spec.grid_batch if spec.b_batched else 1) * N * K},), "{dtype}", data={b}.data)
    for bz, row, col in T.grid({spec.grid_batch}, {-(-M // 64) * 64}, {N}):
        acc[{h}] = T.float32(0)
        for kk in range({K}):
{_indent(mac, 12)}{_indent(stored, 8)}"""


def reference_for(func):
    """The scalar twin (:func:`reference_source`) of ``func``'s wgmma kernel, its parameters as the kernel's."""
    spec, info = analyze(func, gated=True)
    return parse(reference_source(spec, _param_decls(func), f"p{info['a']}", f"p{info['b']}", info["store"]))
