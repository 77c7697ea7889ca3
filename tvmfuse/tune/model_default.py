"""The default a template kernel is measured at first: its hand rule, or where the database holds measurements of
the same template at other shapes (on this target and device), the config the run's cost model predicts best.

The hand rules were tuned on a few shapes of the H200; on shapes nobody tuned for, the tuner's best record was
most often that rule's config, because the search started from it and moved little. The run's XGBoost model,
warm-started from the database's records (:mod:`tvmfuse.tune.warm_start`), reads a config's knobs
(:mod:`tvmfuse.tune.features`), so it can rank every config of a new shape from what other shapes measured.
"""
from __future__ import annotations

import json

import numpy as np

from tvmfuse._tvm import ms, tvm
from tvmfuse.kernels import registry
from tvmfuse.kernels.mutator import config_decision
from tvmfuse.kernels.space import tune_context
from tvmfuse.tune.cost_model import fitted
from tvmfuse.tune.defaults import default_template_schedule
from tvmfuse.tune.features import config_name
from tvmfuse.tune.spaces import select_space

RULE = "rule"
SAME_AS_RULE = "= rule"   # the end of a model's source where it picked the rule's config


def template_records(database, candidates_key: str, exclude: int | None = None) -> int:
    """Valid records in ``database`` (its bound target and device) whose trace chose a config of the template
    annotating ``candidates_key``, on workloads other than ``exclude``."""
    n = 0
    for stats in database.list_workloads():
        if stats.workload_id == exclude:
            continue
        n += sum(candidates_key in json.dumps(r.trace) for r in database.records(stats.workload_id,
                                                                               include_failed=False))
    return n


def model_default(mod, target, *, cost_model, database, spaces=None) -> tuple[object, str]:
    """(schedule, source) of the kernel ``mod``'s default on ``target`` (a ``TargetInfo``): the hand rule's
    (:func:`~tvmfuse.tune.defaults.default_template_schedule`, source ``rule``), or, where that is a template config
    and ``database`` holds N records of the template at other workloads and ``cost_model`` has learned
    (:func:`~tvmfuse.tune.cost_model.fitted`), the template's config that ``cost_model`` scores best for ``mod``,
    source ``model (N records)`` (``model (N records) = rule`` where it is the rule's config: the tuner measures the
    rule beside any other pick, what an untuned build runs). The schedule is None where no template writes the
    kernel (dlight's rules)."""
    rule = default_template_schedule(mod, target.target, spaces)
    found = None if rule is None else config_name(rule.mod["main"])
    if found is None or not fitted(cost_model):
        return rule, RULE
    template = next(t for t in registry() if t.name == found[0])
    n = template_records(database, template.candidates_key, database.workload_id(mod))
    if n == 0:
        return rule, RULE
    choice = select_space(mod, target.target, spaces)
    ctx = tune_context(mod, target.target, choice.generator)
    sketch = next((s for s in ctx.generate_design_space()
                   if config_decision(s.trace, ((template.candidates_key, template.index_key),)) is not None), None)
    if sketch is None:
        return rule, RULE
    inst, names, _, _ = config_decision(sketch.trace, ((template.candidates_key, template.index_key),))
    values = [int(v) for v in inst.attrs[0]]
    args = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
    schedules = []
    for name_index in range(len(names)):
        sch = tvm.s_tir.Schedule(mod)
        sketch.trace.with_decision(inst, values.index(name_index), remove_postproc=True).apply_to_schedule(
            sch, remove_postproc=True)
        schedules.append(sch)
    scores = np.asarray(cost_model.predict(ctx, [ms.MeasureCandidate(s, args) for s in schedules]))
    best = schedules[int(np.argmax(scores))]
    if config_name(best.mod["main"]) == found:   # the model agrees with the rule: one schedule to measure
        return best, f"model ({n} records) {SAME_AS_RULE}"
    return best, f"model ({n} records)"
