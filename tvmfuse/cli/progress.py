"""tune's progress: the trial count, its ETA against a time budget, and how it is drawn (a rich bar on a terminal,
one line per event when piped)."""
from __future__ import annotations

from tvmfuse.cli.common import err, fmt_duration, fmt_ms


class TrialCount:
    """What tune progress shows, apart from how it is drawn: searched trials against the run's trial total
    (``--trials``; the default schedules measured first are not trials of the search and are counted apart),
    kernels done, time elapsed and an ETA.

    ETA: the mean wall time per searched trial so far times the trials left; with ``--time-budget``, never more
    than the time left of the budget. A kernel that ends below its budget (time up, space exhausted, failed,
    interrupted) gives the rest back: the total shrinks to what will really be measured.
    """

    def __init__(self, time_budget_s: float | None = None, clock=None):
        import time

        self.time_budget_s = time_budget_s
        self.clock = clock or time.monotonic
        self.n_kernels = self.kernels_done = self.defaults = 0
        self.budgets: list[int] = []
        self.trials: list[int] = []
        self.default_of: set[int] = set()
        self.t0 = self.clock()

    def start(self, n_kernels: int, budgets: list[int]) -> None:
        self.t0 = self.clock()
        self.n_kernels = n_kernels
        self.budgets = [max(0, int(b)) for b in budgets]
        self.trials = [0] * n_kernels

    def batch(self, index: int, trials_done: int) -> None:
        self.trials[index] = max(self.trials[index], int(trials_done))
        self.budgets[index] = max(self.budgets[index], self.trials[index])

    def default(self, index: int) -> None:
        self.default_of.add(index)
        self.defaults = len(self.default_of)

    def kernel_done(self, index: int) -> None:
        self.kernels_done += 1
        self.budgets[index] = self.trials[index]

    @property
    def done(self) -> int:
        return sum(self.trials)

    @property
    def total(self) -> int:
        return sum(self.budgets)

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def eta(self) -> float | None:
        """Seconds left, or None before anything can be said (no trial measured yet, no time budget)."""
        elapsed, left = self.elapsed(), self.total - self.done
        guess = (elapsed / self.done * left) if self.done else (0.0 if left == 0 else None)
        if self.time_budget_s is not None:
            budget_left = max(0.0, self.time_budget_s - elapsed)
            guess = budget_left if guess is None else min(guess, budget_left)
        return guess


def trials_text(n: int) -> str:
    return f"{n} trial" if n == 1 else f"{n} trials"


def _eta_text(count: TrialCount) -> str:
    if (count.time_budget_s is not None and count.total > count.done
            and count.elapsed() >= count.time_budget_s):
        return "time up (finishing the pass in flight)"  # a pass started before the deadline runs to its end
    eta = count.eta()
    return "-" if eta is None else fmt_duration(eta)


class RichProgress:
    """Tune progress on stderr (stdout stays clean for --json): a live bar on a terminal; piped, one plain line
    per finished kernel, written at once (a live display that cannot redraw shows nothing until it ends)."""

    HEARTBEAT_S = 30.0  # piped: a line about the kernel being tuned when none has come for this long

    def __init__(self, enabled: bool, *, time_budget_s: float | None = None, live: bool | None = None):
        self.enabled = enabled
        self.count = TrialCount(time_budget_s)
        self.live = (err.is_terminal and not err.is_dumb_terminal) if live is None else live
        self._progress = None
        self._last_line = 0.0
        self.kernels: list = []
        self.servers: dict = {}  # kernel index -> {RPC server: trials it measured} (remote runs)
        self.lost: dict = {}  # kernel index -> trials lost with their server

    def __enter__(self):
        if self.enabled and self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                                      _eta_column(self.count), console=err)
            self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def _line(self, text: str) -> None:
        err.print(text, highlight=False, markup=False, soft_wrap=True)
        err.file.flush()
        self._last_line = self.count.clock()

    def _defaults_note(self) -> str:
        return f"+{self.count.defaults} default schedules" if self.count.defaults else ""

    def on_start(self, kernels, budgets):
        self.kernels = kernels
        self.count.start(len(kernels), budgets)
        if not self.enabled:
            return
        if self._progress:
            self._k = self._progress.add_task("kernels", total=len(kernels), detail="", eta=False)
            self._t = self._progress.add_task("trials", total=max(1, self.count.total), detail="", eta=True)
        else:
            budget = (f"; time budget {fmt_duration(self.count.time_budget_s)}"
                      if self.count.time_budget_s is not None else "")
            self._line(f"tuning {len(kernels)} kernels: up to {self.count.total} trials{budget} (a kernel tuned "
                       "for the first time has its default schedule measured first, not counted as a trial)")

    def on_default(self, index, default_s):
        self.count.default(index)
        if self._progress:
            self._progress.update(self._t, detail=f"{self.kernels[index].name[:40]}  default {fmt_ms(default_s)}  "
                                                  f"{self._defaults_note()}")

    def on_end_to_end(self):
        """The end-to-end check begins: two builds of the whole model, then interleaved timing."""
        if self.enabled:
            self._line("end-to-end check: building the model tuned and untuned, then timing both side by side")

    def on_remote(self, index, servers, lost):
        """Remote runs: which servers measured the kernel so far; each lost trial gets a line at once."""
        self.servers[index] = dict(servers)
        self.lost[index] = self.lost.get(index, 0) + len(lost)
        if not self.enabled or not lost:
            return
        name = self.kernels[index].name
        for server, reason in sorted(set(lost)):
            n = sum(1 for x in lost if x == (server, reason))
            if server == "no server":
                self._line(f"  {name}: lost {trials_text(n)}: {reason}")
            else:
                self._line(f"  {name}: lost {trials_text(n)} on {server} ({reason}); the run goes on on the other "
                           "servers under the key")
        if self._progress:
            self._progress.update(self._t, detail=f"{name[:40]}  {self._servers_note(index)}")

    def _servers_note(self, index) -> str:
        servers = self.servers.get(index) or {}
        shown = ", ".join(f"{s} x{n}" for s, n in sorted(servers.items(), key=lambda x: -x[1])[:3])
        more = f" +{len(servers) - 3} more" if len(servers) > 3 else ""
        lost = f"; {self.lost[index]} lost" if self.lost.get(index) else ""
        return f"on {shown}{more}{lost}" if shown else lost.lstrip("; ")

    def on_batch(self, index, trials_done, best_s):
        self.count.batch(index, trials_done)
        if not self.enabled:
            return
        if self._progress:
            remote = f"  {self._servers_note(index)}" if index in self.servers else ""
            self._progress.update(self._t, completed=self.count.done, total=max(1, self.count.total),
                                  detail=f"{self.kernels[index].name[:40]}  best {fmt_ms(best_s)}  "
                                         f"{self._defaults_note()}{remote}")
        elif self.count.clock() - self._last_line >= self.HEARTBEAT_S:
            c = self.count
            self._line(f"  {self.kernels[index].name}: tuning, {trials_done} of its "
                       f"{c.budgets[index]} trials, best {fmt_ms(best_s)}; {c.done}/{c.total} trials, "
                       f"{fmt_duration(c.elapsed())} elapsed, ETA {_eta_text(c)}")

    def on_kernel_done(self, index, result):
        self.count.kernel_done(index)
        if not self.enabled:
            return
        c = self.count
        if self._progress:
            self._progress.update(self._t, completed=c.done, total=max(1, c.total))
            self._progress.update(self._k, advance=1, detail=f"{result.name[:40]}: {result.status}")
            return
        default = " + default" if index in c.default_of else ""
        remote = f" ({self._servers_note(index)})" if index in self.servers else ""
        self._line(f"[{c.kernels_done}/{c.n_kernels}] {result.name}: {result.status}, {trials_text(c.trials[index])}"
                   f"{default}{remote}, best {fmt_ms(result.best_s)}; {c.done}/{c.total} trials, "
                   f"{fmt_duration(c.elapsed())} elapsed, ETA {_eta_text(c)}")


def _eta_column(count: TrialCount):
    """The bar's ETA, recomputed at each redraw (between batches too, so a time budget counts down)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class EtaColumn(ProgressColumn):
        def render(self, task):
            return Text(f"ETA {_eta_text(count)}" if task.fields.get("eta") else "", style="progress.remaining")

    return EtaColumn()
