"""Hostile input never crashes, hangs, or raises anything but ModelError (a few hundred examples; the
10,000-example run is benchmarks/fuzz_frontend.py)."""
from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from benchmarks.fuzzing import check_contract, mutated_bytes, mutated_models

_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=250, **_SETTINGS)
@given(data=mutated_bytes())
def test_mutated_protobuf_bytes(data):
    with tempfile.TemporaryDirectory() as d:
        check_contract(data, Path(d))


@settings(max_examples=250, **_SETTINGS)
@given(model=mutated_models())
def test_mutated_graphs(model):
    with tempfile.TemporaryDirectory() as d:
        check_contract(model.SerializeToString(), Path(d), input_shapes=None)
