"""A correct attention kernel that never writes the N×N scores: online softmax, one query row at a time.

For each (batch..., query row i) it walks the keys once, keeping the running max ``m``, the running sum
``l`` and the output accumulator ``acc[Dv]`` in local scratch (registers); a score exists only as one
local scalar. This is the llvm-correct lowering; the fast GPU schedule belongs to the GPU search space.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

SPEC_ATTR = "tvmfuse.attention_spec"  # the attention PrimFunc's spec as JSON, for the GPU template (tune/flash.py)


@dataclass(frozen=True)
class AttentionSpec:
    batch: tuple[int, ...]          # leading dims shared by Q, Kᵀ, V and the output
    seq_q: int
    seq_k: int
    head_dim: int
    head_dim_v: int
    dtype: str
    scale: float | None             # multiply scores by it (a divide is turned into its reciprocal)
    mask_shape: tuple[int, ...] | None  # broadcast to batch + (seq_q, seq_k), added before softmax
    mask_dtype: str = "float32"
    scale_first: bool = True         # scale then mask (BERT) vs mask then scale
    k_rows: bool = False             # K given as [.., seq_k, head_dim] (its transpose absorbed), else Kᵀ
    # a constant causal mask recognised (``tvmfuse.plan.causal``) and not read: query i sees key j iff
    # j <= i + causal_offset (0: top-left aligned; seq_k - seq_q: bottom-right, as a KV cache gives)
    causal: bool = False
    causal_offset: int = 0
    # query heads per K/V head (GQA / MQA): K and V have batch[-1] // kv_group heads and query head h reads
    # K/V head h // kv_group (the repeat_kv head order), so K/V are never repeated in memory
    kv_group: int = 1
    # a second tensor added to the scores where the mask is (T5's relative-position bias beside its padding mask),
    # broadcast the same way; only with a mask
    bias_shape: tuple[int, ...] | None = None
    bias_dtype: str = "float32"
    # fp32 attention computed on the tensor cores in TF32 (``--precision tf32``, ``tvmfuse.plan.tf32``); fp32 without
    # it keeps fp32's precision on the CUDA cores
    tf32: bool = False
    # with ``tf32``: each operand split into two TF32 parts and three products summed, fp32's accuracy on the tensor
    # cores (what an fp32 build on Hopper runs, ``tvmfuse.plan.tf32``'s ``x3``)
    x3: bool = False
    # the output stored with its rows before its heads, ``[*batch[:-1], seq_q, batch[-1], head_dim_v]``: the layout
    # the exporters' transpose before the output projection makes, so that transpose is no kernel of its own
    seq_major_out: bool = False

    def __post_init__(self):
        if self.bias_shape is not None and self.mask_shape is None:
            raise ValueError("a bias without a mask: the first additive term is the mask")
        if self.kv_group < 1 or (self.kv_group > 1 and (not self.batch or self.batch[-1] % self.kv_group)):
            raise ValueError(f"kv_group {self.kv_group} does not divide the {self.batch[-1:]} query heads")
        if self.causal and self.causal_offset < 0:
            raise ValueError(f"causal offset {self.causal_offset}: rows that see no key")
        if self.seq_major_out and not self.batch:
            raise ValueError("rows before heads without a head axis")

    @property
    def kv_batch(self) -> tuple[int, ...]:
        """K's and V's leading dims: ``batch`` with the last (head) axis divided by ``kv_group``."""
        return self.batch if self.kv_group == 1 else (*self.batch[:-1], self.batch[-1] // self.kv_group)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The output's shape: ``batch + (seq_q, head_dim_v)``, or with ``seq_major_out`` the rows before the heads."""
        if self.seq_major_out:
            return (*self.batch[:-1], self.seq_q, self.batch[-1], self.head_dim_v)
        return (*self.batch, self.seq_q, self.head_dim_v)

    def out_index(self, batch: list[str], row: str, col: str) -> list[str]:
        """The output element of query ``row``, column ``col`` at batch indices ``batch`` (one per batch dim)."""
        return [*batch[:-1], row, batch[-1], col] if self.seq_major_out else [*batch, row, col]

    def additive(self) -> list[tuple[str, tuple[int, ...], str]]:
        """The tensors added to the scores, as (parameter name, shape, dtype): the mask, then the bias."""
        terms = [("mask", self.mask_shape, self.mask_dtype), ("bias", self.bias_shape, self.bias_dtype)]
        return [t for t in terms if t[1] is not None]

    def term_index(self, shape: tuple[int, ...], names: list[str]) -> list[str]:
        """The index into an additive term of ``shape`` at score ``names`` (batch dims, query row, key), its
        broadcast dims read at 0."""
        full = [*self.batch, self.seq_q, self.seq_k]
        off = len(full) - len(shape)
        return ["0" if d == 1 and full[off + k] != 1 else names[off + k] for k, d in enumerate(shape)]

    def to_json(self) -> str:
        fields = asdict(self)
        # (a spec's text is part of its kernel's workload: specs without these flags keep the text they had before
        # the flags existed, and so their tuned records)
        for flag in ("tf32", "x3", "seq_major_out"):
            if not fields[flag]:
                del fields[flag]
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "AttentionSpec":
        d = json.loads(text)
        d["batch"] = tuple(d["batch"])
        for k in ("mask_shape", "bias_shape"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)


def key_vector(seq_k: int, dtype: str) -> int:
    """Elements of Kᵀ (``[d, key]``) the flash kernels copy at a time: 16 bytes where rows of ``seq_k`` keys keep
    such vectors aligned, else the widest power of two dividing ``seq_k`` (ViT's 197 keys: one)."""
    width = 16 // (4 if dtype == "float32" else 2)
    while seq_k % width:
        width //= 2
    return width


def tiled_gpu_misfit(spec: AttentionSpec) -> str | None:
    """Why the tensor-core flash template (``tvmfuse.tune.flash``) cannot compute ``spec`` (None: it can).

    Its fragments are 16 wide (8 in TF32); fp16 in (or fp32 marked ``tf32``), fp32 accumulate; a thread keeps a
    16-row slice of the output accumulator in registers, which caps the head dims at 128. Sequences of any length:
    a ragged last tile of rows or keys is guarded. Every spec this accepts has at least one tile config
    (``tvmfuse.kernels.flash.configs``).
    """
    if spec.dtype != "float16" and not (spec.dtype == "float32" and spec.tf32):
        return f"{spec.dtype} inputs (the tensor-core template takes fp16, or fp32 under --precision tf32)"
    width = 8 if spec.tf32 else 16
    if spec.head_dim % width or spec.head_dim_v % width or max(spec.head_dim, spec.head_dim_v) > 128:
        return f"head dims {spec.head_dim}/{spec.head_dim_v} (the template takes multiples of {width} up to 128)"
    if spec.tf32 and spec.x3 and spec.head_dim + spec.head_dim_v // 2 > X3_HEAD_DIMS:
        return (f"head dims {spec.head_dim}/{spec.head_dim_v} in three TF32 products (Q's parts, P and O overflow a "
                f"thread's registers past head dim + half the value head dim {X3_HEAD_DIMS})")
    return None


# The x3 TF32 flash kernel's register count at its narrowest key step (32 keys): head_dim / 2 * 2 + 32 +
# head_dim_v / 2 + 12 within its cap of 190 (``kernels.flash.tf32``: registers, X3_REGISTERS), which the planner
# may not import: tests/kernels/test_flash_tf32.py holds the two answers together
X3_HEAD_DIMS = 146


def simt_gpu_misfit(spec: AttentionSpec) -> str | None:
    """Why the CUDA-core flash kernel (``tvmfuse.kernels.flash.simt``) cannot compute ``spec`` (None: it can).

    It takes fp32 (where no tensor-core kernel is exact to fp32), any sequence lengths (ragged tiles are guarded)
    and head dims in multiples of 4 (K and V are read 4 floats at a time) whose query row and output fit one
    thread's registers, at most 160 floats together.
    """
    if spec.dtype != "float32":
        return f"{spec.dtype} inputs (the CUDA-core flash kernel takes fp32)"
    if spec.head_dim % 4 or spec.head_dim_v % 4:
        return f"head dims {spec.head_dim}/{spec.head_dim_v} (the CUDA-core flash kernel takes multiples of 4)"
    if spec.head_dim + spec.head_dim_v > 160:
        return (f"head dims {spec.head_dim}/{spec.head_dim_v} (a query row and its output must fit 160 of a "
                f"thread's registers)")
    return None


def gpu_misfit(spec: AttentionSpec) -> str | None:
    """Why no flash kernel on CUDA computes ``spec`` (None: the tensor-core one or the CUDA-core one does)."""
    tiled = tiled_gpu_misfit(spec)
    if tiled is None:
        return None
    simt = simt_gpu_misfit(spec)
    return None if simt is None else f"{tiled}; {simt}"


def _idx(names: list[str]) -> str:
    return ", ".join(names)


def attention_primfunc(spec: AttentionSpec):
    """A TIR PrimFunc ``(q, kt, v[, mask[, bias]], out)`` computing softmax(scale·q@kt + mask + bias) @ v; with
    ``causal`` row i walks keys 0 .. i + causal_offset only (there is no mask argument), and with ``kv_group`` > 1
    K and V have ``kv_batch`` heads and query head h reads head h // kv_group."""
    nb = len(spec.batch)
    bvars = [f"b{k}" for k in range(nb)]
    vb = [f"v_b{k}" for k in range(nb)]
    shape = lambda *tail: "(" + ", ".join(str(d) for d in (*spec.batch, *tail)) + ",)"  # noqa: E731
    kv_shape = lambda *tail: "(" + ", ".join(str(d) for d in (*spec.kv_batch, *tail)) + ",)"  # noqa: E731
    # K/V's batch indices: the query head's K/V head h // kv_group
    kvb = vb if spec.kv_group == 1 else [*vb[:-1], f"{vb[-1]} // {spec.kv_group}"]
    acc_t = "float32"
    cast = (lambda e: e) if spec.dtype == acc_t else (lambda e: f"T.Cast('{acc_t}', {e})")
    params = [f"q: T.Buffer({shape(spec.seq_q, spec.head_dim)}, '{spec.dtype}')",
              (f"kt: T.Buffer({kv_shape(spec.seq_k, spec.head_dim)}, '{spec.dtype}')" if spec.k_rows else
               f"kt: T.Buffer({kv_shape(spec.head_dim, spec.seq_k)}, '{spec.dtype}')"),
              f"v: T.Buffer({kv_shape(spec.seq_k, spec.head_dim_v)}, '{spec.dtype}')"]
    terms = []
    for name, ms, mdt in spec.additive():
        params.append(f"{name}: T.Buffer(({', '.join(str(d) for d in ms)},), '{mdt}')")
        at = f"{name}[{_idx(spec.term_index(ms, vb + ['v_i', 'j']))}]"
        terms.append(at if mdt == acc_t else f"T.Cast('{acc_t}', {at})")
    mask_expr = " + ".join(terms)
    if len(terms) > 1:
        mask_expr = f"({mask_expr})"
    params.append(f"out: T.Buffer({spec.out_shape!r}, '{spec.dtype}')")
    score = f"s[0] * T.float32({spec.scale!r})" if spec.scale is not None else "s[0]"
    if mask_expr:
        score = f"({score}) + {mask_expr}" if spec.scale_first else (
            f"(s[0] + {mask_expr}) * T.float32({spec.scale!r})" if spec.scale is not None else f"s[0] + {mask_expr}")
    loops = "".join(f"for {b} in T.serial({n}):\n" + "    " * (k + 2) for k, (b, n) in enumerate(zip(bvars, spec.batch)))
    ind = "    " * (nb + 2)
    out_idx = _idx(spec.out_index(vb, "v_i", "e"))
    key_step = f"""{ind}        s[0] = T.float32(0)
{ind}        for d in T.serial({spec.head_dim}):
{ind}            s[0] = s[0] + {cast(f"q[{_idx(vb + ['v_i', 'd'])}]")} * {cast(f"kt[{_idx(kvb + (['j', 'd'] if spec.k_rows else ['d', 'j']))}]")}
{ind}        s[0] = {score}
{ind}        p[0] = T.max(m[0], s[0])
{ind}        l[0] = l[0] * T.exp(m[0] - p[0]) + T.exp(s[0] - p[0])
{ind}        for e in T.serial({spec.head_dim_v}):
{ind}            acc[e] = acc[e] * T.exp(m[0] - p[0]) + T.exp(s[0] - p[0]) * {cast(f"v[{_idx(kvb + ['j', 'e'])}]")}
{ind}        m[0] = p[0]
"""
    if spec.causal:
        # row i computes only the keys it sees (a guard, not a shorter loop: MetaSchedule's llvm space and its
        # features take only constant loop extents)
        key_step = f"{ind}        if j <= v_i + {spec.causal_offset}:\n" + "".join(
            "    " + ln + "\n" for ln in key_step.splitlines() if ln.strip())
    src = f"""
@T.prim_func(private=True, s_tir=True)
def attention({', '.join(params)}):
    T.func_attr({{"tirx.noalias": True, "tvmfuse.kernel": "attention", "{SPEC_ATTR}": {spec.to_json()!r}}})
    {loops}for i in T.serial({spec.seq_q}):
{ind}with T.sblock("attention"):
{ind}    {_idx(vb + ['v_i'])} = T.axis.remap("{'S' * (nb + 1)}", [{_idx(bvars + ['i'])}])
{ind}    m = T.sblock_alloc_buffer((1,), "float32", scope="local")
{ind}    l = T.sblock_alloc_buffer((1,), "float32", scope="local")
{ind}    s = T.sblock_alloc_buffer((1,), "float32", scope="local")
{ind}    p = T.sblock_alloc_buffer((1,), "float32", scope="local")
{ind}    acc = T.sblock_alloc_buffer(({spec.head_dim_v},), "float32", scope="local")
{ind}    m[0] = T.float32(-3.4e38)
{ind}    l[0] = T.float32(0)
{ind}    for e in T.serial({spec.head_dim_v}):
{ind}        acc[e] = T.float32(0)
{ind}    for j in T.serial({spec.seq_k}):
{key_step}{ind}    for e in T.serial({spec.head_dim_v}):
{ind}        out[{out_idx}] = {"acc[e] / l[0]" if spec.dtype == acc_t else f"T.Cast('{spec.dtype}', acc[e] / l[0])"}
"""
    from tvm.script import tirx as T  # noqa: F401  (the template's T)

    ns = {"T": T}
    func = _parse(src, ns)
    return func


def _parse(src: str, ns: dict):
    import tvm.script

    return tvm.script.parse(src, extra_vars=ns)
