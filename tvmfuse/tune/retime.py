"""A search's finalists timed again side by side, their records ranked by those times.

On a shared machine a trial's time depends on when it ran: a cold CPU trial streams the kernel's weights from DRAM,
whose bandwidth the machine's other tenants share. One ResNet-50 conv's untuned default (one module, the same
trace) measured 0.141 ms as the run's first record, 0.095 ms in a search batch a second later and 0.14-0.15 ms
alone afterwards (2-core AMD EPYC). The fastest of 64 such trials is the luckiest as much as the fastest: ranked by
their first times, a search keeps configs for when they ran.

After a kernel's search, its fastest distinct schedules (the finalists) and its first record (the default, where
the run measured one) are measured again in interleaved rounds: each round times every one of them once, in a
rotated order, so a stretch of load falls on all of them alike. Each record of a finalist's schedule then holds the
samples of those rounds (its trials' other measurements of that schedule included), and the build applies the
fastest by them. Where the fastest record is then one that no round timed (a lucky trial behind the finalists),
its schedule is timed against the best so far in another pass.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

from tvmfuse._tvm import ms

log = logging.getLogger("tvmfuse.tune")

FINALISTS = 4   # the search's fastest distinct schedules timed again, besides the first record
ROUNDS = 5      # each a trial of every finalist (a CPU trial: tvmfuse.tune.samples.CPU_SAMPLES cold calls)
PASSES = 3      # at most, while the fastest record is one no round timed


def retime_finalists(kernel, *, target, database, builder, runner, finalists: int = FINALISTS,
                     rounds: int = ROUNDS) -> dict | None:
    """Time ``kernel``'s finalists side by side and give their records the new times (see the module's doc).

    Returns what changed: ``finalists`` (schedules timed), ``rounds``, ``best_before_ms`` and ``best_ms`` (the
    fastest record before and after), ``first_before_ms`` and ``first_ms`` (the first record's), ``best_changed``
    (another schedule is now the fastest) and ``untimed`` (finalists that did not build or run again: their
    records keep their times); None where the kernel has fewer than two distinct valid schedules."""
    wid = database.workload_id(kernel.mod)
    groups = _schedules(database, wid)
    if len(groups) < 2:
        return None
    first = next(iter(groups))
    fastest = min(groups, key=lambda k: groups[k][0])
    report = {"rounds": rounds, "best_before_ms": groups[fastest][0] * 1e3,
              "first_before_ms": groups[first][0] * 1e3}
    timed: dict[str, float] = {}
    untimed: set[str] = set()   # built or ran no more: their records keep their times
    for _ in range(PASSES):
        ranked = sorted(groups, key=lambda k: groups[k][0])
        if ranked[0] in timed or ranked[0] in untimed:
            break
        picks = [k for k in ranked if k not in timed and k not in untimed][:finalists]
        anchors = [first] + ([min(timed, key=timed.get)] if timed else [])
        keys = list(dict.fromkeys(picks + [k for k in anchors if k not in untimed]))
        times = _side_by_side([groups[k][1][0] for k in keys], kernel, target=target, database=database,
                              builder=builder, runner=runner, rounds=rounds)
        for key, secs in zip(keys, times):
            if secs is None:
                untimed.add(key)
                timed.pop(key, None)
                continue
            database.retime_records([r.id for r in groups[key][1]], secs)
            timed[key] = sum(secs) / len(secs)
        groups = _schedules(database, wid)
    report.update(finalists=len(timed), untimed=len(untimed))
    best = min(groups, key=lambda k: groups[k][0])
    report.update(best_ms=groups[best][0] * 1e3, first_ms=groups[first][0] * 1e3, best_changed=best != fastest)
    return report


def _schedules(database, wid) -> dict[str, tuple[float, list]]:
    """The kernel's distinct valid schedules in the order first measured: trace -> (fastest mean, its records)."""
    groups: dict[str, tuple[float, list]] = {}
    for row in database.records(wid, include_failed=False):
        key = json.dumps(row.trace, sort_keys=True)
        best, rows = groups.get(key, (row.mean_secs, []))
        groups[key] = (min(best, row.mean_secs), rows + [row])
    return groups


def _side_by_side(rows: list, kernel, *, target, database, builder, runner, rounds: int) -> list:
    """Each record's schedule built again and timed in ``rounds`` interleaved rounds: its samples (seconds) over
    all rounds, or None where it did not build or a round of it did not run."""
    mods = [database.schedule_of(r, kernel.mod) for r in rows]
    built = builder.build([ms.builder.BuilderInput(m, target.target) for m in mods])
    ok = [i for i, b in enumerate(built) if b.error_msg is None]
    samples: list = [[] if i in ok else None for i in range(len(rows))]
    try:
        if not ok:
            return samples
        order = [ok[(r + j) % len(ok)] for r in range(rounds) for j in range(len(ok))]
        device = "cuda" if target.is_gpu else "cpu"
        inputs = [ms.runner.RunnerInput(built[i].artifact_path, device,
                                        ms.arg_info.ArgInfo.from_entry_func(mods[i], True)) for i in ok]
        by_index = dict(zip(ok, inputs))
        for i, future in zip(order, runner.run([by_index[i] for i in order])):
            res = future.result()
            if samples[i] is None:
                continue
            if res.error_msg is not None or not res.run_secs or max(float(s) for s in res.run_secs) >= 1e9:
                log.info("%s: a finalist did not run again (%s); its records keep their times", kernel.name,
                         (res.error_msg or "no time").strip().splitlines()[-1][:200])
                samples[i] = None
                continue
            samples[i] += [float(s) for s in res.run_secs]
        return [s or None for s in samples]
    finally:
        for b in built:
            if b.artifact_path:
                shutil.rmtree(os.path.dirname(b.artifact_path), ignore_errors=True)


def finalists_for(config, target) -> int:
    """Finalists a run times again: ``config.retime_finalists``, by default FINALISTS on CPUs and none on GPUs (a
    GPU trial is one sample of 20 ms of back-to-back calls on a device no other process shares)."""
    n = config.retime_finalists
    return (0 if target.is_gpu else FINALISTS) if n is None else n


def retime_result(result, kernel, *, target, database, config, builder, runner, spent: int) -> None:
    """:func:`retime_finalists` for a kernel whose search measured something, into ``result.retimed``; the
    default's time (``result.baseline_s``, the first record where this run measured it) follows its re-timing."""
    finalists = finalists_for(config, target)
    if not finalists or builder is None or result.status not in ("tuned", "resumed"):
        return
    try:
        result.retimed = retime_finalists(kernel, target=target, database=database, builder=builder,
                                          runner=runner, finalists=finalists)
    except Exception as err:  # noqa: BLE001 - the records keep their first times; the report says so
        result.retimed = {"note": "did not run: " + (str(err).strip().splitlines() or [type(err).__name__])[-1][:200]}
        log.warning("%s: timing the finalists again failed: %s", kernel.name, result.retimed["note"])
        return
    if result.retimed and spent == 0 and result.baseline_s is not None:
        result.baseline_s = result.retimed["first_ms"] / 1e3
