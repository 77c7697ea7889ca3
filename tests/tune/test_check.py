"""The tuner's kernel check against references: a half-precision kernel is held to its float32 computation too.

The reference schedules reduce a row in order in the kernel's own type. For an fp16 softmax over 3648 columns that
sum is 0.1 off the exact softmax, so on the H200 every tree-reduced (more accurate) tuned record was rejected.
"""
from __future__ import annotations

import numpy as np
import pytest

from tvmfuse._tvm import tvm
from tvmfuse.tune.check import build_references, check_kernel, promoted, random_args, run_kernel

ROWS, COLS = 40, 3648


def _softmax(compute: str, scale: float = 1.0):
    """softmax over the last axis of an fp16 [ROWS, COLS] tensor, fp16 out; ``compute``: the type it computes in
    (float16: the planner's kernel, in order; float32: the exact one rounded once to fp16)."""
    from tvm import te, topi

    x = te.placeholder((ROWS, COLS), "float16", name="x")
    xs = x if compute == "float16" else topi.cast(x, compute)
    if scale != 1.0:
        xs = topi.multiply(xs, tvm.tirx.const(scale, compute))
    y = topi.nn.softmax(xs)
    y = y if compute == "float16" else topi.cast(y, "float16")
    return tvm.IRModule({"main": te.create_prim_func([x, y]).with_attr("global_symbol", "main")})


@pytest.fixture(scope="module")
def planner_kernel():
    return _softmax("float16")


@pytest.fixture(scope="module")
def refs(planner_kernel, llvm_target):
    return build_references(planner_kernel, llvm_target)


def test_a_half_kernel_gets_a_float32_reference_that_computes_the_exact_softmax(planner_kernel, refs, llvm_target):
    assert [r.precision for r in refs] == ["float32", "kernel"]
    assert "float16" not in promoted(planner_kernel)["main"].script()
    arrays, out_idx = random_args(planner_kernel["main"], np.random.default_rng(0))
    x = arrays[0].astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    exact = e / e.sum(-1, keepdims=True)
    errors = {}
    for r in refs:
        (out,) = run_kernel(r.lib, arrays, out_idx, llvm_target.tvm_device(), dtypes=r.dtypes)
        errors[r.precision] = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    assert errors["float32"] < 1e-5
    assert errors["kernel"] > 1e-2   # the in-order fp16 sum: why the kernel's own precision alone is no reference


def test_a_more_accurate_record_passes_where_the_in_order_reference_alone_rejected_it(planner_kernel, refs,
                                                                                       llvm_target):
    accurate = _softmax("float32")
    check = check_kernel(planner_kernel, accurate, llvm_target, refs=refs)
    assert check.ok and check.reference == "float32"
    own_only = check_kernel(planner_kernel, accurate, llvm_target, refs=[r for r in refs if r.precision == "kernel"])
    assert not own_only.ok and own_only.rel_error > 1e-2


def test_a_record_that_rounds_like_the_untuned_kernel_still_passes(planner_kernel, refs, llvm_target):
    check = check_kernel(planner_kernel, planner_kernel, llvm_target, refs=refs)
    assert check.ok and check.reference == "kernel" and check.rel_error == 0.0


def test_a_wrong_record_fails_against_both_references(planner_kernel, refs, llvm_target):
    check = check_kernel(planner_kernel, _softmax("float32", scale=1.5), llvm_target, refs=refs)
    assert not check.ok and check.rel_error > 1e-2


def test_a_float32_kernel_has_one_reference(llvm_target):
    from tvm import te, topi

    x = te.placeholder((4, 64), "float32", name="x")
    mod = tvm.IRModule({"main": te.create_prim_func([x, topi.nn.softmax(x)]).with_attr("global_symbol", "main")})
    assert promoted(mod) is mod
    assert [r.precision for r in build_references(mod, llvm_target)] == ["kernel"]


def test_integer_inputs_stay_inside_the_smallest_table_a_kernel_gathers_from(llvm_target):
    # RoBERTa's embedding kernel: word and token-type tables (1000 and 2 rows) indexed by integer inputs; ids of
    # 0..3 read past the 2-row table in the kernel and its reference alike, so every record was rejected
    from tvm import te, topi

    from tvmfuse.tune.check import gathered_rows

    ids = te.placeholder((2, 16), "int64", name="ids")
    types = te.placeholder((2, 16), "int64", name="types")
    words = te.placeholder((1000, 8), "float32", name="words")
    table = te.placeholder((2, 8), "float32", name="table")
    out = topi.add(topi.take(words, ids, axis=0), topi.take(table, types, axis=0))
    mod = tvm.IRModule({"main": te.create_prim_func([ids, types, words, table, out]).with_attr("global_symbol", "main")})
    assert gathered_rows(mod["main"]) == 2
    arrays, _ = random_args(mod["main"], np.random.default_rng(0))
    assert arrays[1].max() <= 1 and arrays[0].max() <= 1
    assert check_kernel(mod, mod, llvm_target).ok
    x = te.placeholder((4, 64), "float32", name="x")
    assert gathered_rows(te.create_prim_func([x, topi.nn.softmax(x)])) is None


def test_a_quantize_epilogue_may_land_one_quantum_off_on_a_few_outputs():
    """A kernel that rounds floats to an 8-bit grid passes with a few outputs one quantum off (a tiled schedule's
    contracted multiply-adds move a float across a rounding boundary the plain schedule does not); two quanta, or
    a larger share one quantum off, still fail."""
    import numpy as np
    from tvm import te

    from tvmfuse.tune.check import QUANTUM_SHARE, _quantum_tolerance, rounds_to_integers
    from tvmfuse.verify import relative_error

    x = te.placeholder((64, 64), "float32", name="x")
    q = te.compute((64, 64), lambda i, j: te.round(x[i, j] / 0.1).astype("uint8"), name="q")
    a = te.placeholder((64, 64), "int32", name="a")
    s = te.compute((64, 64), lambda i, j: a[i, j] * 2, name="s")
    assert rounds_to_integers(te.create_prim_func([x, q])) and not rounds_to_integers(te.create_prim_func([a, s]))
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 255, 100_000).astype(np.uint8)
    few = ref.copy()
    few[rng.choice(ref.size, int(QUANTUM_SHARE * ref.size) // 2, replace=False)] ^= 1   # one quantum off
    assert relative_error(few, ref) <= _quantum_tolerance(few, ref)
    many = ref.copy()
    many[rng.choice(ref.size, int(QUANTUM_SHARE * ref.size) * 4, replace=False)] ^= 1
    assert relative_error(many, ref) > _quantum_tolerance(many, ref)
    far = ref.copy()
    far[0] = ref[0] + 2 if ref[0] < 250 else ref[0] - 2
    assert _quantum_tolerance(far, ref) == 0.0
