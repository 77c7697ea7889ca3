"""The tuning loop: split a trial budget over kernels, resume from the database, report progress.

MetaSchedule tunes one kernel at a time here (``ms.tune_tasks`` with a single task), which lets tvmfuse
decide where the budget goes, skip kernels whose budget the database shows spent, and report progress
per kernel; within a kernel MetaSchedule's evolutionary search and XGBoost cost model do the search.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Protocol

from tvmfuse._gpu_rules import default_schedule
from tvmfuse._tvm import derived_object, ensure_tensor_intrinsics, ms
from tvmfuse.tune.cost_model import COST_MODELS, XGB_WARMUP_SAMPLES, learning_callbacks, make_cost_model  # noqa: F401
from tvmfuse.target import TargetInfo, device_figures
from tvmfuse import nvcc_cache
from tvmfuse.tune.builder import close_builder, make_builder
from tvmfuse.tune.model_default import SAME_AS_RULE
from tvmfuse.tune.retime import retime_result
from tvmfuse.tune.samples import KeptSamplesRunner, check_cpu_trial_mode, cpu_trials, local_runner
from tvmfuse.tune.search import FreshSearch
from tvmfuse.tune.tasks import Kernel

log = logging.getLogger("tvmfuse.tune")
_MS_LOGGER = "tvm.s_tir.meta_schedule"
_FAILED_SECS = 1e9


@dataclass(frozen=True)
class TuneConfig:
    """How much to tune and how.

    Attributes
    ----------
    trials : new trials this run may spend, over all kernels
    trials_per_kernel : a kernel's budget; a kernel whose database records reach it is not tuned again
    trials_per_round : candidates measured per search round
    population : evolutionary-search population (smaller is faster per round on 2 cores)
    retune : spend the budget again even where the database shows it spent
    time_budget_s : wall seconds for the whole run; when set, tuning goes breadth first: every kernel,
        heaviest first (FLOPs x calls), gets ``first_pass_trials`` of its trials, then the heaviest get the
        rest of theirs. A kernel not started when the time is up keeps its default schedule
        (``skipped-time``); a pass already started on a kernel finishes.
    first_pass_trials : trials each kernel gets in the first pass of a time-bounded run
    """

    trials: int = 64
    trials_per_kernel: int = 16
    trials_per_round: int = 8
    population: int = 64
    seed: int | None = 0
    retune: bool = False
    builder_timeout_s: float = 60.0
    runner_timeout_s: float = 30.0
    max_workers: int | None = None
    log_dir: Path | None = None
    spaces_dir: Path | None = None  # search_spaces/ override (the YAML files)
    cost_model: str = "xgb"  # xgb | random: one model per run, shared by every kernel (see make_cost_model)
    baseline: bool = True  # measure the default schedule first and keep it as a record (see _measure_baseline)
    check: bool = True  # run each tuned kernel's best schedule against its reference (see check_best)
    # on a CPU, time the whole model's tuned build against its untuned one after tuning; compile ships the faster
    # (tvmfuse.compile.model_check)
    end_to_end_check: bool = True
    retime_finalists: int | None = None  # fastest schedules timed again side by side (tune.retime; None: by target)
    cpu_trials: str = "auto"  # cold | warm | auto: CPU trials with the weights flushed or not (tune.samples.cpu_trials)
    nvcc_cache: str | None = None  # the CUDA compile cache's folder ("off": none; None: tvmfuse.nvcc_cache.default_dir)
    # evolutionary (MetaSchedule's, the cost model and mutators steering it) | random (random points of the space,
    # MetaSchedule's ReplayTrace: the baseline benchmarks/bench_convergence.py compares the search with)
    strategy: str = "evolutionary"
    time_budget_s: float | None = None
    first_pass_trials: int = 2
    # measure on RPC servers (tvmfuse.rpc.RPCOptions) instead of this machine; tvmfuse.api.tune makes the runner
    rpc: object = None

    def __post_init__(self):
        check_cpu_trial_mode(self.cpu_trials)   # exit 2 before anything runs


@dataclass
class KernelResult:
    name: str
    workload_hash: int
    weight: int
    trials_before: int
    trials_run: int = 0
    best_before_s: float | None = None
    best_s: float | None = None
    # tuned | resumed | exhausted | skipped-spent | skipped-budget | skipped-time | interrupted | skipped-interrupt |
    # failed | lost (every measurement lost with its RPC server)
    status: str = "pending"
    message: str = ""
    space: dict | None = None  # kernel class, space source, space version, fallback notes
    curve: list = field(default_factory=list)  # [trials, best seconds] after each measured batch
    baseline_s: float | None = None  # the default schedule (dlight / plain lowering), measured the same way
    check: dict | None = None  # the best schedule against the reference: rel_error, unwritten, ok, rejected
    lost: int = 0  # trials lost with their RPC server (not in trials_run: nothing was measured)
    servers: dict | None = None  # RPC server -> trials it measured for this kernel (remote runs only)
    default: str | None = None  # whose default was measured first: rule | model (N records) | stock
    retimed: dict | None = None  # the finalists timed again side by side (tvmfuse.tune.retime.retime_finalists)

    def to_json(self) -> dict:
        return {
            "name": self.name, "workload_hash": f"{self.workload_hash:016x}", "weight": self.weight,
            "trials_before": self.trials_before, "trials_run": self.trials_run,
            "best_before_ms": None if self.best_before_s is None else self.best_before_s * 1e3,
            "best_ms": None if self.best_s is None else self.best_s * 1e3,
            "status": self.status, "message": self.message, "space": self.space,
            "curve": [[n, None if b is None else b * 1e3] for n, b in self.curve],
            "baseline_ms": None if self.baseline_s is None else self.baseline_s * 1e3,
            "check": self.check, "lost_trials": self.lost, "servers": self.servers, "default": self.default,
            "retimed": self.retimed,
            "speedup_vs_default": (self.baseline_s / self.best_s if self.baseline_s and self.best_s else None),
        }


class TuneProgress(Protocol):
    """What a tuning run reports as it goes. ``budgets`` are the trials of the search each kernel may spend this
    run (their sum never exceeds ``TuneConfig.trials``); ``trials_done`` counts a kernel's searched trials so far.
    A kernel tuned for the first time also has its default schedule measured first: not a trial of the search,
    it is reported apart, through ``on_default`` where the progress object has that method (it is optional:
    progress objects written before it existed still work)."""

    def on_start(self, kernels: list[Kernel], budgets: list[int]) -> None: ...
    def on_batch(self, index: int, trials_done: int, best_s: float | None) -> None: ...
    def on_kernel_done(self, index: int, result: KernelResult) -> None: ...
    # optional: def on_default(self, index: int, default_s: float | None) -> None  (None: it did not build or run)
    # optional, remote runs: def on_remote(self, index: int, servers: dict[str, int], lost: list[tuple[str, str]])
    #   after each batch: the trials each server measured for the kernel so far, and the trials of this batch
    #   lost with their server, as (server, reason)
    # optional: def on_end_to_end(self) -> None  the whole model's tuned and untuned builds are timed next


def _report(progress, hook: str, *args) -> None:
    """Call ``progress.<hook>(*args)`` when the progress object has that optional hook."""
    fn = getattr(progress, hook, None) if progress is not None else None
    if fn is not None:
        fn(*args)


@dataclass
class _BatchState:
    index: int
    trials: int = 0
    best: float | None = None
    progress: TuneProgress | None = None
    history: list = field(default_factory=list)
    extra: int = 0  # records committed outside the search (the default schedule's)
    database: object = None  # where failed trials' messages go (with mod)
    mod: object = None
    choice: object = None  # the kernel's search space, chosen when its tuning starts
    default_error: str = ""  # why the default schedule did not build or run ("" when it did)
    stop: object = None  # a callable, true once the run is asked to stop (the CLI's Ctrl-C)
    pass_end: int = 0  # ``trials`` when this pass's budget is spent
    cut: bool = False  # the stop request ended this kernel's search before its budget
    cost_model: object = None  # the run's cost model, shared by every kernel
    ledger: object = None  # remote runs: tvmfuse.rpc.runner.Ledger, which server measured each trial
    lost: int = 0  # trials lost with their RPC server: counted in ``trials`` (the search spent them), never stored
    default_lost: int = 0  # 1 when the default schedule's measurement was lost with its server
    servers: dict = field(default_factory=dict)  # RPC server -> trials it measured for this kernel
    default_source: str | None = None  # the default measured first: rule | model (N records) | stock


@derived_object
class _ProgressCallback(ms.measure_callback.PyMeasureCallback):
    """Reports each measured batch: trials done and best latency so far."""

    def __init__(self, state: _BatchState):
        self.state = state

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        from tvmfuse.rpc.runner import is_lost

        st = self.state
        lost = []
        for built, res in zip(builder_results, runner_results):
            st.trials += 1
            secs = [float(s) for s in (res.run_secs or [])]
            where = st.ledger.server_of(built.artifact_path) if st.ledger is not None and built.artifact_path else None
            if is_lost(res):  # its server died or stopped answering: no verdict on the kernel, nothing stored
                st.lost += 1
                lost.append((where or "no server", _lost_reason(res.error_msg)))
            elif res.error_msg is None and secs and max(secs) < _FAILED_SECS:
                mean = sum(secs) / len(secs)
                st.best = mean if st.best is None else min(st.best, mean)
            elif st.database is not None:
                kind, msg = ("build", built.error_msg) if built.error_msg else ("run", res.error_msg or "no time")
                st.database.record_error(st.mod, kind, msg)
            if where is not None and not is_lost(res):
                st.servers[where] = st.servers.get(where, 0) + 1
            st.history.append((st.trials, st.best))
        if st.ledger is not None:
            _report(st.progress, "on_remote", st.index, dict(st.servers), lost)
        if st.progress is not None:
            st.progress.on_batch(st.index, st.trials, st.best)
        # Asked to stop: end the search here (this batch is committed: the database's callback ran first); only while
        # the pass has budget left (after its last batch the scheduler terminates the task itself, and never twice)
        if st.stop is not None and not st.cut and st.trials < st.pass_end and st.stop():
            task_scheduler.terminate_task(task_id)
            st.cut = True


def _lost_reason(error_msg) -> str:
    """The reason of a lost trial's message (``tvmfuse-rpc-lost: HOST:PORT: reason``), its server left out."""
    from tvmfuse.rpc.runner import LOST_PREFIX
    rest = str(error_msg or "")[len(LOST_PREFIX):].strip()
    return rest.split(": ", 1)[1] if ": " in rest else rest


def allocate_budget(kernels: list[Kernel], spent: list[int], config: TuneConfig) -> list[int]:
    """Trials per kernel for this run.

    Every kernel first gets an equal share of ``trials`` (capped by what its ``trials_per_kernel``
    budget has left), so none keeps a naive schedule; what is left over goes to the heaviest kernels
    (FLOPs x calls) first.
    """
    room = [max(0, config.trials_per_kernel - (0 if config.retune else s)) for s in spent]
    budgets = [0] * len(kernels)
    left = max(0, config.trials)
    want = [i for i, r in enumerate(room) if r > 0]
    if not want:
        return budgets
    share = max(1, left // len(want))
    for i in want:
        budgets[i] = min(room[i], share, left)
        left -= budgets[i]
    order = sorted(want, key=lambda i: -(kernels[i].flops * max(1, kernels[i].weight)))
    for i in order:
        extra = min(room[i] - budgets[i], left)
        budgets[i] += extra
        left -= extra
    return budgets


def _quiet_ms_console() -> None:
    # MetaSchedule's console handler prints on stdout at its global logger's level; keep stdout for --json.
    logging.getLogger(_MS_LOGGER).setLevel(logging.CRITICAL)


def tune_kernels(kernels: list[Kernel], *, target: TargetInfo, database, config: TuneConfig,
                 progress: TuneProgress | None = None, model: str | None = None,
                 stop: Callable[[], bool] | None = None, cost_model=None, runner=None,
                 ledger=None, builder=None) -> list[KernelResult]:
    """Tune ``kernels`` into ``database`` (a tvmfuse database bound to ``target``).

    ``runner``: the MetaSchedule runner that measures the candidates (default: a local runner on this machine);
    ``ledger``: with a remote runner (``tvmfuse.rpc.runner.make_runner``), where each trial ran. Trials the remote
    runner reports lost with their server are neither stored nor counted as failures (``KernelResult.lost``);
    once the ledger says no server is left, the run stops as after Ctrl-C (the kernel being tuned
    ``interrupted``, the rest ``skipped-interrupt``).

    ``builder``: the candidates' MetaSchedule builder (default: :func:`make_builder`'s), closed at the end.
    ``cost_model``: a MetaSchedule cost model to share (default: :func:`make_cost_model` of ``config.cost_model``,
    made before anything is tuned, so a model that cannot load stops the run at once).

    ``stop``: polled after each measured batch and before each kernel; once it returns True the kernel being
    tuned ends its search after the batch in flight (``interrupted``, its records kept, not checked), and the
    kernels not started are ``skipped-interrupt``. A later run resumes both from the database.

    Returns one :class:`KernelResult` per kernel, in the order given.
    """
    from tvmfuse.tune.spaces import load_spaces

    cost_model = cost_model if cost_model is not None else make_cost_model(config.cost_model)
    ensure_tensor_intrinsics(target.kind)
    spaces = load_spaces(target.kind, config.spaces_dir)
    if getattr(database, "space_version", "unset") is None:
        database.space_version = spaces.version  # stamped on every record this run commits
    for k in kernels:
        database.set_task_name(k.mod, k.name, model=model)
    spent = [database.trials_spent(k.mod) for k in kernels]
    budgets = allocate_budget(kernels, spent, config)
    results = [KernelResult(name=k.name, workload_hash=k.workload_hash, weight=k.weight, trials_before=s,
                            best_before_s=database.best_run_secs(k.mod) if s else None)
               for k, s in zip(kernels, spent)]
    if progress is not None:  # searched trials only: the default schedules measured first are reported apart
        progress.on_start(kernels, list(budgets))
    workers = config.max_workers or max(1, min(4, _cores(target)))
    if config.rpc is not None and config.max_workers is None:
        # candidates are built here for every server at once: more builders, up to this machine's cores
        workers = max(workers, min(_cores(target), int(getattr(config.rpc, "workers", None) or 1)))
    nvcc_cache.install(config.nvcc_cache)   # here and in the workers below: each compiles CUDA through it
    # a CUDA candidate measured here is compiled in the parallel build workers, the runner's load then a cache hit
    if builder is None:
        builder = make_builder(workers=workers, timeout_s=max(config.builder_timeout_s, spaces.builder_timeout_s),
                               precompile=target.is_gpu and runner is None and config.rpc is None)
    runner = runner if runner is not None else local_runner(
        config.runner_timeout_s, gpu=target.is_gpu,
        cold=target.is_gpu or cpu_trials(kernels, config.cpu_trials)[0] == "cold")
    runner = KeptSamplesRunner(runner)   # a record keeps the samples no other process stretched
    if ledger is not None:  # no server left under the key: stop as after Ctrl-C (a later run resumes)
        user_stop = stop
        stop = lambda: bool(ledger.gone) or bool(user_stop is not None and user_stop())  # noqa: E731
    # MetaSchedule's per-task logs: kept under config.log_dir when given, else in a temporary folder removed at the end
    log_root = Path(config.log_dir) if config.log_dir else Path(tempfile.mkdtemp(prefix="tvmfuse-tune-"))
    try:
        return _tune_all(kernels, budgets, spent, results, target=target, database=database, config=config,
                         spaces=spaces, builder=builder, runner=runner, log_root=log_root, progress=progress,
                         stop=stop, cost_model=cost_model, ledger=ledger)
    finally:
        close_builder(builder)
        if not config.log_dir:
            shutil.rmtree(log_root, ignore_errors=True)


def _tune_all(kernels, budgets, spent, results, *, target, database, config, spaces, builder, runner, log_root,
              cost_model,
              progress, stop=None, ledger=None) -> list[KernelResult]:
    order = list(range(len(kernels)))
    passes = [budgets]
    deadline = None
    if config.time_budget_s is not None:
        deadline = time.monotonic() + config.time_budget_s
        # kernels without a record first, then the heaviest: a resumed run that re-tuned the tuned ones first left
        # the same 11 of ResNet-50's 28 kernels untuned run after run (H200)
        order.sort(key=lambda i: (spent[i] > 0, -(kernels[i].flops * max(1, kernels[i].weight))))
        # breadth first: under a time bound every kernel gets a few trials before the heaviest get the rest
        # (ResNet-50 on the H200: heaviest-first to the end left 12 of 28 kernels on dlight)
        first = [min(b, max(1, config.first_pass_trials)) for b in budgets]
        passes = [first, [b - f for b, f in zip(budgets, first)]]
    states = [_BatchState(index=i, progress=progress, database=database, mod=k.mod, stop=stop, cost_model=cost_model,
                          ledger=ledger)
              for i, k in enumerate(kernels)]
    finished: set[int] = set()
    stopped = stop or (lambda: False)

    def finish(i: int) -> None:
        _finish_kernel(kernels[i], results[i], states[i], target=target, database=database, config=config,
                       spent=spent[i], progress=progress, builder=builder, runner=runner)
        finished.add(i)

    def finish_interrupted(i: int) -> None:
        # its records stay; the check waits for the run that spends the rest of its budget, so that stopping
        # takes no longer than the trials in flight
        st, result = states[i], results[i]
        _finish_kernel(kernels[i], result, st, target=target, database=database, config=replace(config, check=False),
                       spent=spent[i], progress=None)
        if result.status not in ("failed", "lost"):
            result.status = "interrupted"
            result.message = (f"interrupted after {st.trials} of its {budgets[i]} trials this run; the next "
                              "`tune` continues it")
        finished.add(i)
        if progress is not None:
            progress.on_kernel_done(i, result)

    for n, budget_of in enumerate(passes):
        for i in order:
            if i in finished:
                continue
            result, budget = results[i], budget_of[i]
            more_later = any(p[i] for p in passes[n + 1:])
            if budget > 0 and stopped():
                if states[i].choice is not None:  # started in an earlier pass
                    finish_interrupted(i)
                    continue
                result.status, result.best_s = "skipped-interrupt", result.best_before_s
                result.message = ("no RPC server was left before this kernel; the next `tune` tunes it"
                                  if ledger is not None and ledger.gone else
                                  "tuning was interrupted before this kernel; the next `tune` tunes it")
            elif budget > 0 and deadline is not None and time.monotonic() >= deadline:
                if states[i].choice is not None:  # started in an earlier pass
                    finish(i)
                    continue
                result.status, result.best_s = "skipped-time", result.best_before_s
                result.message = f"the time budget ({config.time_budget_s:g} s) ran out before this kernel"
            elif budget > 0:
                states[i].pass_end = states[i].trials + budget
                _run_kernel(kernels[i], budget, result, states[i], target=target, database=database, config=config,
                            spaces=spaces, builder=builder, runner=runner, spent=spent[i],
                            work_dir=log_root / f"{i:03d}_{kernels[i].name[:60]}")
                if states[i].cut and result.status not in ("failed", "lost"):
                    finish_interrupted(i)
                elif result.status == "failed" or not more_later:
                    finish(i)
                continue
            elif more_later:
                continue
            else:
                result.status = ("skipped-spent" if spent[i] >= config.trials_per_kernel and not config.retune
                                 else "skipped-budget")
                result.best_s = result.best_before_s
            finished.add(i)
            if progress is not None:
                progress.on_kernel_done(i, result)
    return results


def _run_kernel(kernel, budget, result, state, *, target, database, config, spaces, builder, runner, spent,
                work_dir) -> None:
    """One pass of tuning on one kernel: its space (chosen once), the default schedule's measurement (the
    first time), then ``budget`` trials of search."""
    try:
        if state.choice is None:
            from tvmfuse.tune.spaces import select_space

            state.choice = select_space(kernel.mod, target.target, spaces)
            result.space = state.choice.to_json()
            if config.baseline and spent == 0:
                state.extra, result.baseline_s, state.default_error = _measure_baseline(
                    kernel, target=target, database=database, builder=builder, runner=runner, state=state)
                result.default = state.default_source
                if result.default.startswith("model") and not result.default.endswith(SAME_AS_RULE):   # the rule too
                    n, result.baseline_s, state.default_error = _measure_baseline(
                        kernel, target=target, database=database, builder=builder, runner=runner, rule=True)
                    state.extra, result.default = state.extra + n, result.default + " + rule"
                _report(state.progress, "on_default", state.index, result.baseline_s)
        _tune_one(kernel, budget, target=target, database=database, config=config, builder=builder,
                  runner=runner, work_dir=work_dir, state=state, space=state.choice.generator)
    except Exception as err:  # noqa: BLE001 - one kernel's failure must not lose the others' records
        # an exception is a failure, never "exhausted": the one seen here that looked like an exhausted space
        # was MetaSchedule's logger setup crashing (fixed in tvmfuse._tvm), and relabelling hid it
        message = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
        result.status, result.message = "failed", message
        log.warning("tuning %s failed: %s", kernel.name, message, exc_info=log.isEnabledFor(logging.DEBUG))


def _finish_kernel(kernel, result, state, *, target, database, config, spent, progress, builder=None,
                   runner=None) -> None:
    """Status, curve, finalists timed again, check and best time of a kernel whose tuning is over."""
    measured = state.trials - state.lost  # trials lost with their RPC server measured nothing
    result.trials_run = measured + state.extra
    result.lost = state.lost + state.default_lost
    if state.ledger is not None:
        result.servers = dict(state.servers)
    if result.status != "failed" and result.lost and measured == 0 and state.extra == 0:
        # every trial went down with its server: nothing is known of the kernel, and nothing was stored, so the
        # next run tunes it afresh
        result.status = "lost"
        result.message = (f"all {result.lost} of its measurements were lost with their RPC server; the next "
                          "`tune` measures it again")
        result.best_s = database.best_run_secs(kernel.mod)
        result.curve = list(state.history)
        if progress is not None:
            progress.on_kernel_done(state.index, result)
        return
    if result.status != "failed":
        if measured == 0 and spent:
            result.status = "exhausted"  # the design space had no unmeasured candidate left
        elif measured == 0 and state.extra:
            # the default schedule was measured and stored, so a build runs it; the search added nothing. Not a
            # failure (BERT fp32's GEMM + GELU on the H200 ended here and ran correctly on its default)
            result.status = "exhausted"
            result.message = ("the search yielded no candidate to measure; the default schedule, measured, is "
                              "what runs")
        elif measured == 0:
            # e.g. the tensor-core space on a shape where every sampled candidate fails verification
            result.status = "failed"
            result.message = "the search space yielded no valid candidate to measure"
        else:
            result.status = "resumed" if spent else "tuned"
    result.curve = list(state.history)
    if measured > 0:
        retime_result(result, kernel, target=target, database=database, config=config, builder=builder,
                      runner=runner, spent=spent)
    if config.check and measured + state.extra > 0:
        try:
            result.check = check_best(kernel, target=target, database=database)
        except Exception as err:  # noqa: BLE001 - a check that cannot run is reported, not fatal
            result.check = {"ok": None, "note": f"check did not run: {str(err).strip().splitlines()[-1][:200]}"}
    result.best_s = database.best_run_secs(kernel.mod)
    if result.status != "failed" and result.best_s is None and measured + state.extra > 0:
        # every candidate failed, the default schedule included: a build of this kernel would not run
        result.status = "failed"
        result.message = "no schedule of it ran" + (f" (the default schedule {state.default_error})"
                                                    if state.default_error else "")
    elif state.default_error and result.status != "failed":
        result.message = f"the default schedule {state.default_error}; a searched schedule ran"
    if progress is not None:
        progress.on_kernel_done(state.index, result)


def _cores(target: TargetInfo) -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_best(kernel: Kernel, *, target: TargetInfo, database, attempts: int = 4, seed: int = 0) -> dict:
    """Run the kernel's best record against its reference schedule on random inputs, outputs poisoned (NaN).

    A best record that computes wrong results (or leaves outputs unwritten) is rejected in the database and
    the next best is checked, up to ``attempts`` times: a build never applies a schedule that failed.
    Returns the check of the record that stays best, with ``rejected`` (how many were rejected).
    """
    from tvmfuse.tune.check import build_references, check_kernel

    rejected = 0
    wid = database.workload_id(kernel.mod)
    refs = None  # built once, on the first record there is to check
    for _ in range(attempts):
        best = database.best_record(wid) if wid is not None else None
        if best is None:
            return {"ok": None, "rejected": rejected, "note": "no valid record"}
        if refs is None:
            refs = build_references(kernel.mod, target)
        result = check_kernel(kernel.mod, database.schedule_of(best, kernel.mod), target, name=kernel.name,
                              seed=seed, refs=refs).to_json()
        if result["ok"]:
            return {**result, "rejected": rejected}
        log.warning("%s: the best schedule computes wrong results (relative error %.3g, %d unwritten); rejected",
                    kernel.name, result["rel_error"], result["unwritten"])
        database.reject_record(best.id)
        rejected += 1
    return {**result, "ok": False, "rejected": rejected, "note": f"{rejected} best records rejected; stopped"}


def _measure_baseline(kernel: Kernel, *, target: TargetInfo, database, builder, runner,
                      state: _BatchState | None = None, rule: bool = False) -> tuple[int, float | None, str]:
    """Measure the schedule an untuned build would give ``kernel`` and commit it as a record.

    With it in the database the best record, which is what a build applies, is never slower than the
    default: a search space that loses to dlight on some kernel (the tensor-core template on an NCHW conv,
    whose im2col reads are gathers) costs nothing. Its trace also seeds the evolutionary search.
    Returns (records committed: 0 or 1, mean seconds or None when it did not build or run, why it did not).
    A measurement lost with its RPC server commits nothing and is no failure (the next run measures it).
    ``rule``: the template's hand rule (what an untuned build runs), never the cost model's pick.
    """
    from tvmfuse.rpc.runner import is_lost
    from tvmfuse.tune.model_default import model_default

    # a template's default (flash, wgmma, ...): the config the run's model ranks first where it learnt the template
    sch, source = model_default(kernel.mod, target, cost_model=None if rule else getattr(state, "cost_model", None),
                                database=database)
    if sch is None:
        sch, source = default_schedule(kernel.mod, target.target, is_gpu=target.is_gpu,
                                       sm_count=device_figures(target).sm_count), "stock"
    if state is not None:
        state.default_source = source
    if sch is None:
        return 0, None, ""
    args = ms.arg_info.ArgInfo.from_entry_func(sch.mod, True)   # a packed weight as the built kernel takes it
    (built,) = builder.build([ms.builder.BuilderInput(sch.mod, target.target)])
    if built.error_msg is not None:
        log.warning("%s: the default schedule did not build: %s", kernel.name, built.error_msg.strip()[-200:])
        database.record_error(kernel.mod, "build", built.error_msg)
        return 0, None, "did not build: " + built.error_msg.strip().splitlines()[-1][:200]
    (future,) = runner.run([ms.runner.RunnerInput(built.artifact_path, "cuda" if target.is_gpu else "cpu", args)])
    measured = future.result()
    if is_lost(measured):
        if state is not None:
            state.default_lost = 1
            where = state.ledger.server_of(built.artifact_path) if state.ledger is not None else None
            _report(state.progress, "on_remote", state.index, dict(state.servers),
                    [(where or "no server", _lost_reason(measured.error_msg))])
        # the progress (on_remote) and the report say so; a log line would say it twice
        log.info("%s: the default schedule's measurement was lost: %s", kernel.name, _lost_reason(measured.error_msg))
        return 0, None, ""
    if state is not None and state.ledger is not None:
        where = state.ledger.server_of(built.artifact_path)
        if where is not None:
            state.servers[where] = state.servers.get(where, 0) + 1
    failed = measured.error_msg is not None or not measured.run_secs
    why = ""
    if failed:
        why = "did not run: " + (measured.error_msg or "no time").strip().splitlines()[-1][:200]
        log.warning("%s: the default schedule %s", kernel.name, why)
        database.record_error(kernel.mod, "run", measured.error_msg or "no time")
    secs = [_FAILED_SECS * 10] if failed else [float(x) for x in measured.run_secs]
    workload = database.ms_database.commit_workload(kernel.mod)
    database.ms_database.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, secs, target.target, args))
    return 1, None if failed else sum(secs) / len(secs), why


def _tune_one(kernel: Kernel, budget: int, *, target: TargetInfo, database, config: TuneConfig,
              builder, runner, work_dir: Path, state: _BatchState, space="post-order-apply") -> None:
    work_dir.mkdir(parents=True, exist_ok=True)
    per_round = max(1, min(config.trials_per_round, budget))
    # A kernel with a few trials left gains nothing from a large population, and on 2 cores sampling and
    # evolving it dominates the time per kernel: scale it with the budget.
    population = max(16, min(config.population, 8 * budget))
    strategy = FreshSearch(ms.search_strategy.EvolutionarySearch(
        population_size=population, init_min_unmeasured=min(50, population),
    )) if config.strategy != "random" else ms.search_strategy.ReplayTrace()
    _quiet_ms_console()
    ctxs, _ = ms.relax_integration.extracted_tasks_to_tune_contexts(
        [kernel.extracted], str(work_dir), space=space, strategy=strategy, seed=config.seed,
    )
    if state.ledger is not None:  # a remote runner: trials lost with their server are not stored
        from tvmfuse.rpc.runner import measure_callbacks

        defaults = measure_callbacks()
    else:
        defaults = list(ms.measure_callback.MeasureCallback.create("default"))
    callbacks = learning_callbacks(defaults, state.cost_model) + [_ProgressCallback(state)]
    try:
        ms.tune_tasks(
            tasks=ctxs, task_weights=[float(kernel.weight)], work_dir=str(work_dir),
            max_trials_global=budget, max_trials_per_task=budget, num_trials_per_iter=per_round,
            builder=builder, runner=runner, database=database.ms_database, cost_model=state.cost_model,
            measure_callbacks=callbacks, task_scheduler="round-robin",
        )
    except Exception as err:  # noqa: BLE001 - one case is the stop asked for, the rest re-raised
        # the stop terminated the task mid-batch and a search with no candidate left terminated it again ("Check
        # failed: (!task->is_terminated)", every server gone): all measured was committed, the search just ended
        if not (state.cut and "is_terminated" in str(err)):
            raise
    _quiet_ms_console()
