"""The relative error every correctness check uses (kernel checks, onnxruntime comparisons)."""
from __future__ import annotations

import warnings

import numpy as np

from tvmfuse.verify import relative_error


def test_relative_error_is_the_norm_ratio_over_finite_values():
    ref = np.array([3.0, 4.0], dtype=np.float32)
    assert relative_error(ref, ref) == 0.0
    assert abs(relative_error(np.array([3.0, 4.5], dtype=np.float32), ref) - 0.1) < 1e-7
    assert relative_error(np.zeros(3), np.zeros(2)) == float("inf")


def test_an_overflow_in_the_reference_alone_fails_and_matching_ones_compare_the_rest():
    ref = np.array([np.inf, 3.0, 4.0], dtype=np.float16)
    # an inf in the reference used to make its norm inf and any output's error 0
    assert relative_error(np.array([60000.0, 100.0, -7.0], dtype=np.float16), ref) == float("inf")
    assert relative_error(np.array([-np.inf, 3.0, 4.0], dtype=np.float16), ref) == float("inf")
    assert relative_error(np.array([np.nan, 3.0, 4.0], dtype=np.float16), ref) == float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no "invalid value encountered in subtract" (inf - inf) on the console
        assert relative_error(np.array([np.inf, 3.0, 4.5], dtype=np.float16), ref) == 0.1
        assert relative_error(np.array([np.nan, 3.0, 4.0]), np.array([np.nan, 3.0, 4.0])) == 0.0


def test_an_unwritten_poisoned_output_fails():
    ref = np.ones((4, 4), dtype=np.float32)
    out = ref.copy()
    out[2, 3] = np.nan
    assert relative_error(out, ref) == float("inf")
