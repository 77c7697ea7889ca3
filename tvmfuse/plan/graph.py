"""The dataflow graph the planner reasons about: one node per binding of the legalized Relax ``main``.

Every ``R.call_tir`` node is one kernel when unfused; its HBM bytes are its tensor arguments read once
and its output written once. Other bindings (tuples, ``TupleGetItem``, shape values) are not kernels and
never fuse.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from tvmfuse._tvm import PrimFunc, RelaxConstant, TensorType, TupleType, relax, tvm

# TVM's op patterns (``relay/op_attr_types.h``): what AnnotateTIROpPattern writes on each PrimFunc
ELEMWISE, BROADCAST, INJECTIVE, COMM_REDUCE, OUT_EWISE_FUSABLE, TUPLE, OPAQUE = 0, 1, 2, 3, 4, 7, 8

GEMM_OPS = ("matmul", "dense", "batch_matmul", "linear")
CONV_OPS = ("conv1d", "conv2d", "conv3d", "conv2d_transpose", "conv1d_transpose")
NORM_OPS = ("layer_norm", "rms_norm", "group_norm", "softmax", "log_softmax", "instance_norm")
ACTIVATION_OPS = ("sigmoid", "tanh", "erf", "relu", "gelu", "gelu_tanh", "silu", "exp", "clip", "fast_tanh")

# Node kinds: how a node may take part in a fused kernel
POINTWISE = "pointwise"    # elementwise / broadcast: fuses anywhere its iteration space matches
INJECTIVE_K = "injective"  # layout ops (reshape, transpose, slice): fuse with pointwise chains
REDUCE = "reduce"          # plain reductions (sum, mean, max): row statistics of a decomposed norm
GEMM = "gemm"              # matmul / batched matmul: anchor with a pointwise epilogue
CONV = "conv"              # convolution: anchor with a pointwise epilogue
NORM = "norm"              # layer_norm / rms_norm / softmax: anchor with prologue and epilogue
ATTENTION = "attention"    # tvmfuse's fused attention kernel: complete, takes nothing more
OPAQUE_K = "opaque"        # anything the kernel generator cannot fuse
NOT_KERNEL = "none"        # tuples, TupleGetItem, shape values

ANCHORS = (GEMM, CONV, NORM, ATTENTION)


def op_name(global_name: str) -> str:
    """``add3`` -> ``add``, ``tir_sqrt`` -> ``sqrt``: the operator a legalized PrimFunc implements."""
    name = re.sub(r"\d+$", "", global_name)
    name = name[4:] if name.startswith("tir_") else name
    return name.rstrip("_") or global_name


def tensor_bytes(sinfo) -> int:
    """Bytes of a static-shaped tensor struct info (0 when not a tensor or not static)."""
    if isinstance(sinfo, TupleType):
        return sum(tensor_bytes(f) for f in sinfo.fields)
    if not isinstance(sinfo, TensorType) or sinfo.shape is None:
        return 0
    try:
        n = int(np.prod([int(d) for d in sinfo.shape.values], dtype=np.int64))
    except (TypeError, AttributeError):
        return 0
    return n * np.dtype(str(sinfo.dtype)).itemsize


def tensor_shape(sinfo) -> tuple[int, ...] | None:
    if not isinstance(sinfo, TensorType) or sinfo.shape is None:
        return None
    try:
        return tuple(int(d) for d in sinfo.shape.values)
    except (TypeError, AttributeError):
        return None


@dataclass(eq=False)
class Node:
    """One binding of ``main``'s dataflow block."""

    index: int
    var: relax.Var
    value: relax.Expr
    op: str
    kind: str
    inputs: tuple[relax.Var, ...] = ()          # tensor vars it reads (graph edges)
    consts: tuple[RelaxConstant, ...] = ()     # constant tensors it reads
    out_bytes: int = 0
    out_shape: tuple[int, ...] | None = None
    users: list["Node"] = field(default_factory=list)
    column_pairs: bool = False   # a gated GEMM's g or u, every other column of it (rewrites.gated_gemm)

    @property
    def is_kernel(self) -> bool:
        return self.kind != NOT_KERNEL

    @property
    def in_bytes(self) -> int:
        return sum(tensor_bytes(v.ty) for v in self.inputs) + sum(
            tensor_bytes(c.ty) for c in self.consts)

    @property
    def bytes_unfused(self) -> int:
        """HBM bytes as its own kernel: every input read once, the output written once."""
        return self.in_bytes + self.out_bytes

    def __repr__(self) -> str:
        return f"Node({self.index}:{self.op})"


def _kind(op: str, func) -> str:
    if isinstance(func, PrimFunc):
        if func.attrs is not None and "tvmfuse.kernel" in func.attrs:
            return str(func.attrs["tvmfuse.kernel"])
        pattern = int(func.attrs["op_pattern"]) if func.attrs is not None and "op_pattern" in func.attrs else OPAQUE
    else:
        return OPAQUE_K
    if any(op == g or op.startswith(g + "_") for g in GEMM_OPS):
        return GEMM
    if any(op.startswith(c) for c in CONV_OPS):
        return CONV
    if any(op == n or op.startswith(n) for n in NORM_OPS):
        return NORM
    if op in ("sum", "mean", "max", "min", "prod", "variance", "std", "argmax", "argmin"):
        return REDUCE if op not in ("argmax", "argmin") else OPAQUE_K
    if op in ("strided_slice", "take", "split", "dynamic_strided_slice", "gather_elements", "gather_nd"):
        return INJECTIVE_K  # reads part of its input: never a same-shape pointwise op
    if op in ("pad", "pad_channels"):
        # TOPI's pad reads each input element once into a larger output, but TVM's pattern annotation calls it
        # elementwise or broadcast, which the legality read as a broadcast and kept out of its producer's kernel
        return INJECTIVE_K
    if pattern in (ELEMWISE, BROADCAST):
        return POINTWISE
    if pattern == INJECTIVE:
        return INJECTIVE_K
    if pattern == COMM_REDUCE:
        return REDUCE
    return OPAQUE_K


@dataclass
class Graph:
    """Nodes in binding (topological) order, plus where each var is defined."""

    mod: tvm.IRModule
    nodes: list[Node]
    producer: dict  # relax.Var -> Node
    outputs: set  # vars that leave the dataflow block (block outputs)

    @property
    def kernels(self) -> list[Node]:
        return [n for n in self.nodes if n.is_kernel]


def every_other_column(func) -> bool:
    """Whether a legalized ``strided_slice`` PrimFunc keeps every other column of its input's last axis and all
    of the other axes: ``out[.., j] = in[.., 2 * j + h]``, ``h`` 0 or 1."""
    from tvm import sym

    try:
        sch = tvm.s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except Exception:  # noqa: BLE001 - a PrimFunc of another form: not such a slice
        return False
    if len(blocks) != 1:
        return False
    body = sch.get(blocks[0])
    store = getattr(body, "body", None)
    if type(store).__name__ != "BufferStore" or type(store.value).__name__ not in ("BufferLoad", "TensorLoad"):
        return False
    load = store.value
    out_idx, in_idx = list(store.indices), list(load.indices)
    if len(out_idx) != len(in_idx) or not out_idx or any(not a.same_as(b) for a, b in zip(out_idx[:-1], in_idx)):
        return False
    last = out_idx[-1]
    if type(last).__name__ != "Var":
        return False
    coef = sym.detect_linear_equation(in_idx[-1], [last])
    if len(coef) != 2 or not all(type(c).__name__ == "IntImm" for c in coef):
        return False
    src = load.source if hasattr(load, "source") else load.buffer
    return (int(coef[0].value), int(coef[1].value)) in ((2, 0), (2, 1)) and \
        int(src.shape[-1]) == 2 * int(store.buffer.shape[-1])


def _vars_in(expr) -> list[relax.Var]:
    found: list[relax.Var] = []

    def visit(e):
        if isinstance(e, relax.Var) and not any(e.same_as(v) for v in found):
            found.append(e)

    relax.analysis.post_order_visit(expr, visit)
    return found


def build_graph(mod: tvm.IRModule, *, func_name: str = "main", column_pairs: set = frozenset()) -> Graph:
    """The graph of ``func_name``'s (single) dataflow block in a legalized module. ``column_pairs``: the names of
    the slices a gated GEMM's epilogue reads as column pairs (``rewrites.gated_gemm``), where they are such a
    slice; a model's own stride-2 slices (an interleaved rotary embedding's) stay out of GEMM epilogues."""
    func = mod[func_name]
    blocks = [b for b in func.body.blocks if isinstance(b, relax.DataflowBlock)]
    if len(blocks) != 1:
        raise ValueError(f"{func_name} has {len(blocks)} dataflow blocks; the planner expects one")
    call_tir = tvm.ir.Op.get("relax.call_tir")
    nodes: list[Node] = []
    producer: dict = {}
    for i, binding in enumerate(blocks[0].bindings):
        value = binding.value
        if isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call) and value.op.same_as(call_tir):
            gv = value.args[0]
            callee = mod[gv]
            op = op_name(gv.name_hint)
            args = list(value.args[1].fields)
            inputs = tuple(a for a in args if isinstance(a, relax.Var))
            consts = tuple(a for a in args if isinstance(a, RelaxConstant))
            kind = _kind(op, callee)
            if len(value.args) > 2:  # symbolic-shape arguments: leave alone
                kind = OPAQUE_K
        else:
            op = type(value).__name__.lower()
            inputs = tuple(_vars_in(value))
            consts = ()
            kind = NOT_KERNEL
        node = Node(index=i, var=binding.var, value=value, op=op, kind=kind, inputs=inputs, consts=consts,
                    out_bytes=tensor_bytes(binding.var.ty) if kind != NOT_KERNEL else 0,
                    out_shape=tensor_shape(binding.var.ty),
                    column_pairs=str(binding.var.name) in column_pairs and op == "strided_slice"
                    and kind == INJECTIVE_K and every_other_column(callee))
        nodes.append(node)
        producer[binding.var] = node
    for node in nodes:
        for v in node.inputs:
            p = producer.get(v)
            if p is not None and node not in p.users:
                p.users.append(node)
    out_vars = {b.var for b in blocks[0].bindings if not isinstance(b.var, relax.DataflowVar)}
    return Graph(mod=mod, nodes=nodes, producer=producer, outputs=out_vars)


def substitute(expr, vmap: dict):
    """Replace variables by ``vmap`` in the small expressions a dataflow binding holds."""
    if isinstance(expr, (relax.Var, RelaxConstant)):
        return vmap.get(expr, expr)
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [substitute(a, vmap) for a in expr.args], expr.attrs, ty_args=expr.ty_args)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([substitute(f, vmap) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(substitute(expr.tuple_value, vmap), expr.index)
    return expr


def _param_bytes(param) -> int:
    # TVM 0.27: a PrimFunc's tensor parameters carry their shape and dtype (no buffer_map)
    shape = getattr(param, "shape", None)
    if shape is None:
        return 0
    n = 1
    for d in shape:
        n *= int(d)
    return n * np.dtype(str(param.dtype)).itemsize


def static_params(func: PrimFunc) -> bool:
    """Whether every parameter's shape is a constant (topi's GPU scans take any shape: symbolic dims)."""
    return all(isinstance(d, (int, tvm.tirx.IntImm)) for p in func.params for d in (getattr(p, "shape", None) or ()))


def kernel_bytes(func: PrimFunc) -> int:
    """HBM bytes a kernel moves at best: each parameter buffer read or written once."""
    return sum(_param_bytes(p) for p in func.params)


def kernel_calls(main) -> dict:
    """{kernel GlobalVar: [the arguments of each of its calls]} over the Relax function ``main``, in order."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    calls: dict = {}

    @relax.expr_functor.visitor
    class Calls(relax.PyExprVisitor):
        def visit_call_(self, call):  # noqa: N802 - the visitor's name
            if call.op.same_as(call_tir) and isinstance(call.args[0], tvm.ir.GlobalVar):
                args = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else [call.args[1]]
                calls.setdefault(call.args[0], []).append(list(args))
            super().visit_call_(call)

    Calls().visit_expr(main.body)
    return calls
