"""The PTX the wgmma kernels need beyond TVM's ops, as device functions of our own (``T.cuda.func_call`` with
their source), the ``wgmma.mma_async`` statement, and the parser that puts those sources in the TVMScript's scope."""
from __future__ import annotations

import functools

# A 16-byte cp.async to a shared address that reads nothing and writes 16 zero bytes where ``valid`` is 0
# (PTX's src-size operand): a predicated copy without a branch. TVM 0.27's raw cp.async op takes no predicate
# from TVMScript, so this is a function of our own (``T.cuda.func_call`` with its source; fp16 elements).
ZFILL = "tvmfuse_cp_async_zfill"
_ZFILL_SOURCE = f"""
__forceinline__ __device__ void {ZFILL}(unsigned int dst, void* src, int src_off, int valid) {{
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(dst), "l"((const char*)src + (long long)src_off * 2), "r"(valid * 16));
}}
"""


# 16 bytes of shared memory (4 fp32) rounded in place to TF32, to nearest (ties away; PTX's cvt.rna.tf32.f32).
# wgmma reads an fp32 operand's top 19 bits and drops the rest: truncation, toward zero, a bias every product
# shares (a random-weight ResNet-50 in TF32 came 8.7e-2 off fp32, against cuDNN's 2.1e-2); rounded first, the
# operands are what cuBLAS and cuDNN read.
ROUND_TF32 = "tvmfuse_round_tf32_16b"
_ROUND_TF32_SOURCE = f"""
__forceinline__ __device__ void {ROUND_TF32}(unsigned int at) {{
  unsigned int x0, x1, x2, x3;
  asm volatile("ld.shared.v4.b32 {{%0, %1, %2, %3}}, [%4];" : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3) : "r"(at));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(x0) : "f"(__uint_as_float(x0)));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(x1) : "f"(__uint_as_float(x1)));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(x2) : "f"(__uint_as_float(x2)));
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(x3) : "f"(__uint_as_float(x3)));
  asm volatile("st.shared.v4.b32 [%0], {{%1, %2, %3, %4}};" :: "r"(at), "r"(x0), "r"(x1), "r"(x2), "r"(x3) : "memory");
}}
"""


# 16 bytes of shared memory (4 fp32) split in place into two TF32 parts: the value rounded to TF32 (``big``) stays,
# and what it lost, ``x - big`` (exact in fp32), rounded to TF32 (``small``), goes to ``lo``: big + small carries 22
# of the value's 24 mantissa bits, so three products (big.big, big.small, small.big) give fp32's accuracy on the
# tensor cores (the 3xTF32 of NVIDIA's CUTLASS). An infinity or NaN keeps its small part 0 (not inf - inf).
SPLIT_TF32 = "tvmfuse_split_tf32_16b"
_SPLIT_TF32_SOURCE = f"""
__forceinline__ __device__ void {SPLIT_TF32}(unsigned int at, unsigned int lo) {{
  unsigned int x[4], big[4], small[4];
  asm volatile("ld.shared.v4.b32 {{%0, %1, %2, %3}}, [%4];" : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "r"(at));
  #pragma unroll
  for (int i = 0; i < 4; ++i) {{
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(big[i]) : "f"(__uint_as_float(x[i])));
    float rest = __uint_as_float(x[i]) - __uint_as_float(big[i]);
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(small[i]) : "f"(isfinite(rest) ? rest : 0.0f));
  }}
  asm volatile("st.shared.v4.b32 [%0], {{%1, %2, %3, %4}};"
               :: "r"(at), "r"(big[0]), "r"(big[1]), "r"(big[2]), "r"(big[3]) : "memory");
  asm volatile("st.shared.v4.b32 [%0], {{%1, %2, %3, %4}};"
               :: "r"(lo), "r"(small[0]), "r"(small[1]), "r"(small[2]), "r"(small[3]) : "memory");
}}
"""


# An fp32 value's TF32 parts in registers (the x3 kernel's A fragments under ``a_regs``): the big part rounded to
# nearest, and the rest rounded (0 where the value is not finite, as SPLIT_TF32)
TF32_PARTS = "tvmfuse_tf32_parts"
_TF32_PARTS_SOURCE = f"""
__forceinline__ __device__ unsigned int {TF32_PARTS}(float x, int small) {{
  unsigned int big, rest;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(big) : "f"(x));
  float r = x - __uint_as_float(big);
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(rest) : "f"(isfinite(r) ? r : 0.0f));
  return small ? rest : big;
}}
"""


# A register fence (CUTLASS's warpgroup_fence_operand): an empty volatile asm that reads and writes ``x`` in place,
# so that no read of an accumulator the wgmmas wrote asynchronously is moved above the wait for them (volatile asm
# statements keep their order; a plain read of the register may otherwise be scheduled anywhere after the wgmma)
FENCE_F32 = "tvmfuse_fence_f32"
_FENCE_F32_SOURCE = f"""
__forceinline__ __device__ void {FENCE_F32}(float& x) {{
  asm volatile("" : "+f"(x) :: "memory");
}}
"""


def _indent(text: str, n: int) -> str:
    return "".join(" " * n + line + "\n" if line.strip() else "\n" for line in text.splitlines())


def wgmma_issue(n: int, accs: str, a: str, b: str, flags: str, dtype: str = "float16", accumulate: bool = True) -> str:
    """One wgmma statement over 32 bytes of K, fp32 accumulate: ``m64n{n}k16`` of fp16, or ``m64n{n}k8`` of TF32
    (``dtype`` ``tf32``: fp32 operands, K-major, no transpose immediates). ``accs`` the accumulators, ``a`` a
    descriptor or four A registers, ``b`` B's descriptor, ``flags`` the trailing scale/transpose immediates;
    ``accumulate`` False: the product replaces the accumulators (scale-d 0)."""
    d = int(accumulate)
    if dtype in ("tf32", "tf32x3"):
        return (f"T.evaluate(T.ptx.wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32({accs}, {a}, {b}, "
                f"T.ptx.pred({d}), {flags}))\n")
    return (f"T.evaluate(T.ptx.wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16({accs}, {a}, {b}, "
            f"T.ptx.pred({d}), {flags}))\n")


def _setmaxnreg(name: str, op: str, regs: int) -> dict[str, str]:
    """The device function ``name``: ``setmaxnreg.{op}`` to ``regs`` registers a thread of the warpgroup."""
    return {name: f"""
__forceinline__ __device__ void {name}() {{
  asm volatile("setmaxnreg.{op}.sync.aligned.u32 {regs};" ::: "memory");
}}
"""}


# The TMA kernel's PTX, as device functions of our own (``T.cuda.func_call`` with this source): mbarriers in
# shared memory (32-bit shared addresses), a wait that spins on try_wait inside the asm (its labels are local to
# the braces), an arrive predicated without a branch, and the 3-D and 4-D tiled TMA loads that complete on an
# mbarrier. The wait and the arrive, which run between wgmmas, take no "memory" clobber (volatile asm statements
# keep their order among themselves, wgmmas included; a clobber tells the compiler the asm may read the
# accumulator array). Dropping it was tried against the wrong results of TMA kernels with a batch in flight (H200)
# and did not change them; those kernels are not offered (:func:`configs`).
_TMA_SOURCE = {
    "tvmfuse_mbar_init": r"""
__forceinline__ __device__ void tvmfuse_mbar_init(unsigned int bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
""",
    "tvmfuse_mbar_init_fence": r"""
__forceinline__ __device__ void tvmfuse_mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
""",
    "tvmfuse_mbar_expect_tx": r"""
__forceinline__ __device__ void tvmfuse_mbar_expect_tx(unsigned int bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
""",
    "tvmfuse_mbar_arrive_if": r"""
__forceinline__ __device__ void tvmfuse_mbar_arrive_if(unsigned int bar, int pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}"
               :: "r"(bar), "r"(pred));
}
""",
    "tvmfuse_mbar_wait": r"""
__forceinline__ __device__ void tvmfuse_mbar_wait(unsigned int bar, int parity) {
  asm volatile("{\n.reg .pred p;\nTVMFUSE_WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               "@!p bra.uni TVMFUSE_WAIT;\n}" :: "r"(bar), "r"(parity));
}
""",
    # Hopper's warpgroup register reallocation: the producer gives registers back, the computing warpgroups take
    # them (two computing warpgroups: 2 x 128 x 232 + 128 x 40 = 64512 of the SM's 65536)
    **_setmaxnreg("tvmfuse_regs_take", "inc", 232), **_setmaxnreg("tvmfuse_regs_give", "dec", 40),
    # a value through an empty volatile asm, which keeps its order among the other volatile asm statements (wgmma's
    # fence): P's packed registers pinned before the fence, not computed by nvcc after it (ptxas then injects a
    # warpgroup.arrive before each wgmma that reads them, and serializes them on a divergent path, C7520)
    "tvmfuse_pin": r"""
__forceinline__ __device__ unsigned int tvmfuse_pin(unsigned int x) {
  asm volatile("" : "+r"(x));
  return x;
}
""",
    # named barriers (ids 1-15; 0 is __syncthreads): a warpgroup waits for its turn with sync, and hands the turn on
    # with arrive, which does not wait; ids and the arrive's predicate are registers, so no branch lies between
    # wgmmas (ptxas serializes wgmmas after a divergent path, C7520)
    "tvmfuse_bar_sync": r"""
__forceinline__ __device__ void tvmfuse_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count));
}
""",
    "tvmfuse_bar_arrive_if": r"""
__forceinline__ __device__ void tvmfuse_bar_arrive_if(int id, int count, int pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p bar.arrive %0, %1;\n}"
               :: "r"(id), "r"(count), "r"(pred));
}
""",
    # the flash kernel's two computing warpgroups: 2 x 128 x 224 + 128 x 56 = 64512 of the SM's 65536 registers (at
    # head dim 128 computing warpgroups of 232 spilled)
    **_setmaxnreg("tvmfuse_regs_take_224", "inc", 224), **_setmaxnreg("tvmfuse_regs_give_56", "dec", 56),
    "tvmfuse_tma_load_4d": r"""
__forceinline__ __device__ void tvmfuse_tma_load_4d(unsigned int dst, unsigned long long map, int c0, int c1, int c2,
                                                    int c3, unsigned int bar) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5}], [%6];"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
""",
    "tvmfuse_tma_load_3d": r"""
__forceinline__ __device__ void tvmfuse_tma_load_3d(unsigned int dst, unsigned long long map, int c0, int c1, int c2,
                                                    unsigned int bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
""",
}


def _ptx(fn: str, *args: str) -> str:
    """A statement calling one of :data:`_TMA_SOURCE`'s functions (TVM emits a function's source once per name)."""
    return f"T.evaluate(T.cuda.func_call({', '.join([repr(fn), *args])}, source_code=_TMA_SOURCE[{fn!r}]))\n"


@functools.lru_cache(maxsize=256)
def parse(source: str):
    """The PrimFunc of TVMScript text ``source``, kept by its text: TVMScript's parser takes a tenth of a second to
    seconds a kernel, and the same text comes back (a template's kernel for a config asked for again, a sketch's
    annotated kernel read at each build of its candidates, a record's trace replayed by the warm start). A PrimFunc
    is immutable (``with_attr`` makes a new one), so the one parsed serves every caller."""
    from tvmfuse._tvm import tvm
    from tvm.script import tirx as T

    return tvm.script.parse(source, extra_vars={"T": T, "_TMA_SOURCE": _TMA_SOURCE})
