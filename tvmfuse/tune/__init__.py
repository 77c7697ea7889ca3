"""Stage 4: one MetaSchedule task per fused kernel, tuned within a trial budget into the database."""
from tvmfuse.tune.tasks import Kernel, extract_kernels
from tvmfuse.tune.tuner import KernelResult, TuneConfig, TuneProgress, tune_kernels

__all__ = ["Kernel", "extract_kernels", "TuneConfig", "TuneProgress", "KernelResult", "tune_kernels"]
