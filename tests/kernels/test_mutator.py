"""The config-neighbour mutator (tvmfuse/kernels/mutator.py): on the wgmma and row-program spaces its proposals are
configs of the space one knob one step away from the trace's, and MetaSchedule's evolutionary search applies it
in a real tune_tasks run on llvm (a synthetic kernel whose sketch samples a config index the same way)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest

from tvmfuse._tvm import ms, tvm
from tvmfuse.bench.cases import CASES
from tvmfuse.frontend import import_model, load_model
from tvmfuse.kernels import get
from tvmfuse.kernels import mutator as M
from tvmfuse.kernels.space import tune_context
from tvmfuse.plan import partition
from tvmfuse.target import resolve_target
from tvmfuse.tune import extract_kernels
from tvmfuse.tune.builder import make_builder
from tvmfuse.tune.samples import local_runner
from tvmfuse.tune.spaces import classify, select_space, sketch_mutators


def _kernel(case, cls, **shape):
    cuda = resolve_target("cuda")
    path = Path(tempfile.mkdtemp()) / "m.onnx"
    onnx.save(CASES[case](**shape)[0], path)
    fused, _ = partition(import_model(load_model(path)), target=cuda)
    (k,) = [k for k in extract_kernels(fused, target=cuda) if classify(k.mod["main"]) == cls]
    return cuda, k


def _config_sketch(cuda, kernel):
    choice = select_space(kernel.mod, cuda.target)
    for sketch in tune_context(kernel.mod, cuda.target, choice.generator).generate_design_space():
        if M.config_decision(sketch.trace, M.template_keys()) is not None:
            return sketch
    raise AssertionError("no sketch samples a template config")


def test_neighbours_move_one_knob_to_the_next_value_on_its_line():
    names = ["t32 r1", "t32 r2", "t32 r8", "t64 r1", "t128 r1", "t128 r2", "t256 r1 m1"]
    assert [names[i] for i in M.neighbours(names, 0)] == ["t32 r2", "t64 r1"]
    # r4 is not a config: r2's next value up on its line is r8; t64 r2 is none either: t128 r2 is t32 r2's next
    assert [names[i] for i in M.neighbours(names, 1)] == ["t32 r1", "t32 r8", "t128 r2"]
    # a flag knob (m1) is a knob too: t256 r1 m1 differs from t128 r1 in two, so it has no neighbour
    assert M.neighbours(names, 6) == []
    assert M.neighbours(["only"], 0) == []


def _is_neighbour(names, a, b) -> bool:
    va, vb = M.knob_vector(names[a]), M.knob_vector(names[b])
    keys = set(va) | set(vb)
    diff = [k for k in keys if va.get(k, 0) != vb.get(k, 0)]
    if len(diff) != 1:
        return False
    (k,) = diff
    lo, hi = sorted((va.get(k, 0), vb.get(k, 0)))
    others = {q: va.get(q, 0) for q in keys if q != k}
    between = [n for n in names if lo < M.knob_vector(n).get(k, 0) < hi
               and all(M.knob_vector(n).get(q, 0) == v for q, v in others.items())]
    return not between


@pytest.mark.parametrize("case,cls,shape", [("gemm_bias_relu", "gemm", dict(M=256, K=512, N=512)),
                                            ("softmax", "row_reduction", dict(M=64, N=2048))])
def test_proposals_on_the_wgmma_and_rows_spaces_are_neighbours_in_the_space(case, cls, shape):
    cuda, kernel = _kernel(case, cls, **shape)
    sketch = _config_sketch(cuda, kernel)
    inst, names, index, key = M.config_decision(sketch.trace, M.template_keys())
    assert key == (get("wgmma") if cls == "gemm" else get("rows")).candidates_key
    assert len(names) > 4
    mut = M.ConfigNeighbour(seed=1)
    seen = set()
    for start in (0, len(names) // 2, len(names) - 1):
        trace = sketch.trace.with_decision(inst, start, remove_postproc=True)
        for _ in range(12):
            new = mut.apply(trace)
            assert new is not None
            _, new_names, proposed, _ = M.config_decision(new, M.template_keys())
            assert new_names == names and 0 <= proposed < len(names)
            assert _is_neighbour(names, start, proposed), (names[start], names[proposed])
            seen.add((start, proposed))
            sch = tvm.s_tir.Schedule(kernel.mod)   # the proposal replays: a point of the space
            new.apply_to_schedule(sch, remove_postproc=True)
    assert len({p for _, p in seen}) >= 4   # it proposes several neighbours, not one


def test_the_mutator_joins_the_sketches_that_sample_configs_only():
    rows_sketch = sketch_mutators(get("row_reduction"), "cuda")
    assert [float(p) for m, p in rows_sketch.items() if type(m).__name__ == "ConfigNeighbour"] == [M.PROBABILITY]
    assert sum(float(p) for p in rows_sketch.values()) == pytest.approx(1.0)
    assert sketch_mutators(get("pointwise"), "cuda") == "cuda"   # its knobs are no config index


# -- a real tune_tasks on llvm: a kernel whose sketch samples a config index as the templates do -----------------
_CAND, _INDEX = "test.candidates", "test.config"
_NAMES = [f"t{t} u{u}" for t in (4, 8, 16, 32, 64, 128) for u in (1, 2, 4, 8)]


def _add_module():
    from tvm.script import ir as I
    from tvm.script import tirx as T

    @I.ir_module
    class Add:
        @T.prim_func(s_tir=True)
        def main(a: T.Buffer((256, 256), "float32"), b: T.Buffer((256, 256), "float32")):
            T.func_attr({"global_symbol": "main", "tirx.noalias": True})
            for i, j in T.grid(256, 256):
                with T.sblock("b"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    b[vi, vj] = a[vi, vj] + T.float32(1)

    return Add


def _sketch(sch):
    root = sch.get_sblock("root")
    index = sch.sample_categorical(candidates=list(range(len(_NAMES))), probs=[1.0 / len(_NAMES)] * len(_NAMES))
    sch.annotate(root, _CAND, ";".join(_NAMES))
    sch.annotate(root, _INDEX, index)


@pytest.mark.slow   # ~40 s: builds and runs 8 candidates
def test_an_llvm_tune_tasks_run_applies_the_mutator(tmp_path):
    M.APPLIED.clear()
    target = tvm.target.Target({"kind": "llvm", "num-cores": 1})
    gen = ms.space_generator.ScheduleFn(_sketch, sch_rules=[], postprocs=[],
                                        mutator_probs=M.mutator_probs("llvm", keys=((_CAND, _INDEX),)))
    ctx = ms.TuneContext(mod=_add_module(), target=target, space_generator=gen,
                         search_strategy=ms.search_strategy.EvolutionarySearch(population_size=16,
                                                                               init_min_unmeasured=4),
                         task_name="add", rand_state=1)
    database = ms.database.MemoryDatabase()
    ms.tune_tasks(tasks=[ctx], task_weights=[1.0], work_dir=str(tmp_path), max_trials_global=8,
                  max_trials_per_task=8, num_trials_per_iter=4,
                  builder=make_builder(workers=1, timeout_s=60), runner=local_runner(30),
                  database=database, cost_model=ms.cost_model.RandomModel(),
                  task_scheduler="round-robin")
    assert M.APPLIED.get(_CAND, 0) > 0
    records = database.get_all_tuning_records()
    assert len(records) >= 4 and all(np.isfinite(float(r.run_secs[0])) for r in records)
