"""Each high-level rewrite of ``tvmfuse.plan.rewrites`` as a Relax module pass: a small module before, the pass
applied, ``tvm.ir.assert_structural_equal`` against the module it must give; and a module it must leave as it is.

Weights are written as parameters in TVMScript and bound as constants (``BindParams``), as the importer binds
them; the expected constants are computed here from the originals, in exactly representable values.
"""
from __future__ import annotations

import numpy as np
import pytest
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvmfuse.plan.rewrites as rewrites
from tvmfuse._tvm import const_numpy, relax, tvm
from tvmfuse.plan.cost import Score
from tvmfuse.plan.tags import RewriteLog


def _bind(mod, **params):
    return relax.transform.BindParams("main", {k: np.asarray(v) for k, v in params.items()})(mod)


def _unchanged(before, rewrite) -> None:
    tvm.ir.assert_structural_equal(rewrite(before), before)


def test_every_rewrite_is_a_module_pass():
    log = RewriteLog()
    passes = [rewrites.DropInferenceIdentities(), rewrites.FoldBatchNorm(log=log), rewrites.ChannelsLast(log=log),
              rewrites.ComposeTransposes(), rewrites.Im2colNarrowConvs(log=log), rewrites.FuseAttention(log=log),
              rewrites.HorizontalGemm(log=log), rewrites.PairwiseExtrema(log=log), rewrites.PointwiseConvsAsGemms(log=log),
              rewrites.PadOutputChannels(log=log, lanes=16), rewrites.TrimDeadTaps(log=log)]
    assert all(isinstance(p, tvm.transform.Pass) for p in passes)
    assert [p.info.name for p in passes] == ["DropInferenceIdentities", "FoldBatchNorm", "ChannelsLast",
                                             "ComposeTransposes", "Im2colNarrowConvs", "FuseAttention", "HorizontalGemm",
                                             "PairwiseExtrema", "PointwiseConvsAsGemms", "PadOutputChannels",
                                             "TrimDeadTaps"]


# ---------------------------------------------------------------------------------------------- pairwise extrema
@I.ir_module
class StackedMaxMin:
    """ONNX Max(x, lo) then Min(., hi), as TVM imports them with static shapes: reductions over a stacked axis."""

    @R.function
    def main(x: R.Tensor((2, 8), "float16"), lo: R.Tensor((), "float16"),
             hi: R.Tensor((), "float16")) -> R.Tensor((2, 8), "float16"):
        with R.dataflow():
            a = R.broadcast_to(lo, R.shape([2, 8]))
            s = R.stack((x, a), axis=0)
            m = R.max(s, axis=[0], keepdims=False)
            b = R.broadcast_to(hi, R.shape([2, 8]))
            t = R.stack((m, b), axis=0)
            out = R.min(t, axis=[0], keepdims=False)
            R.output(out)
        return out


def test_variadic_max_and_min_become_pairwise_elementwise_ops():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 8), "float16"), lo: R.Tensor((), "float16"),
                 hi: R.Tensor((), "float16")) -> R.Tensor((2, 8), "float16"):
            with R.dataflow():
                a = R.broadcast_to(lo, R.shape([2, 8]))
                m = R.maximum(x, a)
                b = R.broadcast_to(hi, R.shape([2, 8]))
                out = R.minimum(m, b)
                R.output(out)
            return out

    log = RewriteLog()
    tvm.ir.assert_structural_equal(rewrites.PairwiseExtrema(log=log)(StackedMaxMin), Expected)
    assert len(log.notes) == 2 and "relax.maximum" in log.notes[0]
    x = np.random.default_rng(0).standard_normal((2, 8)).astype("float16")
    lo, hi = np.float16(-0.5), np.float16(0.25)
    got = relax.VirtualMachine(tvm.compile(rewrites.pairwise_extrema(StackedMaxMin), "llvm"), tvm.cpu())["main"](
        *(tvm.runtime.tensor(np.asarray(v)) for v in (x, lo, hi))).numpy()
    np.testing.assert_array_equal(got, np.minimum(np.maximum(x, lo), hi))


def test_a_stack_read_elsewhere_or_reduced_over_another_axis_is_left_as_it_is():
    @I.ir_module
    class StackKept:
        @R.function
        def main(x: R.Tensor((2, 8), "float32"), y: R.Tensor((2, 8), "float32")):
            with R.dataflow():
                s = R.stack((x, y), axis=0)
                m = R.max(s, axis=[0], keepdims=False)
                out = (m, s)
                R.output(out)
            return out

    @I.ir_module
    class OtherAxis:
        @R.function
        def main(x: R.Tensor((2, 8), "float32"), y: R.Tensor((2, 8), "float32")) -> R.Tensor((2, 2), "float32"):
            with R.dataflow():
                s = R.stack((x, y), axis=0)
                out = R.max(s, axis=[2], keepdims=False)
                R.output(out)
            return out

    _unchanged(StackKept, rewrites.PairwiseExtrema())
    _unchanged(OtherAxis, rewrites.PairwiseExtrema())


# ---------------------------------------------------------------------------------------------- identities
@I.ir_module
class Dropout:
    @R.function
    def main(x: R.Tensor((2, 3), "float32")) -> R.Tensor((2, 3), "float32"):
        with R.dataflow():
            y = R.nn.dropout(x, 0.5)
            z = y[0]
            out = R.nn.relu(z)
            R.output(out)
        return out


def test_dropout_is_dropped_at_inference():
    """``dropout(x)[0]`` is ``x``: the relu reads the input directly."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 3), "float32")) -> R.Tensor((2, 3), "float32"):
            with R.dataflow():
                out = R.nn.relu(x)
                R.output(out)
            return out

    tvm.ir.assert_structural_equal(rewrites.DropInferenceIdentities()(Dropout), Expected)
    tvm.ir.assert_structural_equal(rewrites.drop_inference_identities(Dropout), Expected)


def test_a_module_without_dropout_is_left_as_it_is():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3), "float32")) -> R.Tensor((2, 3), "float32"):
            with R.dataflow():
                out = R.nn.relu(x)
                R.output(out)
            return out

    _unchanged(Before, rewrites.DropInferenceIdentities())


# ---------------------------------------------------------------------------------------------- BatchNorm
@I.ir_module
class ConvBN:
    """conv2d -> (x - mean) / std + beta -> relu: inference BatchNorm as the importer decomposes it."""

    @R.function
    def main(x: R.Tensor((1, 2, 4, 4), "float32"), w: R.Tensor((3, 2, 1, 1), "float32"),
             mean: R.Tensor((1, 3, 1, 1), "float32"), std: R.Tensor((1, 3, 1, 1), "float32"),
             beta: R.Tensor((1, 3, 1, 1), "float32")) -> R.Tensor((1, 3, 4, 4), "float32"):
        with R.dataflow():
            y = R.nn.conv2d(x, w)
            a = R.subtract(y, mean)
            b = R.divide(a, std)
            c = R.add(b, beta)
            out = R.nn.relu(c)
            R.output(out)
        return out


_W = np.arange(-3, 3, dtype="float32").reshape(3, 2, 1, 1)
_MEAN, _STD, _BETA = (np.array(v, "float32").reshape(1, 3, 1, 1) for v in ([1, 2, 3], [2, 4, 8], [0.5, 0.25, 0.125]))


def test_batchnorm_after_a_conv_folds_into_its_weights_and_one_bias():
    """The subtract/divide/add by per-channel constants become a filter divided by ``std`` per output channel and
    one bias ``beta - mean / std``, added under a fresh name the plan's tag refers to."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "float32"), w: R.Tensor((3, 2, 1, 1), "float32"),
                 bias: R.Tensor((1, 3, 1, 1), "float32")) -> R.Tensor((1, 3, 4, 4), "float32"):
            with R.dataflow():
                y = R.nn.conv2d(x, w)
                bnfold_1 = R.add(y, bias)
                out = R.nn.relu(bnfold_1)
                R.output(out)
            return out

    log = RewriteLog()
    after = rewrites.FoldBatchNorm(log=log)(_bind(ConvBN, w=_W, mean=_MEAN, std=_STD, beta=_BETA))
    expected = _bind(Expected, w=_W / _STD.reshape(3, 1, 1, 1), bias=_BETA - _MEAN / _STD)
    tvm.ir.assert_structural_equal(after, expected)
    assert log.tags["bnfold_1"].ops == ("subtract", "divide", "add")


def test_a_conv_bias_alone_or_a_batchnorm_of_variables_is_not_folded():
    @I.ir_module
    class Bias:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "float32"), w: R.Tensor((3, 2, 1, 1), "float32"),
                 beta: R.Tensor((1, 3, 1, 1), "float32")) -> R.Tensor((1, 3, 4, 4), "float32"):
            with R.dataflow():
                y = R.nn.conv2d(x, w)
                out = R.add(y, beta)
                R.output(out)
            return out

    log = RewriteLog()
    _unchanged(_bind(Bias, w=_W, beta=_BETA), rewrites.FoldBatchNorm(log=log))
    # mean, std and beta as inputs of the model (not constants): nothing to fold them into
    _unchanged(_bind(ConvBN, w=_W), rewrites.FoldBatchNorm(log=log))
    assert not log.tags and not log.notes


# ------------------------------------------------------------------------------------------ channels last
@I.ir_module
class ConvRelu:
    @R.function
    def main(x: R.Tensor((1, 2, 4, 4), "float32"), w: R.Tensor((3, 2, 3, 3), "float32")
             ) -> R.Tensor((1, 3, 4, 4), "float32"):
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
            out = R.nn.relu(y)
            R.output(out)
        return out


def test_convs_run_channels_last_with_transposes_at_the_edges():
    """The conv runs NHWC with an OHWI filter (the transpose folded into the constant); the relu follows the
    layout; one transpose in front of the conv, one where the result leaves."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "float32"), w: R.Tensor((3, 3, 3, 2), "float32")
                 ) -> R.Tensor((1, 3, 4, 4), "float32"):
            with R.dataflow():
                xt = R.permute_dims(x, [0, 2, 3, 1])
                y = R.nn.conv2d(xt, w, padding=[1, 1, 1, 1], data_layout="NHWC", kernel_layout="OHWI",
                                out_layout="NHWC")
                r = R.nn.relu(y)
                out = R.permute_dims(r, [0, 3, 1, 2])
                R.output(out)
            return out

    w = np.arange(54, dtype="float32").reshape(3, 2, 3, 3)
    log = RewriteLog()
    after = rewrites.ChannelsLast(log=log)(_bind(ConvRelu, w=w))
    tvm.ir.assert_structural_equal(after, _bind(Expected, w=w.transpose(0, 2, 3, 1)))
    assert log.notes == ["convolutions run channels-last (NHWC): 2 layout transposes added at the edges"]
    tvm.ir.assert_structural_equal(rewrites.channels_last(_bind(ConvRelu, w=w), log=RewriteLog()), after)


@I.ir_module
class DepthwiseGroupedPointwise:
    @R.function
    def main(x: R.Tensor((1, 4, 5, 5), "float32"), dw: R.Tensor((4, 1, 3, 3), "float32"),
             gw: R.Tensor((4, 2, 3, 3), "float32"), pw: R.Tensor((6, 4, 1, 1), "float32")
             ) -> R.Tensor((1, 6, 5, 5), "float32"):
        with R.dataflow():
            y = R.nn.conv2d(x, dw, padding=[1, 1, 1, 1], groups=4)
            z = R.nn.conv2d(y, gw, padding=[1, 1, 1, 1], groups=2)
            out = R.nn.conv2d(z, pw)
            R.output(out)
        return out


def test_depthwise_convs_take_hwio_filters_where_asked_and_compute_the_same():
    """On GPUs a depthwise conv's filter is stored HWIO (adjacent output channels' weights side by side for the
    threads that compute them); a grouped conv of wider groups (its reduction spread over threads, read along
    OHWI's contiguous axis) and the 1x1 conv (the tensor-core template's) keep OHWI. Same outputs."""
    from tvmfuse.plan.rewrites._common import main_bindings, op_name

    rng = np.random.default_rng(0)
    dw, gw, pw = (rng.integers(-2, 3, s).astype("float32") for s in ((4, 1, 3, 3), (4, 2, 3, 3), (6, 4, 1, 1)))
    before = _bind(DepthwiseGroupedPointwise, dw=dw, gw=gw, pw=pw)
    log = RewriteLog()
    after = rewrites.ChannelsLast(log=log, depthwise_kernel_layout="HWIO")(before)
    convs = [b.value for b in main_bindings(after) if op_name(b.value) == "relax.nn.conv2d"]
    assert [(str(c.attrs.kernel_layout), int(c.attrs.groups)) for c in convs] == [("HWIO", 4), ("OHWI", 2),
                                                                                  ("OHWI", 1)]
    assert const_numpy(convs[0].args[1]).shape == (3, 3, 1, 4)
    assert log.notes[0].endswith("; 1 depthwise convs' filters HWIO")
    plain = rewrites.ChannelsLast(log=RewriteLog())(before)
    assert {str(b.value.attrs.kernel_layout) for b in main_bindings(plain) if op_name(b.value) == "relax.nn.conv2d"} \
        == {"OHWI"}
    x = rng.integers(-2, 3, (1, 4, 5, 5)).astype("float32")
    np.testing.assert_array_equal(_run_llvm(after, x), _run_llvm(before, x))


def test_a_module_without_convs_keeps_its_layout():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2, 4, 4), "float32")) -> R.Tensor((1, 2, 4, 4), "float32"):
            with R.dataflow():
                out = R.nn.relu(x)
                R.output(out)
            return out

    log = RewriteLog()
    _unchanged(Before, rewrites.ChannelsLast(log=log))
    assert not log.notes


# ------------------------------------------------------------------------------------- composed transposes
def test_transposes_compose_and_identities_vanish():
    """``permute_dims(permute_dims(x, [1, 0, 2]), [0, 2, 1])`` is ``permute_dims(x, [1, 2, 0])``; a transpose
    undone by the next is ``x``. The inner transpose ``c`` stays, as the output still reads it."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 4), "float32")):
            with R.dataflow():
                a = R.permute_dims(x, [1, 0, 2])
                b = R.permute_dims(a, [0, 2, 1])
                c = R.permute_dims(x, [0, 2, 1])
                d = R.permute_dims(c, [0, 2, 1])
                out = (b, c, d)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 3, 4), "float32")):
            with R.dataflow():
                b = R.permute_dims(x, [1, 2, 0])
                c = R.permute_dims(x, [0, 2, 1])
                out = (b, c, x)
                R.output(out)
            return out

    tvm.ir.assert_structural_equal(rewrites.ComposeTransposes()(Before), Expected)
    after, removed = rewrites.compose_transposes(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert removed == 2


def test_lone_transposes_are_left_as_they_are():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 4), "float32")) -> R.Tensor((4, 3, 2), "float32"):
            with R.dataflow():
                a = R.permute_dims(x, [0, 2, 1])
                b = R.nn.relu(a)
                out = R.permute_dims(b, [1, 0, 2])
                R.output(out)
            return out

    _unchanged(Before, rewrites.ComposeTransposes())
    assert rewrites.compose_transposes(Before)[1] == 0


# -------------------------------------------------------------------------------------------- narrow convs
@I.ir_module
class Stem:
    """A network's stem in miniature: NHWC fp16, 3 input channels, 3x3, stride 2, padding 1."""

    @R.function
    def main(x: R.Tensor((1, 5, 5, 3), "float16"), w: R.Tensor((4, 3, 3, 3), "float16")
             ) -> R.Tensor((1, 3, 3, 4), "float16"):
        with R.dataflow():
            y = R.nn.conv2d(x, w, strides=[2, 2], padding=[1, 1, 1, 1], data_layout="NHWC", kernel_layout="OHWI")
            out = R.nn.relu(y)
            R.output(out)
        return out


_STEM_W = (np.arange(108) % 13 - 6).astype("float16").reshape(4, 3, 3, 3)


def test_a_narrow_conv_becomes_im2col_rows_and_a_gemm():
    """The conv becomes: the im2col rows (one per output pixel m = (n, oh, ow); K = 3 channels x 3x3 taps = 27,
    in (c, r, s) order, so that adjacent K read adjacent pixels of the image; zero-padded to 64; zero where the
    window leaves the input), a matmul by the filter as a [64, 4] constant in the same order, and a reshape back to
    NHWC. The kernel below was printed once from the rewrite and checked by reading: row m reads
    x[n, (m % 9 // 3) * 2 - 1 + r, (m % 3) * 2 - 1 + s, c] for kk = c * 9 + r * 3 + s."""

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def im2col(x: T.Buffer((T.int64(1), T.int64(5), T.int64(5), T.int64(3)), "float16"),
                   rows: T.Buffer((T.int64(9), T.int64(64)), "float16")):
            T.func_attr({"tirx.noalias": True})
            for m, kk in T.grid(T.int64(9), T.int64(64)):
                with T.sblock("im2col"):
                    v_m, v_kk = T.axis.remap("SS", [m, kk])
                    T.reads(x[v_m // T.int64(9), v_m % T.int64(9) // T.int64(3) * T.int64(2) + v_kk % T.int64(9) // T.int64(3) - T.int64(1),
                              v_m % T.int64(3) * T.int64(2) + v_kk % T.int64(3) - T.int64(1),
                              v_kk // T.int64(9)])
                    T.writes(rows[v_m, v_kk])
                    rows[v_m, v_kk] = T.if_then_else(
                        v_kk < T.int64(27)
                        and T.int64(1) <= v_m % T.int64(9) // T.int64(3) * T.int64(2) + v_kk % T.int64(9) // T.int64(3)
                        and v_m % T.int64(9) // T.int64(3) * T.int64(2) + v_kk % T.int64(9) // T.int64(3) < T.int64(6)
                        and T.int64(1) <= v_m % T.int64(3) * T.int64(2) + v_kk % T.int64(3)
                        and v_m % T.int64(3) * T.int64(2) + v_kk % T.int64(3) < T.int64(6),
                        x[v_m // T.int64(9), v_m % T.int64(9) // T.int64(3) * T.int64(2) + v_kk % T.int64(9) // T.int64(3) - T.int64(1),
                          v_m % T.int64(3) * T.int64(2) + v_kk % T.int64(3) - T.int64(1),
                          v_kk // T.int64(9)],
                        T.float16(0.0))

        @R.function
        def main(x: R.Tensor((1, 5, 5, 3), "float16"), w: R.Tensor((64, 4), "float16")
                 ) -> R.Tensor((1, 3, 3, 4), "float16"):
            cls = Expected
            with R.dataflow():
                rows = R.call_tir(cls.im2col, (x,), out_ty=R.Tensor((9, 64), "float16"))
                gemm = R.matmul(rows, w, out_dtype="float16")
                y = R.reshape(gemm, R.shape([1, 3, 3, 4]))
                out = R.nn.relu(y)
                R.output(out)
            return out

    w_mat = np.zeros((64, 4), "float16")
    w_mat[:27] = _STEM_W.transpose(3, 1, 2, 0).reshape(27, 4)   # [f, r, s, c] -> [c, r, s, f] -> [K, F]
    log = RewriteLog()
    after = rewrites.Im2colNarrowConvs(log=log)(_bind(Stem, w=_STEM_W))
    tvm.ir.assert_structural_equal(after, _bind(Expected, w=w_mat))
    assert log.notes == ["conv y (3 input channels, 3x3) runs as im2col + GEMM (K 27 padded to 64)"]
    again = rewrites.im2col_narrow_convs(_bind(Stem, w=_STEM_W), log=RewriteLog())
    tvm.ir.assert_structural_equal(again, after)


def test_wide_fp32_or_too_deep_convs_stay_convs():
    """16 channels and more, fp32 inputs, or a K past ``limit_k``: the conv is left as it is."""

    @I.ir_module
    class Wide:
        @R.function
        def main(x: R.Tensor((1, 5, 5, 16), "float16"), w: R.Tensor((4, 3, 3, 16), "float16")
                 ) -> R.Tensor((1, 3, 3, 4), "float16"):
            with R.dataflow():
                out = R.nn.conv2d(x, w, strides=[2, 2], padding=[1, 1, 1, 1], data_layout="NHWC",
                                  kernel_layout="OHWI")
                R.output(out)
            return out

    @I.ir_module
    class Fp32:
        @R.function
        def main(x: R.Tensor((1, 5, 5, 3), "float32"), w: R.Tensor((4, 3, 3, 3), "float32")
                 ) -> R.Tensor((1, 3, 3, 4), "float32"):
            with R.dataflow():
                out = R.nn.conv2d(x, w, strides=[2, 2], padding=[1, 1, 1, 1], data_layout="NHWC",
                                  kernel_layout="OHWI")
                R.output(out)
            return out

    log = RewriteLog()
    _unchanged(_bind(Wide, w=np.ones((4, 3, 3, 16), "float16")), rewrites.Im2colNarrowConvs(log=log))
    _unchanged(_bind(Fp32, w=_STEM_W.astype("float32")), rewrites.Im2colNarrowConvs(log=log))
    _unchanged(_bind(Stem, w=_STEM_W), rewrites.Im2colNarrowConvs(log=log, limit_k=32))   # K 27 pads to 64
    assert not log.notes and not log.tags


def _run_llvm(mod, *args):
    """``main`` of ``mod`` compiled for llvm and run on ``args`` (numpy arrays)."""
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _conv_module(*, hw: int, cin: int, cout: int, k: int, stride: int, dtype: str):
    """relu(conv(x, w) + b), NHWC / OHWI, "same" padding, its weights parameters to bind."""
    pad = k // 2
    oh = (hw + 2 * pad - k) // stride + 1
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, hw, hw, cin), dtype))
    w = relax.Var("w", relax.TensorType((cout, k, k, cin), dtype))
    b = relax.Var("b", relax.TensorType((1, 1, 1, cout), dtype))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, strides=[stride, stride], padding=[pad] * 4, data_layout="NHWC",
                                           kernel_layout="OHWI"))
            out = bb.emit_output(relax.op.nn.relu(relax.op.add(y, b)))
        bb.emit_func_output(out)
    return bb.finalize(), oh


def _weights(cout, k, cin, dtype, seed=0):
    rng = np.random.default_rng(seed)
    # small integers: every product and sum exact in fp16 and fp32, so the rewritten module agrees bitwise
    return (rng.integers(-2, 3, (cout, k, k, cin)).astype(dtype), rng.integers(-2, 3, (1, 1, 1, cout)).astype(dtype))


def _calls(mod) -> set:
    from tvmfuse.plan.rewrites._common import main_bindings, op_name

    return {op_name(b.value) for b in main_bindings(mod)}


@pytest.mark.parametrize("dtype,hw,stride", [("float32", 8, 1), ("float32", 16, 2), ("float16", 4, 1)])
def test_a_few_pixel_or_untemplated_conv_becomes_im2col_and_a_gemm(dtype, hw, stride):
    """A 3x3 conv of 64 channels: at 16 output pixels or fewer (fp16, 4 x 4) or fp32 up to 256 pixels (8 x 8, and
    16 x 16 at stride 2) it runs as im2col + GEMM, and computes what the conv computed."""
    mod, oh = _conv_module(hw=hw, cin=64, cout=32, k=3, stride=stride, dtype=dtype)
    w, b = _weights(32, 3, 64, dtype)
    before = _bind(mod, w=w, b=b)
    log = RewriteLog()
    after = rewrites.Im2colNarrowConvs(log=log, few_pixels=16, untemplated_pixels=256)(before)
    assert "relax.nn.conv2d" not in _calls(after) and "relax.matmul" in _calls(after)
    assert log.notes == [f"conv lv (64 input channels, 3x3, {oh * oh} output pixels) runs as im2col + GEMM "
                         "(K 576 padded to 576)"]
    x = np.random.default_rng(1).integers(-2, 3, (1, hw, hw, 64)).astype(dtype)
    np.testing.assert_array_equal(_run_llvm(after, x), _run_llvm(before, x))


def test_many_pixel_fp16_convs_and_large_fp32_convs_stay_convs():
    """fp16 at 64 pixels has the tensor-core conv template; fp32 at 324 pixels is past ``untemplated_pixels``; a 1x1
    conv of stride 1 is a GEMM as it is (pointwise_convs_as_gemms takes it)."""
    log = RewriteLog()
    rewrite = rewrites.Im2colNarrowConvs(log=log, few_pixels=16, untemplated_pixels=256)
    for dtype, hw, k in (("float16", 8, 3), ("float32", 18, 3), ("float32", 2, 1)):
        mod, _ = _conv_module(hw=hw, cin=64, cout=32, k=k, stride=1, dtype=dtype)
        _unchanged(_bind(mod, **dict(zip("wb", _weights(32, k, 64, dtype)))), rewrite)
    assert not log.notes


@pytest.mark.parametrize("dtype,hw,stride,rewritten", [
    ("float32", 32, 1, True),    # fp32: no conv template takes it, at any size
    ("float16", 8, 1, True),     # 64 pixels: the gemv template's rows on tensor cores
    ("float16", 16, 1, False),   # 256 fp16 pixels: the tensor-core conv template's
    ("float32", 8, 2, False),    # strided: not a GEMM as it is (im2col's, at few pixels)
])
def test_pointwise_convs_that_no_conv_template_takes_become_gemms(dtype, hw, stride, rewritten):
    """A 1x1 conv as ``matmul(x, W)`` on the NHWC input, the filter a [C, F] constant, nothing reshaped; the result
    is the conv's."""
    mod, _ = _conv_module(hw=hw, cin=32, cout=16, k=1, stride=stride, dtype=dtype)
    w, b = _weights(16, 1, 32, dtype)
    before = _bind(mod, w=w, b=b)
    log = RewriteLog()
    after = rewrites.PointwiseConvsAsGemms(log=log)(before)
    if not rewritten:
        tvm.ir.assert_structural_equal(after, before)
        assert not log.notes
        return
    assert _calls(after) == {"relax.matmul", "relax.add", "relax.nn.relu"}
    (gemm,) = [b.value for b in after["main"].body.blocks[0].bindings if b.value.op.name == "relax.matmul"]
    np.testing.assert_array_equal(const_numpy(gemm.args[1]), w.reshape(16, 32).T)
    assert log.notes == [f"1 1x1 convs run as GEMMs ({hw * hw} pixels): no conv template takes them"]
    x = np.random.default_rng(2).integers(-2, 3, (1, hw, hw, 32)).astype(dtype)
    np.testing.assert_array_equal(_run_llvm(after, x), _run_llvm(before, x))


# ---------------------------------------------------------------------------------------------- padded channels
def _gemm_and_conv(n_gemm: int, n_conv: int):
    """relu(x @ W + b) and relu(conv(y, F) + c) (NHWC, HWIO), their weights parameters to bind."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 32), "float32"))
    y = relax.Var("y", relax.TensorType((1, 3, 3, 16), "float32"))
    w = relax.Var("w", relax.TensorType((32, n_gemm), "float32"))
    b = relax.Var("b", relax.TensorType((n_gemm,), "float32"))
    f = relax.Var("f", relax.TensorType((3, 3, 16, n_conv), "float32"))
    c = relax.Var("c", relax.TensorType((1, 1, 1, n_conv), "float32"))
    with bb.function("main", [x, y, w, b, f, c]):
        with bb.dataflow():
            g = bb.emit(relax.op.nn.relu(relax.op.add(relax.op.matmul(x, w), b)))
            v = bb.emit(relax.op.nn.conv2d(y, f, padding=[1] * 4, data_layout="NHWC", kernel_layout="HWIO"))
            out = bb.emit_output(relax.Tuple([g, relax.op.nn.relu(relax.op.add(v, c))]))
        bb.emit_func_output(out)
    rng = np.random.default_rng(3)
    params = {"w": rng.integers(-2, 3, (32, n_gemm)), "b": rng.integers(-2, 3, (n_gemm,)),
              "f": rng.integers(-2, 3, (3, 3, 16, n_conv)), "c": rng.integers(-2, 3, (1, 1, 1, n_conv))}
    return _bind(bb.finalize(), **{k: v.astype("float32") for k, v in params.items()})


def test_gemms_and_convs_whose_channels_no_vector_divides_run_on_padded_weights():
    """1000 GEMM columns and 120 conv channels are no multiple of 16 lanes: the weights are zero-padded to 1008
    and 128 columns, a slice keeps the real channels, and the results are the unpadded ones."""
    before = _gemm_and_conv(1000, 120)
    log = RewriteLog()
    after = rewrites.PadOutputChannels(log=log, lanes=16)(before)
    from tvmfuse.plan.rewrites._common import main_bindings, op_name

    weights = {op_name(b.value): const_numpy(b.value.args[1]).shape for b in main_bindings(after)
               if op_name(b.value) in ("relax.matmul", "relax.nn.conv2d")}
    assert weights == {"relax.matmul": (32, 1008), "relax.nn.conv2d": (3, 3, 16, 128)}
    assert "relax.strided_slice" in _calls(after)
    assert log.notes == ["2 GEMMs / convs of 120, 1000 output channels run on weights padded to whole 16-lane "
                         "vectors, their extra channels sliced off in the kernel"]
    rng = np.random.default_rng(4)
    x, y = rng.integers(-2, 3, (4, 32)).astype("float32"), rng.integers(-2, 3, (1, 3, 3, 16)).astype("float32")
    ex_a, ex_b = (relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu()) for m in (after, before))
    got, want = ex_a["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y)), ex_b["main"](
        tvm.runtime.tensor(x), tvm.runtime.tensor(y))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w.numpy())


def test_channels_a_vector_divides_or_that_padding_would_inflate_are_left_as_they_are():
    """1024 and 128 channels need no padding; 24 channels would compute 32 (a third more work)."""
    log = RewriteLog()
    for n_gemm, n_conv in ((1024, 128), (24, 8)):
        _unchanged(_gemm_and_conv(n_gemm, n_conv), rewrites.PadOutputChannels(log=log, lanes=16))
    assert not log.notes


# ---------------------------------------------------------------------------------------------- attention
@I.ir_module
class Attention:
    """softmax(Q Kᵀ * 0.5 + mask) V, K given as rows and transposed in the graph."""

    @R.function
    def main(q: R.Tensor((2, 8, 4), "float32"), k: R.Tensor((2, 8, 4), "float32"),
             v: R.Tensor((2, 8, 4), "float32"), mask: R.Tensor((1, 8, 8), "float32")
             ) -> R.Tensor((2, 8, 4), "float32"):
        with R.dataflow():
            kt = R.permute_dims(k, [0, 2, 1])
            s = R.matmul(q, kt)
            s2 = R.multiply(s, R.const(0.5, "float32"))
            s3 = R.add(s2, mask)
            p = R.nn.softmax(s3, axis=-1)
            out = R.matmul(p, v)
            R.output(out)
        return out


def test_attention_becomes_one_kernel_call():
    """The transpose, both matmuls, the scale, the mask and the softmax become one ``call_tir`` of the attention
    kernel for this spec (K read as rows, scale 0.5 before the [1, 8, 8] mask); the kernel is the one
    :func:`tvmfuse.plan.attention.attention_primfunc` makes for the spec written here."""
    from tvmfuse.plan.attention import AttentionSpec, attention_primfunc

    spec = AttentionSpec(batch=(2,), seq_q=8, seq_k=8, head_dim=4, head_dim_v=4, dtype="float32", scale=0.5,
                         mask_shape=(1, 8, 8), scale_first=True, k_rows=True)
    params = [relax.Var(n, R.Tensor(s, "float32")) for n, s in
              (("q", (2, 8, 4)), ("k", (2, 8, 4)), ("v", (2, 8, 4)), ("mask", (1, 8, 8)))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            kernel = bb.add_func(attention_primfunc(spec), "attention")
            out = bb.emit_output(relax.call_tir(kernel, relax.Tuple(params), out_ty=R.Tensor((2, 8, 4), "float32")))
        bb.emit_func_output(out)
    log = RewriteLog()
    tvm.ir.assert_structural_equal(rewrites.FuseAttention(log=log)(Attention), bb.finalize())
    assert log.tags["attention_1"].ops == ("transpose", "matmul", "multiply", "add", "softmax", "matmul")


def test_attention_whose_scores_are_read_twice_or_declined_is_not_fused():
    """Scores another op reads (here: returned) must be written; a declined match is reported, not formed."""

    @I.ir_module
    class Probs:
        @R.function
        def main(q: R.Tensor((2, 8, 4), "float32"), kt: R.Tensor((2, 4, 8), "float32"),
                 v: R.Tensor((2, 8, 4), "float32")):
            with R.dataflow():
                s = R.matmul(q, kt)
                p = R.nn.softmax(s, axis=-1)
                o = R.matmul(p, v)
                out = (o, p)
                R.output(out)
            return out

    log = RewriteLog()
    _unchanged(Probs, rewrites.FuseAttention(log=log))
    assert not log.rejected and not log.tags
    _unchanged(Attention, rewrites.FuseAttention(log=log, decline="not on this target"))
    (rejection,) = log.rejected
    assert rejection.reason == "attention not fused: not on this target"


# ---------------------------------------------------------------------------------------------- horizontal
class _Says:
    """A cost model that takes (or refuses) every horizontal merge."""

    def __init__(self, profitable: bool):
        self.profitable = profitable

    def score_horizontal(self, **_):
        return Score(self.profitable, 1.0 if self.profitable else 0.0, 7, reason="" if self.profitable else "no")


@I.ir_module
class TwoGemms:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w1: R.Tensor((8, 2), "float32"), w2: R.Tensor((8, 3), "float32"),
             b1: R.Tensor((2,), "float32"), b2: R.Tensor((3,), "float32")):
        with R.dataflow():
            y1 = R.matmul(x, w1)
            z1 = R.add(y1, b1)
            y2 = R.matmul(x, w2)
            z2 = R.add(y2, b2)
            out = (z1, z2)
            R.output(out)
        return out


_W1, _W2 = np.arange(16, dtype="float32").reshape(8, 2), -np.arange(24, dtype="float32").reshape(8, 3)
_B1, _B2 = np.array([1, 2], "float32"), np.array([3, 4, 5], "float32")


def test_gemms_of_one_input_merge_into_one_on_concatenated_weights():
    """One matmul by [W1 | W2], one add of [b1 | b2], and a slice of the last axis per branch."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 5), "float32"), b: R.Tensor((5,), "float32")):
            with R.dataflow():
                mm = R.matmul(x, w)
                merged = R.add(mm, b)
                s1 = R.strided_slice(merged, axes=[-1], begin=[0], end=[2])
                s2 = R.strided_slice(merged, axes=[-1], begin=[2], end=[5])
                out = (s1, s2)
                R.output(out)
            return out

    log = RewriteLog()
    after = rewrites.HorizontalGemm(log=log, cost_model=_Says(True))(_bind(TwoGemms, w1=_W1, w2=_W2, b1=_B1, b2=_B2))
    expected = _bind(Expected, w=np.concatenate([_W1, _W2], axis=1), b=np.concatenate([_B1, _B2]))
    tvm.ir.assert_structural_equal(after, expected)
    assert log.notes == ["2 GEMMs reading x merged into one (7 B saved)"]


@pytest.mark.parametrize("bound", [True, False])
def test_gemms_are_not_merged_when_unprofitable_or_their_weights_are_inputs(bound):
    log = RewriteLog()
    if bound:   # constant weights, but the cost model says no: reported as a fusion not taken
        before = _bind(TwoGemms, w1=_W1, w2=_W2, b1=_B1, b2=_B2)
        _unchanged(before, rewrites.HorizontalGemm(log=log, cost_model=_Says(False)))
        assert [r.reason for r in log.rejected] == ["horizontal merge of 2 GEMMs reading x: no"]
    else:       # weights as model inputs: nothing to concatenate
        _unchanged(TwoGemms, rewrites.HorizontalGemm(log=log, cost_model=_Says(True)))
        assert not log.rejected
    assert not log.notes
