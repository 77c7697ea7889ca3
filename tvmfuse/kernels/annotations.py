"""What a template sketch records on a kernel's root block, read back where the kernel is built: the annotations,
the config chosen among the candidates, and the swap of the planner's PrimFunc for the template's kernel.

The templates written whole (flash, wgmma, the row program) import this; it imports none of them.
"""
from __future__ import annotations


def root_annotations(func, *keys: str):
    """The root block's annotations of a PrimFunc when it has every key in ``keys``, else None."""
    block = getattr(getattr(func, "body", None), "block", None)
    if block is None or any(k not in block.annotations for k in keys):
        return None
    return block.annotations


def chosen(candidates, index, what: str) -> str:
    """The name at ``index`` among the ``;``-joined candidate names a record carries."""
    names, index = str(candidates).split(";"), int(index)
    if not 0 <= index < len(names):
        raise ValueError(f"{what} config {index} of {len(names)} candidates")
    return names[index]


def swap_kernels(mod, replace):
    """``mod`` with each PrimFunc for which ``replace(gv, func)`` gives a kernel replaced by it."""
    from tvmfuse._tvm import PrimFunc, tvm

    updates = {}
    for gv, func in mod.functions.items():
        if isinstance(func, PrimFunc):
            new = replace(gv, func)
            if new is not None:
                updates[gv] = new
    if not updates:
        return mod
    return tvm.IRModule({gv: updates.get(gv, f) for gv, f in mod.functions.items()}, attrs=mod.attrs)
