"""Read the tuning database and show what tuning did: per fused kernel and per model.

``inspect_database(InspectConfig(db=...))`` returns a JSON-ready report (what ``tvmfuse inspect --json``
prints); notebooks turn its ``kernels`` list (with each kernel's ``trial_ms`` curve) into DataFrames.
"""
from tvmfuse.inspect.ceilings import Ceilings, ceilings_for, measure_matmul_flops, measure_memcpy_gbs
from tvmfuse.inspect.frames import curves_frame, kernels_frame
from tvmfuse.inspect.report import InspectConfig, inspect_database
from tvmfuse.inspect.workload import BufferInfo, buffers, flops, hbm_bytes, ops_from_name, pattern_from_name

__all__ = ["InspectConfig", "inspect_database", "Ceilings", "ceilings_for", "measure_memcpy_gbs",
           "measure_matmul_flops", "BufferInfo", "buffers", "flops", "hbm_bytes", "ops_from_name",
           "pattern_from_name", "kernels_frame", "curves_frame"]
