"""The CPU default (tvmfuse/kernels/cpu): every kernel class of a small onnx.helper model gets a parallel,
vectorised schedule on llvm (nothing silently keeps TVM's plain lowering), each kernel matches its plain-lowered
reference, and the untuned build matches onnxruntime at fp32 1e-4."""
from __future__ import annotations

import platform
from pathlib import Path
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvmfuse._tvm import PrimFunc, relax, tvm

RNG = np.random.default_rng(0)


def _w(name, shape, scale=0.3):
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(np.float32), name)


def _model(nodes, inputs, output, inits):
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, output[1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def pointwise():   # an elementwise chain with a broadcast
    return _model([helper.make_node("Add", ["x", "b"], ["s"]), helper.make_node("Relu", ["s"], ["r"]),
                   helper.make_node("Mul", ["r", "x"], ["y"])], [("x", [8, 64, 96])], ("y", [8, 64, 96]),
                  [_w("b", [96])])


def rows():   # softmax and LayerNorm over the last axis
    return _model([helper.make_node("Softmax", ["x"], ["s"], axis=-1),
                   helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-5)],
                  [("x", [2, 32, 96])], ("y", [2, 32, 96]), [_w("g", [96]), _w("b", [96])])


def gemm():   # MatMul + bias + tanh, and a batched MatMul
    return _model([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
                   helper.make_node("Tanh", ["a"], ["g"]),
                   helper.make_node("Transpose", ["g"], ["t"], perm=[0, 2, 1]),
                   helper.make_node("MatMul", ["g", "t"], ["y"])],
                  [("x", [2, 24, 40])], ("y", [2, 24, 24]), [_w("w", [40, 64]), _w("b", [64])])


def cnn():   # conv + BN + ReLU6, a depthwise conv, a 1x1 conv with a residual, pooling, a Gemm head
    six = [numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
           numpy_helper.from_array(np.array(6.0, np.float32), "hi")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "g", "bb", "m", "v"], ["n1"]),
             helper.make_node("Clip", ["n1", "lo", "hi"], ["r1"]),
             helper.make_node("Conv", ["r1", "wd"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=16),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "wp", "bp"], ["c3"], kernel_shape=[1, 1]),
             helper.make_node("Add", ["c3", "r1"], ["s"]),
             helper.make_node("MaxPool", ["s"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["p"], ["gp"]),
             helper.make_node("Flatten", ["gp"], ["f"]),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1)]
    inits = [_w("w1", [16, 3, 3, 3]), _w("g", [16]), _w("bb", [16]), _w("m", [16]),
             numpy_helper.from_array(RNG.uniform(0.5, 1.5, 16).astype(np.float32), "v"), _w("wd", [16, 1, 3, 3]),
             _w("wp", [16, 16, 1, 1]), _w("bp", [16]), _w("wf", [10, 16]), _w("bf", [10])] + six
    return _model(nodes, [("x", [1, 3, 32, 32])], ("y", [1, 10]), inits)


def activations():   # fp32 exp, tanh, sigmoid and log-softmax: the llvm fast-math lowerings (plan/fastmath.py)
    return _model([helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Sigmoid", ["x"], ["g"]),
                   helper.make_node("Mul", ["t", "g"], ["m"]), helper.make_node("Exp", ["m"], ["e"]),
                   helper.make_node("LogSoftmax", ["e"], ["l"], axis=-1),
                   helper.make_node("Softmax", ["x"], ["s"], axis=1),   # not the innermost axis
                   helper.make_node("Add", ["l", "s"], ["y"])],
                  [("x", [8, 32, 128])], ("y", [8, 32, 128]), [])


def ragged_cnn():   # a prime output width (29: no row tile divides it) and a weight-heavy 1x1 conv at 3x3 pixels to
    # 520 channels (8-lane tiles: all 9 pixels a tile)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], kernel_shape=[7, 7], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2]),
             helper.make_node("Conv", ["p1", "w2"], ["c2"], kernel_shape=[3, 3], strides=[4, 4]),
             helper.make_node("Conv", ["c2", "w3", "b3"], ["c3"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c3"], ["r3"]),
             helper.make_node("GlobalAveragePool", ["r3"], ["gp"]),
             helper.make_node("Flatten", ["gp"], ["f"]),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1)]
    inits = [_w("w1", [32, 3, 7, 7], 0.1), _w("w2", [64, 32, 3, 3], 0.1), _w("w3", [520, 64, 1, 1], 0.1),
             _w("b3", [520]), _w("wf", [10, 520], 0.1), _w("bf", [10])]
    return _model(nodes, [("x", [1, 3, 64, 64])], ("y", [1, 10]), inits)


def odd_depthwise():   # ShuffleNet-v2's channel counts: 58 (2 x 29) and 116 no vector divides, a depthwise conv each
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "wd", "bd"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=58),
             helper.make_node("Conv", ["c2", "w2"], ["c3"], kernel_shape=[1, 1]),
             helper.make_node("Conv", ["c3", "wd2"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                              group=116)]
    inits = [_w("w1", [58, 24, 1, 1], 0.2), _w("wd", [58, 1, 3, 3], 0.3), _w("bd", [58]),
             _w("w2", [116, 58, 1, 1], 0.2), _w("wd2", [116, 1, 3, 3], 0.3)]
    return _model(nodes, [("x", [1, 24, 14, 14])], ("y", [1, 116, 7, 7]), inits)


def grouped():   # ResNeXt-style grouped 3x3 convs: 4 and 32 output channels a group
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=8),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=2)]
    inits = [_w("w1", [32, 4, 3, 3], 0.3), _w("w2", [64, 16, 3, 3], 0.1), _w("b2", [64])]
    return _model(nodes, [("x", [1, 32, 14, 14])], ("y", [1, 64, 14, 14]), inits)


def ragged_gemm():   # 29 rows (a prime: the ragged row tile) by a weight-heavy 40x512 weight, bias and ReLU
    return _model([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
                   helper.make_node("Relu", ["a"], ["y"])], [("x", [29, 40])], ("y", [29, 512]),
                  [_w("w", [40, 512]), _w("b", [512])])


def dense_concat():   # DenseNet's block: the input and two convs concatenated along channels, BN + ReLU, a conv
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], kernel_shape=[1, 1]),
             helper.make_node("Conv", ["x", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["x", "c1", "c2"], ["cat"], axis=1),
             helper.make_node("BatchNormalization", ["cat", "g", "bb", "m", "v"], ["n"]),
             helper.make_node("Relu", ["n"], ["r"]),
             helper.make_node("Conv", ["r", "w3"], ["y"], kernel_shape=[1, 1])]
    inits = [_w("w1", [16, 32, 1, 1]), _w("w2", [48, 32, 3, 3], 0.1), _w("g", [96]), _w("bb", [96]), _w("m", [96]),
             numpy_helper.from_array((RNG.random(96) + 0.5).astype(np.float32), "v"), _w("w3", [16, 96, 1, 1], 0.1)]
    return _model(nodes, [("x", [1, 32, 8, 8])], ("y", [1, 16, 8, 8]), inits)


def scores(tokens=37):   # attention's scores of two heads at a token count no vector divides, an additive mask
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", ["x", "wk"], ["k"]),
             helper.make_node("Reshape", ["q", "heads"], ["qh"]), helper.make_node("Reshape", ["k", "heads"], ["kh"]),
             helper.make_node("Transpose", ["qh"], ["qt"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["kh"], ["kt"], perm=[0, 2, 3, 1]),
             helper.make_node("MatMul", ["qt", "kt"], ["s"]), helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Add", ["ss", "mask"], ["y"])]
    mask = np.triu(np.full((tokens, tokens), -1e4, np.float32), 1)[None, None]
    inits = [_w("wq", [32, 32]), _w("wk", [32, 32]), numpy_helper.from_array(np.array([1, tokens, 2, 16]), "heads"),
             numpy_helper.from_array(np.array(0.25, np.float32), "scale"), numpy_helper.from_array(mask, "mask")]
    return _model(nodes, [("x", [1, tokens, 32])], ("y", [1, 2, tokens, tokens]), inits)


def conv1d():   # Whisper's stem: two 1-D convs over frames (the second strided), GELU
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3], pads=[1, 1]),
             helper.make_node("Relu", ["c1"], ["r"]),
             helper.make_node("Conv", ["r", "w2", "b2"], ["y"], kernel_shape=[3], pads=[1, 1], strides=[2])]
    inits = [_w("w1", [48, 20, 3], 0.2), _w("b1", [48]), _w("w2", [48, 48, 3], 0.1), _w("b2", [48])]
    return _model(nodes, [("x", [1, 20, 150])], ("y", [1, 48, 75]), inits)


def grouped_kv():   # GQA's K projection, its one K/V head repeated for 4 query heads (Mistral's repeat_kv)
    nodes = [helper.make_node("MatMul", ["x", "wk"], ["k"]), helper.make_node("Reshape", ["k", "kv"], ["kh"]),
             helper.make_node("Transpose", ["kh"], ["kt"], perm=[0, 2, 1, 3]),
             helper.make_node("Unsqueeze", ["kt", "at2"], ["ku"]), helper.make_node("Expand", ["ku", "rep"], ["ke"]),
             helper.make_node("Reshape", ["ke", "heads"], ["y"])]
    inits = [_w("wk", [128, 64], 0.1), *(numpy_helper.from_array(np.array(v), n) for n, v in
                                         (("kv", [1, 64, 1, 64]), ("at2", [2]), ("rep", [1, 1, 4, 64, 64]),
                                          ("heads", [1, 4, 64, 64])))]
    return _model(nodes, [("x", [1, 64, 128])], ("y", [1, 4, 64, 64]), inits)


def norm_transpose():   # a LayerNorm whose rows are transposed for the next op (Swin's windows, wav2vec2's NWC)
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("Transpose", ["n"], ["y"], perm=[0, 2, 1])]
    return _model(nodes, [("x", [4, 64, 200])], ("y", [4, 200, 64]), [_w("g", [200]), _w("b", [200])])


def quantized():   # onnxruntime's quantize_dynamic: a whole-tensor min and max (DynamicQuantizeLinear), MatMulInteger
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["mm"]),
             helper.make_node("Cast", ["mm"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["sc"]), helper.make_node("Mul", ["mf", "sc"], ["y"])]
    w = np.random.default_rng(5).integers(-127, 128, (128, 64)).astype(np.int8)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0, np.int8), "wz"),
             numpy_helper.from_array(np.array(0.01, np.float32), "ws")]
    return _model(nodes, [("x", [32, 128])], ("y", [32, 64]), inits)


MODELS = {"pointwise": pointwise, "rows": rows, "gemm": gemm, "cnn": cnn, "activations": activations,
          "ragged_cnn": ragged_cnn, "ragged_gemm": ragged_gemm, "odd_depthwise": odd_depthwise,
          "grouped": grouped, "dense_concat": dense_concat, "scores": scores, "conv1d": conv1d,
          "grouped_kv": grouped_kv, "norm_transpose": norm_transpose, "quantized": quantized}
# per model, the kernels that keep TVM's plain lowering: the activations model's softmax along an outer axis (the
# rows rules read rows along the innermost axis)
PLAIN = {"activations": ("softmax",)}
# per model, kernels that only move data: the conv1d model's input, NCW to NWC, reads a gather along its innermost
# axis, which the pointwise rules keep scalar (there is no arithmetic to vectorise)
MOVES = {"conv1d": ("transpose",)}


def _fused(model, tmp_path, target):
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan.partition import DEFAULT_PLANNER, partition

    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    fused, _ = partition(import_model(load_model(path)), target=target, planner=DEFAULT_PLANNER)
    return path, fused


@pytest.mark.parametrize("name", list(MODELS))
def test_every_kernel_gets_a_parallel_vectorised_default_that_matches_its_reference(name, tmp_path, llvm_target):
    from tvmfuse.kernels import get
    from tvmfuse.tune.check import check_kernel

    _, fused = _fused(MODELS[name](), tmp_path, llvm_target)
    cpu = get("cpu")
    kinds = []
    for gv, func in fused.functions.items():
        if not isinstance(func, PrimFunc):
            continue
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        sch = cpu.traced_kernel(mod, llvm_target.target)
        if gv.name_hint in PLAIN.get(name, ()):
            assert sch is None, gv.name_hint
            continue
        assert sch is not None, f"{gv.name_hint}: no CPU default (it would keep TVM's plain lowering)"
        text = sch.mod.script()
        if "T.vectorized" not in text and gv.name_hint not in MOVES.get(name, ()):
            # a depthwise conv's tile over all its channels is left to LLVM's loop vectoriser: packed float ops
            asm = tvm.compile(sch.mod, target=llvm_target.target).mod.inspect_source("asm")
            assert re.search(r"\bv?\w*(add|mul|fmadd\w*)ps\b", asm), f"{gv.name_hint} is not vectorised:\n{text}"
        kinds.append("T.parallel" in text)
        check = check_kernel(mod, sch.mod, llvm_target)
        assert check.ok, f"{gv.name_hint}: relative error {check.rel_error:.2e}, {check.unwritten} unwritten"
        kernel = cpu.default_kernel(func, llvm_target.target)
        assert kernel is not None and bool(kernel.attrs["tirx.is_scheduled"])
    assert name == "rows" or (kinds and any(kinds)), "no kernel of the model runs in parallel"


@pytest.mark.parametrize("name", list(MODELS))
def test_the_untuned_build_runs_the_cpu_default_and_matches_onnxruntime(name, tmp_path, llvm_target):
    from tvmfuse import verify
    from tvmfuse.compile import build

    path, fused = _fused(MODELS[name](), tmp_path, llvm_target)
    built = build(fused, target=llvm_target, database=None)
    assert built.kernels and all(k.schedule == ("default" if k.name in PLAIN.get(name, ()) else "cpu-default")
                                 for k in built.kernels), built.kernels
    model = onnx.load(path)
    feeds = {i.name: RNG.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in model.graph.input}
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    out = vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()], *built.lifted_params)
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    ref = verify.run_onnxruntime(path, feeds)[0] if name != "quantized" else _quantized_reference(model, feeds)
    assert verify.relative_error(got, ref) < 1e-4


def _quantized_reference(model, feeds) -> np.ndarray:
    """``quantized()`` in exact integer arithmetic: onnxruntime's uint8 x int8 GEMM on AVX2 without VNNI sums
    pairs of products in int16 (``vpmaddubsw``), which saturates at activations this large (its documentation
    advises ``reduce_range``): 0.18 off on a Zen 1."""
    x = feeds["x"].astype(np.float64)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    lo, hi = min(0.0, float(x.min())), max(0.0, float(x.max()))
    scale = np.float32((hi - lo) / 255)
    zero = int(np.clip(np.rint(-lo / scale), 0, 255))
    xq = np.clip(np.rint(feeds["x"] / scale) + zero, 0, 255).astype(np.int64)
    acc = (xq - zero) @ (inits["w"].astype(np.int64) - int(inits["wz"]))
    return (acc.astype(np.float32) * np.float32(scale * inits["ws"])).astype(np.float32)


def test_a_channel_concatenation_runs_in_chunks_of_one_input_each(tmp_path, llvm_target):
    """Inlined, a concatenation selects its input per element by a chain of if_then_else on the channel; in
    whole-vector chunks of one input, unrolled, each chunk's selection is a constant and its loads plain vectors
    (DenseNet-121's concat + BN + ReLU kernels ran 5-10x faster so)."""
    from tvmfuse.kernels.cpu.concat import concat_chunk
    from tvmfuse.kernels.sketch import inline_all_but_outputs
    from tvmfuse.kernels import get

    _, fused = _fused(dense_concat(), tmp_path, llvm_target)
    (name,) = [gv.name_hint for gv in fused.functions if "concatenate" in gv.name_hint]
    mod = tvm.IRModule({"main": fused[name].with_attr("global_symbol", "main")})
    sch = tvm.s_tir.Schedule(mod)
    inline_all_but_outputs(sch)
    (block,) = sch.get_output_blocks(sch.get_sblock("root"))
    assert concat_chunk(sch, block) == 16   # channels 32 | 16 | 48
    text = str(get("cpu").traced_kernel(mod, llvm_target.target).trace)
    assert "sch.unroll" in text and "factors=[None, 16]" in text


def test_vector_width_follows_the_targets_mcpu():
    from tvmfuse.kernels.cpu import vector_lanes

    assert vector_lanes(tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})) == 16
    assert vector_lanes(tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})) == 8
    assert vector_lanes(tvm.target.Target({"kind": "llvm", "mcpu": "haswell"}), 16) == 16


def test_convs_run_channels_last_with_hwio_filters_on_cpus(tmp_path, llvm_target):
    _, fused = _fused(cnn(), tmp_path, llvm_target)
    convs = [f for gv, f in fused.functions.items() if isinstance(f, PrimFunc) and "conv2d" in gv.name_hint]
    assert convs and all("conv2d_nhwc" in f.script() for f in convs)


def wide():   # a 3x3 conv and a GEMM, each of more output channels than a vector tile: weights the default packs
    nodes = [helper.make_node("Conv", ["x", "wc", "bc"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["f"]),
             helper.make_node("MatMul", ["f", "wm"], ["y"])]
    inits = [_w("wc", [96, 16, 3, 3], 0.1), _w("bc", [96]), _w("wm", [96, 160], 0.1),
             numpy_helper.from_array(np.array([64, 96], np.int64), "shape")]
    return _model(nodes, [("x", [1, 16, 8, 8])], ("y", [64, 160]), inits)


def test_conv_and_gemm_weights_are_packed_at_compile_time(tmp_path, llvm_target):
    """The CPU default reads a GEMM's or conv's weight in the order of its tiles: the build packs each constant
    once (``[O / tile, ..., tile]``), leaves no layout-rewrite step to run at every call, and matches onnxruntime."""
    from tvmfuse import verify
    from tvmfuse.compile import build
    from tvmfuse.compile.build import apply_records, pack_weights

    path, fused = _fused(wide(), tmp_path, llvm_target)
    marked = sorted(gv.name_hint for gv, f in fused.functions.items()
                    if isinstance(f, PrimFunc) and f.attrs is not None and "layout_free_buffers" in f.attrs)
    assert any("conv2d" in k for k in marked) and any("matmul" in k for k in marked), marked
    built = build(fused, target=llvm_target, database=None)
    shapes = sorted(tuple(p.shape) for p in built.lifted_params)
    conv = [s for s in shapes if len(s) == 5 and s[1:4] == (3, 3, 16)]   # [96 / tile, 3, 3, 16, tile]
    gemm = [s for s in shapes if len(s) == 3 and s[1] == 96]              # [160 / tile, 96, tile]
    assert conv and conv[0][0] * conv[0][4] == 96 and conv[0][0] > 1, shapes
    assert gemm and gemm[0][0] * gemm[0][2] == 160 and gemm[0][0] > 1, shapes
    # packed once: the kernels keep their names, and no packing function is left to run at every call
    packed = pack_weights(apply_records(fused, target=llvm_target, database=None)[0])
    assert sorted(gv.name_hint for gv in packed.functions) == sorted(gv.name_hint for gv in fused.functions)
    feeds = {"x": RNG.standard_normal([1, 16, 8, 8]).astype(np.float32)}
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    got = vm["main"](tvm.runtime.tensor(feeds["x"]), *built.lifted_params).numpy()
    assert verify.relative_error(got, verify.run_onnxruntime(path, feeds)[0]) < 1e-4


def test_contraction_tiles_take_a_ragged_row_tile_where_none_divides_and_weight_heavy_kernels_go_channel_first(
        tmp_path, llvm_target):
    from tvmfuse.kernels.cpu.schedule import contraction_tiles, weight_heavy
    from tvmfuse.target import vector_lanes

    # 29 output pixels a row (SqueezeNet's first conv at 64x64): 6 rows of two vectors, the last tile guarded
    assert contraction_tiles([1, 29, 29, 96], 16) == {3: 32, 2: 6}
    assert contraction_tiles([1, 28, 28, 96], 16) == {3: 32, 2: 4}   # a divisor where one fits
    # 1000 channels take half-width (8-lane) tiles, which leave registers for all 9 pixels of a 3x3 output
    assert contraction_tiles([1, 3, 3, 1000], 16) == {3: 8, 2: 3, 1: 3}
    # a GEMV of 1000 classes: 40 lanes (2.5 AVX-512 vectors, three accumulator chains), not one 8-lane chain; a
    # width two whole vectors divide keeps whole vectors
    assert contraction_tiles([1, 1000], 16) == {1: 40}
    assert contraction_tiles([1, 1, 1, 1000], 16) == {3: 40}
    assert contraction_tiles([1, 1152], 16) == {1: 64}
    assert contraction_tiles([1, 1280], 16) == {1: 80}
    assert contraction_tiles([1, 1000], 8) == {1: 40}
    # AVX-512's 32 registers hold 14 accumulators: two vectors of 7 pixels, or one vector of 14; one vector
    # takes all 9 pixels of a 3x3 output (1008 channels: 1000 padded by the planner); ragged tiles keep 6 rows
    assert contraction_tiles([1, 14, 14, 128], 16, 32) == {3: 32, 2: 7}
    assert contraction_tiles([1, 28, 28, 96], 16, 32) == {3: 32, 2: 7}
    assert contraction_tiles([1, 13, 13, 64], 16, 32) == {3: 16, 2: 13}
    assert contraction_tiles([1, 3, 3, 1008], 16, 32) == {3: 16, 2: 3, 1: 3}
    assert contraction_tiles([1, 3, 3, 1008], 16) == {3: 16, 2: 3}
    assert contraction_tiles([1, 29, 29, 96], 16, 32) == {3: 32, 2: 6}
    # a depthwise conv: one tile over all its channels (any count), one pixel; a GEMM's 256 columns take rows
    assert contraction_tiles([1, 28, 28, 58], 16, 32, depthwise=True) == {3: 58}
    assert contraction_tiles([1, 7, 7, 576], 16, 32, depthwise=True) == {3: 576}
    assert contraction_tiles([1, 7, 7, 256], 16, 32) == {3: 32, 2: 7}
    # a grouped conv's vector tile stays within one group (4, 8 or 32 output channels a group)
    assert contraction_tiles([1, 56, 56, 128], 16, 32, group=4) == {3: 4, 2: 8}
    assert contraction_tiles([1, 28, 28, 256], 16, 32, group=8) == {3: 8, 2: 7}
    assert contraction_tiles([1, 7, 7, 1024], 16, 32, group=32) == {3: 32, 2: 7}
    _, fused = _fused(ragged_cnn(), tmp_path, llvm_target)
    heavy = {}
    for gv, func in fused.functions.items():
        if isinstance(func, PrimFunc) and gv.name_hint.startswith("fused_conv2d"):
            sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
            from tvmfuse.kernels.sketch import REDUCE, inline_all_but_outputs, iter_types

            inline_all_but_outputs(sch)
            (block,) = [b for b in sch.get_child_blocks(sch.get_sblock("root")) if REDUCE in iter_types(sch, b)]
            heavy[gv.name_hint] = weight_heavy(sch, block)
    # the 1x1 conv to 520 channels at 3x3 pixels (on AVX-512 528 computed, on the weight padded to 16 lanes, and
    # sliced) reads 130 KB of weight for 2 KB of input; the 7x7 conv the reverse
    late = "fused_conv2d_strided_slice_add_relu" if 520 % vector_lanes(llvm_target.target) else "fused_conv2d_add_relu"
    assert heavy == {"fused_conv2d_relu": False, late: True}, heavy


def _lowered(mod, target, pipeline):
    """``mod`` through a named TIR pipeline's lowering (no codegen), as TIR text."""
    from tvm.tirx import compilation_pipeline

    lower, _, _ = compilation_pipeline.get_tir_pipeline(pipeline)
    with target:
        return lower(tvm.tirx.transform.BindTarget(target.with_host(target))(mod)).script()


def test_reduction_loops_prefetch_the_streamed_weight_ahead_and_nothing_else(tmp_path, llvm_target):
    """The llvm pipeline (``kernels/cpu/prefetch.py``) adds, in each reduction's innermost loop, one prefetch per cache
    line of the packed weight the loop advances, 4 KB ahead; the activation (4 bytes an iteration), pointwise and
    row kernels get none; the builds with and without it agree bitwise, and the machine code has the prefetch."""
    from tvmfuse.kernels import get
    from tvmfuse.kernels.cpu.prefetch import DISTANCE, PIPELINE, tir_pipeline
    from tvmfuse.target import vector_lanes
    from tvmfuse.tune.check import param_specs

    assert tir_pipeline(llvm_target.target) == PIPELINE
    assert tir_pipeline(tvm.target.Target("cuda")) == "default"
    counts = {}
    for name, model in (("ragged_gemm", ragged_gemm()), ("pointwise", pointwise()), ("rows", rows())):
        _, fused = _fused(model, tmp_path, llvm_target)
        for gv, func in fused.functions.items():
            if not isinstance(func, PrimFunc):
                continue
            sch = get("cpu").traced_kernel(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                                           llvm_target.target)
            mod = tvm.s_tir.transform.RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(sch.mod)
            text = _lowered(mod, llvm_target.target, tir_pipeline(llvm_target.target))
            counts[(name, gv.name_hint)] = text.count("llvm.prefetch")
            assert "llvm.prefetch" not in _lowered(mod, llvm_target.target, "default")
            if name != "ragged_gemm":
                continue
            # the 40x512 weight packed [512 / 2v, 40, 2v] (v lanes): 2v floats an iteration of the reduction over
            # 40, a cache line's prefetch each 64 bytes (AVX-512: two, AVX2: one)
            lines = 8 * vector_lanes(llvm_target.target) // 64
            assert text.count("llvm.prefetch") == lines, text
            assert all(f"+ {(DISTANCE + 64 * i) // 4}]" in text for i in range(lines)), text
            args = [tvm.runtime.tensor(RNG.standard_normal(s).astype(d)) for _, s, d in param_specs(mod["main"])]
            outs = []
            for pipeline in ("default", PIPELINE):
                with llvm_target.target:
                    lib = tvm.compile(mod, target=llvm_target.target, tir_pipeline=pipeline)
                lib["main"](*args)
                outs.append(args[-1].numpy().copy())
                if pipeline == PIPELINE and platform.machine() in ("x86_64", "AMD64"):
                    assert "prefetcht0" in lib.mod.inspect_source("asm")
            np.testing.assert_array_equal(outs[0], outs[1])
    assert any(n == "ragged_gemm" and c for (n, _), c in counts.items()), counts
    assert not any(c for (n, _), c in counts.items() if n != "ragged_gemm"), counts


def test_the_contraction_sketch_samples_the_defaults_choices_and_every_point_matches_the_reference(tmp_path,
                                                                                                     llvm_target):
    """``template: cpu_contraction`` (llvm.yaml): one sketch per loop order, sampling the vector tile (whole vectors
    that divide the channels, and the rules' own tile), the rows and the reduction unroll; the rules' choice is
    among the values; points drawn at random post-process and match the kernel's plain lowering."""
    from tvmfuse.kernels.cpu.schedule import contraction_facts, contraction_loops, default_tiles
    from tvmfuse.target import vector_lanes, vector_registers
    from tvmfuse.kernels.sketch import REDUCE, inline_all_but_outputs, iter_types
    from tvmfuse.kernels.space import tune_context
    from tvmfuse.tune.spaces import select_space

    from tvmfuse.kernels.cpu.activations import pad_and_pack

    rng = np.random.default_rng(1)
    _, convs = _fused(ragged_cnn(), tmp_path, llvm_target)
    _, attention = _fused(scores(), tmp_path, llvm_target)   # its scores: padded to whole vectors, as the default
    kernels = [(gv, f) for gv, f in convs.functions.items() if gv.name_hint.startswith("fused_conv2d")]
    kernels += [(gv, f) for gv, f in attention.functions.items() if isinstance(f, PrimFunc) and len(f.params) == 4]
    for gv, func in kernels:
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        choice = select_space(mod, llvm_target.target)
        assert choice.source == "template:cpu_contraction", (gv.name_hint, choice.source, choice.note)
        ctx = tune_context(mod, llvm_target.target, choice.generator)
        sketches = ctx.generate_design_space()
        assert len(sketches) == 2   # weight-first, pixel-first
        probe = tvm.s_tir.Schedule(mod)
        inline_all_but_outputs(probe)
        (block,) = [b for b in probe.get_child_blocks(probe.get_sblock("root")) if REDUCE in iter_types(probe, b)]
        lanes, registers = vector_lanes(llvm_target.target), vector_registers(llvm_target.target)
        block = pad_and_pack(probe, block, lanes, registers)
        exts = contraction_loops(probe, block)[2]
        rules = default_tiles(exts, lanes, registers, contraction_facts(probe, block))
        for sketch in sketches:
            cats = [i for i in sketch.trace.insts if i.kind.name == "SampleCategorical"]
            vectors = [int(c) for c in cats[0].attrs[0]]
            assert rules[len(exts) - 1] in vectors, (vectors, rules)
            assert all(exts[-1] % v == 0 for v in vectors), vectors
            _random_points_match(mod, ctx, sketch, cats, rng, llvm_target, gv.name_hint)


def _random_points_match(mod, ctx, sketch, cats, rng, target, name: str, points: int = 3) -> None:
    """``points`` random decisions of ``sketch``'s categorical knobs ``cats`` post-process and match the kernel's
    reference (the tuner's kernel check)."""
    from tvmfuse.kernels.space import postprocessor
    from tvmfuse.tune.check import check_kernel

    for _ in range(points):
        trace = sketch.trace
        for inst in cats:
            trace = trace.with_decision(inst, int(rng.integers(len(inst.attrs[0]))), remove_postproc=True)
        sch = tvm.s_tir.Schedule(mod)
        trace.apply_to_schedule(sch, remove_postproc=True)
        assert postprocessor(ctx)(sch)
        check = check_kernel(mod, sch.mod, target)
        assert check.ok, f"{name}: {check.rel_error:.2e}, {check.unwritten} unwritten"


def test_a_contraction_of_two_activations_at_a_ragged_length_runs_padded_to_whole_vectors(tmp_path, llvm_target):
    """Attention's scores at 37 tokens (no vector divides it): the default pads both inputs in the kernel and runs
    whole register tiles, and the mask (a constant read only by the epilogue) is not marked for packing (the
    untuned build against onnxruntime: test_the_untuned_build_runs_the_cpu_default_and_matches_onnxruntime)."""
    from tvmfuse.kernels import get
    from tvmfuse.kernels.cpu.activations import padded_extents

    assert padded_extents([1, 12, 197, 197], 16, 32) == [1, 12, 210, 208]
    assert padded_extents([1, 12, 197, 197], 8, 16) == [1, 12, 200, 200]
    assert padded_extents([1, 12, 128, 128], 16, 32) is None       # whole vectors already
    assert padded_extents([1, 12, 20, 20], 16, 32) is None         # two vectors or fewer: LLVM splits them
    assert padded_extents([1, 12, 17, 50], 16, 32) == [1, 12, 17, 64]   # 17 -> 28 rows: over 1.5x the work
    _, fused = _fused(scores(), tmp_path, llvm_target)
    (func,) = [f for gv, f in fused.functions.items() if isinstance(f, PrimFunc) and len(f.params) == 4]
    assert not list((func.attrs or {}).get("layout_free_buffers", [])), "the epilogue's mask is marked for packing"
    text = get("cpu").traced_kernel(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                                    llvm_target.target).mod.script()
    assert "_pad = T.sblock_alloc_buffer" in text and "T.vectorized" in text, text


def test_the_column_operand_of_two_activations_is_packed_into_vector_panels(llvm_target):
    """Scores at 128 tokens, 2 heads of 64 (a 32 KB panel a head): K^T is copied into [N / lanes, K, lanes] panels
    at each call and the tiles read those; the result matches the plain lowering. At 32 tokens it stays as it is."""
    from tvm import te

    from tvmfuse.kernels import get
    from tvmfuse.target import vector_lanes
    from tvmfuse.tune.check import check_kernel

    def scores_kernel(tokens):
        q = te.placeholder((1, 2, tokens, 64), "float32", name="q")
        k = te.placeholder((1, 2, 64, tokens), "float32", name="k")
        r = te.reduce_axis((0, 64), name="r")
        s = te.compute((1, 2, tokens, tokens), lambda n, h, i, j: te.sum(q[n, h, i, r] * k[n, h, r, j], axis=r),
                       name="s")
        return tvm.IRModule({"main": te.create_prim_func([q, k, s]).with_attr("global_symbol", "main")})

    lanes = vector_lanes(llvm_target.target)
    mod = scores_kernel(128)
    sch = get("cpu").traced_kernel(mod, llvm_target.target)
    text = sch.mod.script()
    assert f"k_global = T.sblock_alloc_buffer((1, 2, {128 // lanes}, 64, {lanes}))" in text, text
    assert check_kernel(mod, sch.mod, llvm_target).ok
    assert "k_global" not in get("cpu").traced_kernel(scores_kernel(32), llvm_target.target).mod.script()


def test_1d_convs_run_channels_last_on_cpus(tmp_path, llvm_target):
    """(Against onnxruntime: test_the_untuned_build_runs_the_cpu_default_and_matches_onnxruntime[conv1d].)"""
    _, fused = _fused(conv1d(), tmp_path, llvm_target)
    convs = [f for gv, f in fused.functions.items() if isinstance(f, PrimFunc) and "conv1d" in gv.name_hint]
    assert len(convs) == 2 and all("conv1d_nwc" in f.script() for f in convs)


def test_a_softmax_row_no_vector_divides_keeps_partial_sums_of_a_divisor(llvm_target):
    """Softmax over 100-wide rows (no 16- or 8-lane vector divides 100): its max and sum keep 20 partial results (a
    divisor of the row; a guarded vector's partial results read past the row), vectorised, and match the plain
    lowering; a prime width keeps the scalar chains."""
    from tvm import te, topi

    from tvmfuse.kernels import get
    from tvmfuse.kernels.cpu.schedule import row_lanes
    from tvmfuse.tune.check import check_kernel

    assert row_lanes(1500, 16) == 20 and row_lanes(100, 16) == 20 and row_lanes(100, 8) == 10
    assert row_lanes(128, 16) == 16 and row_lanes(197, 16) is None
    x = te.placeholder((2, 100, 100), "float32", name="x")
    mod = tvm.IRModule({"main": te.create_prim_func([x, topi.nn.softmax(x)]).with_attr("global_symbol", "main")})
    sch = get("cpu").traced_kernel(mod, llvm_target.target)
    text = sch.mod.script()
    assert text.count("_rf = T.sblock_alloc_buffer") == 2 and "T.vectorized" in text, text
    assert check_kernel(mod, sch.mod, llvm_target).ok


def test_an_embedding_kept_beside_its_rmsnorm_is_split_into_kernels_the_cpu_default_takes(tmp_path, llvm_target):
    """LLaMA's first kernel: the embedding (kept as the residual) and its RMSNorm would store two results, which
    no row rule reads (it ran TVM's plain lowering); planned apart, each kernel takes the CPU default, and the
    build matches onnxruntime."""
    from tvmfuse import verify
    from tvmfuse.compile import build

    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]), helper.make_node("Mul", ["e", "e"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["v"]), helper.make_node("Sqrt", ["v"], ["rms"]),
             helper.make_node("Div", ["e", "rms"], ["n"]), helper.make_node("Mul", ["n", "g"], ["ng"]),
             helper.make_node("MatMul", ["ng", "w"], ["h"]), helper.make_node("Add", ["h", "e"], ["y"])]
    inits = [_w("table", [100, 64]), _w("g", [64]), _w("w", [64, 64], 0.1),
             numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(np.array(1e-6, np.float32), "eps")]
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 24])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24, 64])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    path, fused = _fused(model, tmp_path, llvm_target)
    built = build(fused, target=llvm_target, database=None)
    assert built.kernels and all(k.schedule == "cpu-default" for k in built.kernels), built.kernels
    feeds = {"ids": RNG.integers(0, 100, (1, 24)).astype(np.int64)}
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    got = vm["main"](tvm.runtime.tensor(feeds["ids"]), *built.lifted_params).numpy()
    assert verify.relative_error(got, verify.run_onnxruntime(path, feeds)[0]) < 1e-4


def test_an_rmsnorm_row_keeps_vector_partial_sums(llvm_target):
    """RMSNorm's one reduction (the sum of squares) along the output's rows: vector partial sums (``rfactor``) as
    LayerNorm's two, not one chain of dependent adds a row; it matches the plain lowering."""
    from tvm import te

    from tvmfuse.kernels import get
    from tvmfuse.tune.check import check_kernel

    x = te.placeholder((8, 256), "float32", name="x")
    g = te.placeholder((256,), "float32", name="g")
    k = te.reduce_axis((0, 256), name="k")
    ss = te.compute((8, 1), lambda i, _: te.sum(x[i, k] * x[i, k], axis=k), name="ss")
    y = te.compute((8, 256), lambda i, j: x[i, j] / te.sqrt(ss[i, 0] / 256.0 + 1e-6) * g[j], name="y")
    mod = tvm.IRModule({"main": te.create_prim_func([x, g, y]).with_attr("global_symbol", "main")})
    sch = get("cpu").traced_kernel(mod, llvm_target.target)
    assert "ss_rf = T.sblock_alloc_buffer" in sch.mod.script(), sch.mod.script()
    assert check_kernel(mod, sch.mod, llvm_target).ok


def test_a_quantized_gemm_runs_on_vnni_where_the_cpu_has_it(tmp_path, llvm_target):
    """onnxruntime's quantize_dynamic of a BERT (TorchScript export, the user-form fixture): the zero point moves
    out of each MatMulInteger (plan/rewrites/int8_gemm.py) and the GEMM runs vpdpbusd (kernels/cpu/int8.py);
    the build matches onnxruntime's run of the quantized model."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from tvmfuse import verify
    from tvmfuse.compile import build
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.target import has_vnni
    from tvmfuse.plan.partition import partition

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "user_form"
    quantize_dynamic(str(fixtures / "bert.onnx"), str(tmp_path / "q.onnx"), weight_type=QuantType.QInt8)
    feeds = dict(np.load(fixtures / "bert.inputs.npz"))
    loaded = load_model(tmp_path / "q.onnx", input_shapes={k: v.shape for k, v in feeds.items()})
    assert verify.is_quantized(loaded.proto)
    fused, plan = partition(import_model(loaded), target=llvm_target)
    vnni = has_vnni(llvm_target.target)
    assert any("quantized GEMMs read their uint8" in n for n in plan.rewrites) == vnni
    built = build(fused, target=llvm_target, database=None)
    assert all(k.schedule == "cpu-default" for k in built.kernels), built.kernels
    if vnni:
        asm = "".join(m.inspect_source("asm") for m in built.executable.mod.imports if m.kind == "llvm")
        assert "vpdpbusd" in asm
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    out = vm["main"](*[tvm.runtime.tensor(feeds[s.name]) for s in loaded.inputs], *built.lifted_params)
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    ref = verify.run_onnxruntime(tmp_path / "q.onnx", feeds)[0]
    assert verify.relative_error(got, ref) < 1e-4


def _quantize_static(src, dst, feeds: dict, activations: str) -> None:
    """onnxruntime's quantize_static of ``src`` into ``dst``: QDQ, int8 weights, ``activations`` (QUInt8 or QInt8),
    calibrated on ``feeds``."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Calibration(CalibrationDataReader):
        def __init__(self):
            self.left = [feeds]

        def get_next(self):
            return self.left.pop() if self.left else None

    quantize_static(str(src), str(dst), Calibration(), quant_format=QuantFormat.QDQ,
                    activation_type=getattr(QuantType, activations), weight_type=QuantType.QInt8)


@pytest.mark.parametrize("activations", ["QUInt8", "QInt8"])
def test_a_qdq_quantized_gemm_runs_on_its_int8_operands(tmp_path, llvm_target, activations):
    """onnxruntime's quantize_static (QDQ: QuantizeLinear / DequantizeLinear pairs around fp32 MatMuls, an int8
    embedding table): each GEMM of a dequantized activation by a dequantized constant weight runs on the integers,
    scaled after (int8 activations, quantize_static's default, shifted to uint8 for vpdpbusd); the build matches
    onnxruntime within the graph's own rounding drift."""
    from tvmfuse import verify
    from tvmfuse.compile import build
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan.partition import partition
    from tvmfuse.target import has_vnni

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "user_form"
    feeds = dict(np.load(fixtures / "bert.inputs.npz"))

    _quantize_static(fixtures / "bert.onnx", tmp_path / "q.onnx", feeds, activations)
    loaded = load_model(tmp_path / "q.onnx", input_shapes={k: v.shape for k, v in feeds.items()})
    # the token types index a dequantized 2-row table: generated inputs stay inside it
    assert {s.name: s.high for s in loaded.inputs}["token_type_ids"] == 2
    fused, plan = partition(import_model(loaded), target=llvm_target)
    notes = [n for n in plan.rewrites if "quantized GEMMs read their uint8" in n]
    assert bool(notes) == has_vnni(llvm_target.target)
    assert all(("int8 activations shifted to uint8" in n) == (activations == "QInt8") for n in notes)
    built = build(fused, target=llvm_target, database=None)
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    out = vm["main"](*[tvm.runtime.tensor(feeds[s.name]) for s in loaded.inputs], *built.lifted_params)
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    ref = verify.run_onnxruntime(tmp_path / "q.onnx", feeds)
    floor = verify.quantization_floor(tmp_path / "q.onnx", feeds, ref)
    assert verify.relative_error(got, ref[0]) <= max(1e-4, verify.QUANTIZED_SLACK * floor)


def _three_convs() -> onnx.ModelProto:
    """16 -> 32 channels 3x3 (padded) -> ReLU -> 32 -> 32 3x3 stride 2 -> ReLU -> 1x1 32 -> 16, on a 1 x 16 x 9 x 9 input."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
    import models

    b = models._B(21)
    h = b.op("Relu", [b.op("Conv", ["x", b.w(32, 16, 3, 3, scale=0.2), b.const(b.rng.standard_normal(32) * 0.1)],
                           kernel_shape=[3, 3], pads=[1, 1, 1, 1])])
    h = b.op("Relu", [b.op("Conv", [h, b.w(32, 32, 3, 3, scale=0.1)], kernel_shape=[3, 3], strides=[2, 2],
                           pads=[1, 1, 1, 1])])
    return b.model({"x": [1, 16, 9, 9]}, b.op("Conv", [h, b.w(16, 32, 1, 1, scale=0.2)], kernel_shape=[1, 1]),
                   [1, 16, 5, 5])


@pytest.mark.parametrize("activations", ["QUInt8", "QInt8"])
def test_qdq_convs_run_as_exact_integer_gemms(tmp_path, llvm_target, activations):
    """quantize_static's QDQ convs: each an exact integer conv (zero-padded windows corrected by the filter's
    in-window sums), then uint8 im2col rows by the int8 filter on VNNI; the build matches onnxruntime within the
    graph's own rounding drift."""
    from tvmfuse import verify
    from tvmfuse.compile import build
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan.partition import partition
    from tvmfuse.target import has_vnni

    onnx.save(_three_convs(), tmp_path / "m.onnx")
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 16, 9, 9)).astype(np.float32)}

    _quantize_static(tmp_path / "m.onnx", tmp_path / "q.onnx", feeds, activations)
    loaded = load_model(tmp_path / "q.onnx")
    fused, plan = partition(import_model(loaded), target=llvm_target)
    vnni = has_vnni(llvm_target.target)
    assert any(n.startswith("3 quantized convs run on their uint8") for n in plan.rewrites) == vnni
    assert any(n.startswith("3 quantized convs run as uint8 im2col rows") for n in plan.rewrites) == vnni
    built = build(fused, target=llvm_target, database=None)
    if vnni:
        asm = "".join(m.inspect_source("asm") for m in built.executable.mod.imports if m.kind == "llvm")
        assert asm.count("vpdpbusd") >= 3
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    out = vm["main"](tvm.runtime.tensor(feeds["x"]), *built.lifted_params)
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    ref = verify.run_onnxruntime(tmp_path / "q.onnx", feeds)
    floor = verify.quantization_floor(tmp_path / "q.onnx", feeds, ref)
    assert verify.relative_error(got, ref[0]) <= max(1e-4, verify.QUANTIZED_SLACK * floor)


def test_the_padding_correction_is_the_filter_summed_over_each_windows_taps_inside_the_input():
    from types import SimpleNamespace

    from tvmfuse.plan.rewrites.int8_conv import _taps

    rng = np.random.default_rng(3)
    w = rng.integers(-128, 128, (4, 3, 3, 3)).astype(np.int8)
    at = SimpleNamespace(strides=(2, 2), dilation=(1, 1), padding=(1, 1, 1, 1))
    h = 7
    oh = (h + 2 - 3) // 2 + 1
    got = _taps(w, (h, h), (oh, oh), at)
    ones = np.pad(np.ones((h, h), np.int64), 1)
    want = np.zeros((4, oh, oh), np.int64)
    for f in range(4):
        for y in range(oh):
            for x in range(oh):
                want[f, y, x] = (w[f].astype(np.int64).sum(0) * ones[2 * y:2 * y + 3, 2 * x:2 * x + 3]).sum()
    assert np.array_equal(got[0], want)
    whole = _taps(w, (h, h), (h - 2, h - 2), SimpleNamespace(strides=(1, 1), dilation=(1, 1), padding=(0, 0, 0, 0)))
    assert whole.shape == (1, 4, 1, 1) and np.array_equal(whole.ravel(), w.astype(np.int64).sum(axis=(1, 2, 3)))


def test_a_qdq_conv_the_gemm_kernel_does_not_tile_stays_an_exact_integer_conv(tmp_path, llvm_target):
    """8 output channels (no multiple of VNNI's 16 lanes): the integer conv is left a conv, and still exact; a conv
    of 8 input channels stays an fp32 conv of its dequantized input (a stem's case)."""
    import sys

    from tvmfuse import verify
    from tvmfuse.compile import build
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan.partition import partition
    from tvmfuse.target import has_vnni

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plan"))
    import models

    b = models._B(4)
    h = b.op("Relu", [b.op("Conv", ["x", b.w(8, 16, 3, 3, scale=0.2)], kernel_shape=[3, 3], pads=[1, 1, 1, 1])])
    onnx.save(b.model({"x": [1, 16, 6, 6]}, b.op("Conv", [h, b.w(24, 8, 1, 1, scale=0.2)], kernel_shape=[1, 1]),
                      [1, 24, 6, 6]), tmp_path / "m.onnx")
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 16, 6, 6)).astype(np.float32)}

    _quantize_static(tmp_path / "m.onnx", tmp_path / "q.onnx", feeds, "QInt8")
    fused, plan = partition(import_model(load_model(tmp_path / "q.onnx")), target=llvm_target)
    if has_vnni(llvm_target.target):
        assert any(n.startswith("1 quantized convs run on their uint8") for n in plan.rewrites)
        assert not any("im2col rows x int8" in n for n in plan.rewrites)
    built = build(fused, target=llvm_target, database=None)
    vm = relax.VirtualMachine(built.executable, tvm.cpu(0))
    out = vm["main"](tvm.runtime.tensor(feeds["x"]), *built.lifted_params)
    got = out.numpy() if hasattr(out, "numpy") else out[0].numpy()
    ref = verify.run_onnxruntime(tmp_path / "q.onnx", feeds)
    assert verify.relative_error(got, ref[0]) <= max(1e-4, verify.QUANTIZED_SLACK * verify.quantization_floor(
        tmp_path / "q.onnx", feeds, ref))


def test_the_quantized_gemms_register_block_is_a_searched_knob(tmp_path, llvm_target):
    """A quantized GEMM's sketch (``template: cpu_contraction``) is the VNNI kernel with its register block sampled:
    rows dividing the GEMM's (at most 8) by 16-column vectors dividing its columns, the untuned tiles among them;
    every point matches the kernel's plain lowering."""
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.kernels.cpu.int8 import default_tiles
    from tvmfuse.kernels.space import tune_context
    from tvmfuse.plan.partition import partition
    from tvmfuse.target import has_vnni
    from tvmfuse.tune.spaces import select_space

    if not has_vnni(llvm_target.target):
        pytest.skip("no avx512vnni on this CPU")
    onnx.save(_three_convs(), tmp_path / "m.onnx")
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 16, 9, 9)).astype(np.float32)}
    _quantize_static(tmp_path / "m.onnx", tmp_path / "q.onnx", feeds, "QUInt8")
    fused, _ = partition(import_model(load_model(tmp_path / "q.onnx")), target=llvm_target)
    gemms = [f for gv, f in fused.functions.items() if isinstance(f, PrimFunc) and gv.name_hint.startswith("fused_matmul")]
    assert gemms
    rng = np.random.default_rng(2)
    for func in gemms:
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        choice = select_space(mod, llvm_target.target)
        assert choice.source == "template:cpu_contraction", choice.note
        ctx = tune_context(mod, llvm_target.target, choice.generator)
        (sketch,) = ctx.generate_design_space()
        cats = [i for i in sketch.trace.insts if i.kind.name == "SampleCategorical"]
        rows, vectors = ([int(v) for v in c.attrs[0]] for c in cats)
        assert all(r <= 8 for r in rows) and set(vectors) <= {1, 2, 4}
        _random_points_match(mod, ctx, sketch, cats, rng, llvm_target, "int8 GEMM")
    assert default_tiles(49, 512) == (7, 2) and default_tiles(3136, 48) == (8, 1)
