"""The arguments a kernel is timed with in MetaSchedule's runner workers.

MetaSchedule fills every argument with random bits, integers included: a gather's indices then point anywhere
and the kernel reads out of bounds (BERT's embedding kernel ``fused_less_add_where_take_add`` crashed its worker
on every trial: "Subprocess terminated"). Floats keep TVM's random fill; integer and boolean tensors are zeros,
an index valid for every gather and a value that times the same as any other.
"""
from __future__ import annotations


def alloc_arguments(device, args_info, alloc_repeat: int) -> list:
    """``f_alloc_argument`` of ``LocalRunner``: ``alloc_repeat`` lists of tensors for ``args_info``
    (``["TENSOR", dtype, shape]`` entries)."""
    import tvm

    fill = tvm.get_global_func("tvm.contrib.random.random_fill_for_measure", True) or \
        tvm.get_global_func("tvm.contrib.random.random_fill")
    repeated = []
    for _ in range(alloc_repeat):
        args = []
        for kind, dtype, shape in args_info:
            if kind != "TENSOR":
                raise NotImplementedError(kind)
            arr = tvm.runtime.empty(shape=shape, dtype=dtype, device=device)
            if str(dtype).startswith(("float", "bfloat")):
                fill(arr)
            else:
                import numpy as np

                arr.copyfrom(np.zeros(shape, dtype=dtype))
            args.append(arr)
        repeated.append(args)
    return repeated
