"""The registry of kernel templates: every name a space file or a template refers to resolves, each template says
why it does not take a kernel, and the defaults and expansion loop over it in order."""
from __future__ import annotations

import pytest

from tvmfuse.kernels import code_digest, expand, get, registry, sketch_template, untuned_kernel
from tvmfuse.target import resolve_target
from tvmfuse.tune.spaces import CLASSES, SPACES_DIR, load_space_file


def test_names_resolve():
    names = [t.name for t in registry()]
    assert len(names) == len(set(names))
    sketches = [t.sketch_name for t in registry() if t.sketch_name]
    assert len(sketches) == len(set(sketches))
    for t in registry():
        assert t.searched_in is None or sketch_template(t.searched_in) is not None, t
        assert all(get(u) for u in t.uses), t
        assert set(t.kernel_classes) <= set(CLASSES), t
        assert (t.config_field is None) == (t.candidates_key is None), t
    for path in SPACES_DIR.glob("*.yaml"):
        for space in load_space_file(path).classes.values():
            assert space.template == "stock" or sketch_template(space.template) is not None, (path, space)
    with pytest.raises(KeyError, match="no kernel template 'nope'"):
        get("nope")


def test_every_template_says_why_it_does_not_take_a_kernel_elsewhere():
    from tvmfuse._tvm import tvm
    from tvm import te

    a = te.placeholder((16, 16), name="a")
    func = te.create_prim_func([a, te.compute((16, 16), lambda i, j: a[i, j] + 1, name="c")])
    llvm, cuda = resolve_target("llvm"), resolve_target("cuda")
    for t in registry():
        other = cuda if "llvm" in t.targets else llvm   # a target kind the template does not write kernels for
        reason = t.fits(func, other.target)
        assert isinstance(reason, str) and reason, t
    found = untuned_kernel(func, llvm)   # a TargetInfo or a TVM target: on llvm the CPU default takes every kernel
    assert found is not None and found[0] == "cpu-default"
    mod = tvm.IRModule({"main": func})
    assert expand(mod).same_as(mod)   # nothing annotated: nothing swapped


def test_code_digests_are_stable_and_distinct():
    digests = {t.name: code_digest(t) for t in registry()}
    assert digests == {t.name: code_digest(t) for t in registry()}
    assert len(set(digests.values())) == len(digests)
    for t in registry():
        files = t.source_files()
        assert files and all(f.suffix == ".py" and f.is_file() for f in files), t
