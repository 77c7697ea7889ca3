"""MetaSchedule's evolutionary search, kept from measuring again what the database already holds for the kernel.

The search excludes only what it measured itself (its C++ state starts with an empty set of measured modules), so
the records measured before it, the default and the rule beside it, or a resumed run's whole history, come back as
its candidates. A warm-started model ranks the config it picked as the default first again: in replays of measured
conv spaces, the search's first trial repeated the default in most warm runs. Here each candidate whose template
config (or, for a kernel scheduled by primitives, whose scheduled module) the database already holds is answered
from its record, not measured, and the search goes on to the next.
"""
from __future__ import annotations

from tvmfuse._tvm import derived_object, ms, structural_hash, tvm
from tvmfuse.tune.features import config_name

# rounds of candidates that were all measured before, after which the search counts as exhausted
_ROUNDS = 8
# candidates the wrapped search may be told of beyond the trials: the ones answered from the database
_ANSWERED = 4096


def _key(mod):
    """What makes two scheduled modules the same kernel: the template config chosen, or the module itself."""
    func = mod["main"]
    found = config_name(func)
    return ("config", *found) if found is not None else ("module", structural_hash(func))


@derived_object
class FreshSearch(ms.search_strategy.PySearchStrategy):
    """``inner`` (a MetaSchedule search strategy) whose candidates already in the database are not measured."""

    def __init__(self, inner):
        self.inner = inner
        self.known: dict = {}   # key -> run seconds of a measured schedule
        self.mod = None
        self.left = 0   # trials the run has left

    def _initialize_with_tune_context(self, context) -> None:
        self.mod = context.mod
        self.inner._initialize_with_tune_context(context)

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        # (the wrapped search counts the answered candidates as trials: its budget has room for them, and this
        # one stops at the real budget)
        self.inner.pre_tuning(max_trials + _ANSWERED, num_trials_per_iter, design_spaces, database, cost_model)
        self.left, self.known = int(max_trials), {}
        if database is None or self.mod is None:
            return
        for record in database.get_top_k(database.commit_workload(self.mod), 1 << 20):
            sch = tvm.s_tir.Schedule(self.mod)
            try:
                record.trace.apply_to_schedule(sch, remove_postproc=False)   # as the candidates: post-processed
            except Exception:  # noqa: BLE001 - a trace of an older template: nothing to match
                continue
            self.known.setdefault(_key(sch.mod), [float(s) for s in record.run_secs])

    def post_tuning(self) -> None:
        self.inner.post_tuning()

    def generate_measure_candidates(self):
        for _ in range(_ROUNDS):
            if self.left <= 0:
                return None
            candidates = self.inner.generate_measure_candidates()
            if candidates is None:
                return None
            fresh, old, answers, batch = [], [], [], set()
            for c in candidates:
                key = _key(c.sch.mod)
                if key in self.known:
                    old.append(c)
                    answers.append(ms.runner.RunnerResult(self.known[key], None))
                elif key not in batch and len(fresh) < self.left:
                    batch.add(key)
                    fresh.append(c)
            if old:   # the wrapped search learns they are measured, and does not propose them again
                self.inner.notify_runner_results(old, answers)
            if fresh:
                return fresh
        return None

    def notify_runner_results(self, measure_candidates, results) -> None:
        self.inner.notify_runner_results(measure_candidates, results)
        self.left -= len(measure_candidates)
        for c, r in zip(measure_candidates, results):
            if r.error_msg is None and r.run_secs:
                self.known.setdefault(_key(c.sch.mod), [float(s) for s in r.run_secs])

    def clone(self):
        return FreshSearch(self.inner.clone())
