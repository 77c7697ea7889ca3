"""The precision a model is compiled in (``--precision``): its own types, or fp16 with fp32 where it matters.

fp16 converts the ONNX graph with onnxconverter-common's float16 converter, the converter onnxruntime's own
tools use, rather than Relax's ToMixedPrecision: the converted graph has the same shape as a model exported in
fp16 (``model.half()``), the form tvmfuse's planner and GPU templates are built around, and onnxruntime can run
it too. What stays in fp32:

- the model's inputs and outputs (``keep_io_types``): a caller passes and gets the types the model declares;
- every op of the converter's default block list (ops with no fp16 kernel in onnxruntime);
- ``ReduceMean``/``ReduceSum``/``Pow`` and the other reductions, the statistics of a decomposed RMSNorm
  (LLaMA, T5 export ``x.pow(2).mean()``): a square of fp16 overflows above 256, and a mean of 4096 squares loses
  most of its bits;
- GEMM and conv accumulation, which the importer makes fp32 for every fp16 matmul and conv
  (``relax_fixups.fp32_accumulation``); LayerNorm's mean and variance, which TVM computes in fp32 for fp16
  inputs; softmax's max and sum, which the GPU row program keeps in fp32.

tf32 leaves the graph as stored (fp32): the planner marks its fp32 GEMM, conv and attention kernels for the tensor
cores (:mod:`tvmfuse.plan.tf32`), which read their operands in TF32 (a 10-bit mantissa) and accumulate in fp32, as
cuBLAS and cuDNN under PyTorch's ``allow_tf32``. Off a GPU, or where no tensor-core template takes a kernel, the
kernel runs in fp32. An fp32 model built for a GPU in its own types gets a hint naming both (:func:`hint`).

fp32 (and an fp32 model in its own types) on Hopper runs those same kernels in three TF32 products each, fp32's
accuracy class on the tensor cores (:mod:`tvmfuse.plan.tf32`: about 2e-5 from fp32 on a transformer);
fp32-strict keeps every kernel on the CUDA cores, as cuBLAS's fp32 GEMM (about 1e-6), at their speed.
"""
from __future__ import annotations

import warnings

import onnx

from tvmfuse.errors import TvmfuseError
from tvmfuse.frontend.fixups import value_types
from tvmfuse.frontend.fold import outer_reads

PRECISIONS = ("model", "fp32", "fp32-strict", "tf32", "fp16")
# the precisions that keep an fp32 model's graph as stored
FP32_GRAPH = ("fp32", "fp32-strict", "tf32")

# reductions (and the square before them) whose statistics stay fp32 under --precision fp16
FP32_OPS = ("ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp", "Pow")

# protobuf serializes at most 2 GiB, and the converter's shape inference serializes the model: one past it (a 1B-
# parameter decoder in fp32) is typed from its skeleton, its weights as typed inputs (``skeleton`` of convert())
SERIALIZE_LIMIT = (2 << 30) - 1

# relative error allowed against onnxruntime's run of the original model, by precision
# (TF32 keeps fp16's 10-bit mantissa: a GEMM's relative error is fp16's, about 1e-3, and grows through a deep graph)
TOLERANCE = {"fp16": 1e-2, "tf32": 1e-2}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise TvmfuseError(f"unknown precision '{precision}'", hint="choose from " + ", ".join(PRECISIONS))
    return precision


def hint(model: onnx.ModelProto, precision: str, gpu: bool) -> str | None:
    """What a report suggests for ``model`` built in ``precision`` (on a GPU where ``gpu``): an fp32 model in its own
    types keeps its GEMMs, convs and attention off the tensor cores. None where there is nothing to suggest."""
    if not gpu or precision != "model" or float_types(model) != {"float32"}:
        return None
    return ("an fp32 model on a GPU keeps fp32's accuracy: its GEMMs, convs and attention run on Hopper's tensor "
            "cores in three TF32 products each (elsewhere on the CUDA cores); --precision tf32 computes them in one "
            "TF32 product (about 1e-3 from fp32, what PyTorch's allow_tf32 does), --precision fp16 converts the "
            "graph (fp32 accumulation and statistics)")


def float_types(model: onnx.ModelProto) -> set[str]:
    """The floating-point element types of the model's initializers and inputs."""
    names = set()
    for t in model.graph.initializer:
        names.add(onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name)
    for vi in model.graph.input:
        names.add(onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type).name)
    return {n for n in names if n.startswith("float")}


def convert(model: onnx.ModelProto, precision: str, skeleton=None) -> onnx.ModelProto:
    """``model`` in ``precision`` (the same object when nothing changes). Raises TvmfuseError for fp32 on a model
    stored in fp16 (tvmfuse does not widen weights) and when the converter fails. ``skeleton``: a function giving
    the model without its large weights (they typed graph inputs), which types a model past protobuf's 2 GiB
    (:data:`SERIALIZE_LIMIT`) for the converter in its stead."""
    precision = check_precision(precision)
    types = float_types(model)
    if precision == "model" or (precision in FP32_GRAPH and "float16" not in types):
        return model
    if precision in FP32_GRAPH:
        raise TvmfuseError(f"--precision {precision} on a model stored in fp16: tvmfuse does not widen weights",
                           hint="export the model in fp32, or leave --precision out")
    if "float32" not in types:
        return model   # already fp16
    try:
        from onnxconverter_common import float16
    except ImportError:
        raise TvmfuseError("--precision fp16 needs onnxconverter-common", hint="pip install onnxconverter-common") from None
    block = list(float16.DEFAULT_OP_BLOCK_LIST) + list(FP32_OPS)
    big = _past_limit(model)
    if big and skeleton is None:
        raise TvmfuseError("the fp16 conversion failed: the model is past protobuf's 2 GiB",
                           hint="load it with tvmfuse.frontend.load_model, which types it without its weights")
    _drop_identity_casts(model, skeleton(model) if big else model)
    if big:   # the converter's own inference would serialize the model: the skeleton's types, given it instead
        typed = onnx.shape_inference.infer_shapes(skeleton(model), strict_mode=False)
        del model.graph.value_info[:]
        model.graph.value_info.extend(typed.graph.value_info)
    try:
        with warnings.catch_warnings():   # it warns for each constant it clamps (a mask's -3.4e38 to -1e4)
            warnings.simplefilter("ignore")
            converted = float16.convert_float_to_float16(model, keep_io_types=True, op_block_list=block,
                                                         disable_shape_infer=big)
    except Exception as err:  # noqa: BLE001 - the converter raises many types; the user needs one line
        raise TvmfuseError(f"the fp16 conversion failed: {type(err).__name__}: {str(err)[:200]}") from None
    _casts_follow_their_values(converted)
    _outputs_read_inside(converted)
    return converted


def _past_limit(model: onnx.ModelProto) -> bool:
    """Whether ``model`` serializes to more than :data:`SERIALIZE_LIMIT` bytes (protobuf cannot even size one past
    2 GiB: it raises)."""
    try:
        return model.ByteSize() > SERIALIZE_LIMIT
    except Exception:  # noqa: BLE001 - EncodeError: past protobuf's limit
        return True


def _drop_identity_casts(model: onnx.ModelProto, typed: onnx.ModelProto) -> int:
    """Remove each ``Cast`` to the type its input already has (a TorchScript export's ``x.float()`` of an fp32
    tensor; DINOv2 casts its pixels so). The converter casts an fp32 input to fp16 and then drops that cast and
    the model's own ``Cast(to=FLOAT)`` after it as a redundant pair, which left DINOv2's first conv reading the
    fp32 input with fp16 weights. A cast whose output the graph returns, or a subgraph reads, is kept. ``typed``:
    the model shape inference types (``model``, or its skeleton)."""
    types = value_types(typed)
    # values the graph returns, or a subgraph reads from the outer scope, keep their names
    outputs = {o.name for o in model.graph.output}.union(*(outer_reads(n) for n in model.graph.node))
    rename, kept = {}, []
    for node in model.graph.node:
        to = next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None
        source = rename.get(node.input[0], node.input[0]) if node.input else None
        if to is not None and node.domain in ("", "ai.onnx") and node.output[0] not in outputs \
                and types.get(node.input[0]) == to:
            rename[node.output[0]] = source
            continue
        kept.append(node)
    if not rename:
        return 0
    for node in kept:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return len(rename)


def _casts_follow_their_values(model: onnx.ModelProto) -> int:
    """The converter turns every fp32 value outside its block list fp16 but leaves the model's own
    ``Cast(to=FLOAT)`` as it was: a TorchScript export's ``x.float()`` (Gemma's RMSNorm, a mask's cast) then
    declares an fp16 value and computes an fp32 one, which onnxruntime refuses and TVM imports as a mixed-type
    multiply. Such a cast now casts to fp16, the type the converted graph gives its output; the converter's own
    casts (into and out of blocked ops) declare fp32 and are left alone."""
    declared = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.value_info}
    fp32, fp16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    fixed = 0
    for node in model.graph.node:
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or declared.get(node.output[0]) != fp16:
            continue
        for attr in node.attribute:
            if attr.name == "to" and attr.i == fp32:
                attr.i = fp16
                fixed += 1
    return fixed


def _outputs_read_inside(model: onnx.ModelProto) -> int:
    """A value the graph both returns and reads (a decoder's ``present.N.key``, which its own attention reads
    next) gets the converter's fp32 output cast under the output's name, and the nodes inside still read that
    name: fp32 where the converted graph declares fp16 (TVM imports a mixed-type multiply). They now read the
    fp16 value before the cast."""
    fp32, fp16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    # the types the converter declared (its own shape inference): no second inference over the converted weights
    types = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.value_info}
    outputs = {o.name for o in model.graph.output}
    before = {}
    for node in model.graph.node:
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx") and node.output[0] in outputs \
                and any(a.name == "to" and a.i == fp32 for a in node.attribute) and types.get(node.input[0]) == fp16:
            before[node.output[0]] = node.input[0]
    rewired = 0
    for node in model.graph.node:
        if node.op_type == "Cast" and node.output[0] in before:
            continue
        for i, name in enumerate(node.input):
            if name in before:
                node.input[i] = before[name]
                rewired += 1
    return rewired
