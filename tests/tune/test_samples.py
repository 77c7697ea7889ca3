import pytest

from tvmfuse._tvm import derived_object, ms
from tvmfuse.tune.samples import STRETCH, KeptSamplesRunner, kept_samples


def test_a_stretched_sample_is_dropped_and_the_rest_keep_their_order():
    # a SqueezeNet kernel's five samples on the shared CI-class machine (ms)
    assert kept_samples([0.25, 1.14, 0.11, 0.12, 0.11]) == [0.11, 0.12, 0.11]
    assert kept_samples([3.0, 2.0, 2.1, 2.0]) == [2.0, 2.1, 2.0]   # even count: the mean of the middle two


def test_samples_within_the_stretch_of_their_median_are_all_kept():
    secs = [1.0, 1.0, STRETCH, 0.5, 1.1]
    assert kept_samples(secs) == secs


def test_fewer_than_three_samples_pass_unchanged():
    assert kept_samples([0.1, 5.0]) == [0.1, 5.0]
    assert kept_samples([7.0]) == [7.0]


@derived_object
class _Done(ms.runner.PyRunnerFuture):
    def __init__(self, result):
        super().__init__()
        self.res = result

    def done(self):
        return True

    def result(self):
        return self.res


@derived_object
class _Replay(ms.runner.PyRunner):
    """Answers each input with the next of ``results`` (the measured times of a runner that ran elsewhere)."""

    def __init__(self, results):
        super().__init__()
        self.results = list(results)

    def run(self, runner_inputs):
        return [_Done(self.results.pop(0)) for _ in runner_inputs]


def test_the_runner_passes_kept_samples_and_failures_through_metaschedules_objects():
    inner = _Replay([ms.runner.RunnerResult([0.2, 0.9, 0.2, 0.21, 0.2], None),
                     ms.runner.RunnerResult(None, "did not run"),
                     ms.runner.RunnerResult([1e9], None)])
    runner = KeptSamplesRunner(inner)
    futures = runner.run([ms.runner.RunnerInput(f"/nowhere/{i}", "cpu", []) for i in range(3)])
    ok, error, failed = (f.result() for f in futures)
    assert [float(s) for s in ok.run_secs] == pytest.approx([0.2, 0.2, 0.21, 0.2])
    assert ok.error_msg is None
    assert error.error_msg == "did not run" and error.run_secs is None
    assert [float(s) for s in failed.run_secs] == [1e9]


def test_cpu_trials_are_cold_where_the_weights_outgrow_the_cache(example_kernels):
    """auto: warm where the model's weights fit in half the last-level cache, cold past it; cold and warm as asked;
    anything else is a one-line error."""
    from tvmfuse.errors import TvmfuseError
    from tvmfuse.tune import samples

    llc = samples.last_level_cache_bytes()
    weights = samples.weight_bytes(example_kernels)
    # the example's weights: every layout-free parameter of every kernel, times its calls
    assert weights > 0
    assert samples.cpu_trials(example_kernels, "cold") == ("cold", "asked")
    assert samples.cpu_trials(example_kernels, "warm") == ("warm", "asked")
    with pytest.raises(TvmfuseError, match="auto, cold or warm"):
        samples.cpu_trials(example_kernels, "hot")
    mode, why = samples.cpu_trials(example_kernels)
    if llc is None:
        assert mode == "cold" and "not known" in why
    else:
        assert (mode == "warm") == (weights <= samples.WARM_SHARE * llc) and "last-level cache" in why


def test_the_local_runner_flushes_the_weights_only_for_cold_trials():
    from tvmfuse.tune.samples import CPU_SAMPLES, local_runner

    for cold in (True, False):
        cfg = getattr(local_runner(30, gpu=False, cold=cold), "_inst").evaluator_config
        assert cfg.enable_cpu_cache_flush is cold and cfg.repeat == CPU_SAMPLES and cfg.number == 1


def test_an_unknown_cpu_trial_mode_stops_before_anything_runs():
    from tvmfuse.errors import TvmfuseError
    from tvmfuse.tune import TuneConfig

    with pytest.raises(TvmfuseError, match="auto, cold or warm"):
        TuneConfig(cpu_trials="hot")
    assert TuneConfig(cpu_trials="warm").cpu_trials == "warm"
