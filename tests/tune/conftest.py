"""Fixtures of the tuner's tests."""
import pytest


@pytest.fixture(scope="module")
def example_kernels(example_model, llvm_target):
    """The example's kernels planned for llvm, once for the tests that tune them (each tunes into its own database)."""
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.tune import extract_kernels

    return extract_kernels(partition(import_model(load_model(example_model)), target=llvm_target)[0],
                           target=llvm_target)
