"""The cost model one tuning run shares across its kernels."""
from __future__ import annotations

from tvmfuse._tvm import derived_object, ms
from tvmfuse.errors import TvmfuseError

COST_MODELS = ("xgb", "random")
# samples an XGBoost model takes before its predictions steer the search (MetaSchedule's default is 100, more
# than most kernels are given): with one model per run, a run's first kernels train it for the later ones
XGB_WARMUP_SAMPLES = 16


def make_cost_model(name: str):
    """The cost model one tuning run shares across its kernels: ``xgb`` (MetaSchedule's XGBoost model over its
    per-store features and the template configs' knobs, ``tvmfuse.tune.features``) or ``random``. Each kernel's
    measurements train the same model, so the later kernels of a run are searched with what the earlier ones
    taught it. Raises TvmfuseError (exit 2) when the model cannot be made: never another model silently."""
    if name not in COST_MODELS:
        raise TvmfuseError(f"unknown cost model '{name}'", hint="choose from " + ", ".join(COST_MODELS))
    if name == "random":
        return ms.cost_model.RandomModel()
    try:
        import xgboost  # noqa: F401
    except ImportError as err:
        raise TvmfuseError(f"the xgb cost model needs xgboost, which does not import here ({err})",
                           hint="pip install xgboost, or --cost-model random") from None
    from tvmfuse.tune.features import TemplateFeatures

    # retrained after every round: MetaSchedule's adaptive training waits until the data has grown by a fifth, so
    # a model shared by a run's kernels stopped learning within a kernel once earlier kernels had filled it (in a
    # replay of six drawn convs, retrained each round it reached random search's 32-trial best in 14 trials, not
    # never; its median speedup over the default went from 1.19 to 1.15)
    return ms.cost_model.XGBModel(extractor=TemplateFeatures(), num_warmup_samples=XGB_WARMUP_SAMPLES,
                                  adaptive_training=False)


def fitted(model) -> bool:
    """Whether ``model`` predicts from what it learned: an XGBoost model holding its warm-up samples and a booster
    (before that, MetaSchedule's XGBoost model predicts uniformly at random)."""
    data = getattr(model, "data_size", None)
    return (data is not None and data >= getattr(model, "num_warmup_samples", 0)
            and getattr(model, "booster", None) is not None)


@derived_object
class LearnEveryTrial(ms.measure_callback.PyMeasureCallback):
    """MetaSchedule's UpdateCostModel, but a candidate that failed to build is a failure the model learns (a cost
    of 1e10, no throughput) rather than a sample it skips, and a trial lost with its RPC server is no sample.

    Skipped, failed builds never taught a model that a region of the space does not build, and it kept ranking that
    region first: in a replay of drawn convs, whose table answers a sketch it has no times for as a failed build,
    the model-guided search spent all 32 trials of three of six convs there."""

    def __init__(self, cost_model):
        super().__init__()
        self.cost_model = cost_model

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        from tvmfuse.rpc.runner import is_lost

        keep = [i for i, r in enumerate(runner_results) if not is_lost(r)]
        if not keep:
            return
        results = [runner_results[i] if builder_results[i].error_msg is None
                   else ms.runner.RunnerResult(None, "build failed") for i in keep]
        self.cost_model.update(task_scheduler.tasks_[task_id].ctx, [measure_candidates[i] for i in keep], results)


def learning_callbacks(callbacks: list, cost_model) -> list:
    """``callbacks`` (MetaSchedule's defaults, or the RPC runner's) with their cost-model update replaced by
    :class:`LearnEveryTrial`."""
    return [cb for cb in callbacks if type(cb).__name__ != "UpdateCostModel"] + [LearnEveryTrial(cost_model)]
