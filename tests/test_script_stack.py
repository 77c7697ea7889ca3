"""tvmfuse._tvm's lazy stack for TVMScript's decorators: the frames ``inspect.stack()`` would give, each read as
``inspect.stack()`` builds it, and the TVMScript forms that read them (a prim_func inside an ``@I.ir_module`` class,
a buffer shape named only in a string annotation) still parse as they do with the real ``inspect.stack()``."""
from __future__ import annotations   # the annotations below are strings: TVM resolves their names from the stack

import inspect

import pytest

import tvmfuse._tvm  # noqa: F401  (installs the lazy stack)

ENTRIES = ["tvm.tirx.script.parser.entry", "tvm.script.parser.ir.entry", "tvm.relax.script.parser.entry"]


@pytest.mark.parametrize("name", ENTRIES)
def test_the_decorators_stack_is_the_real_one_read_lazily(name):
    import importlib

    lazy = importlib.import_module(name).inspect
    assert lazy is not inspect and lazy.stack is not inspect.stack and lazy.isfunction is inspect.isfunction

    def capture():
        got, want = lazy.stack(), inspect.stack()
        # the frames above this one wait where they were while it runs (as the decorator's caller waits while
        # TVM reads frames[2]): each read here, out of order, is what inspect.stack() built at once
        return got, want, [(got[i], want[i]) for i in reversed(range(1, len(want)))]

    got, want, read = capture()
    assert len(got) == len(want) and got[0].frame is want[0].frame and got[0].function == "capture"
    for g, w in read:
        assert g == w and g.frame is w.frame and g.positions == w.positions
        assert type(g) is inspect.FrameInfo
    assert [f.frame for f in got[1:]] == [f.frame for f in want[1:]] and got[-1] == want[-1]
    with pytest.raises(IndexError):
        got[len(want)]


def test_prim_funcs_in_a_module_class_and_closure_names_in_string_annotations_still_parse():
    from tvm.script import ir as I
    from tvm.script import tirx as T

    from tvmfuse._tvm import tvm

    n = 16   # named only in annotations (strings here): TVM finds it in this frame's locals through the stack

    @T.prim_func
    def scale(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32")):
        for i in range(n):
            b[i] = a[i] * T.float32(2)

    assert [int(d) for d in scale.params[0].shape] == [n]

    @I.ir_module
    class Module:   # its prim_func is left to the module's parser (TVM reads the class line two frames up)
        @T.prim_func
        def main(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32")):
            for i in range(8):
                b[i] = a[i] + T.float32(1)

    assert isinstance(Module, tvm.IRModule) and [g.name_hint for g in Module.get_global_vars()] == ["main"]
