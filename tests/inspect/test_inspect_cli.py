"""`tvmfuse inspect` through typer's CliRunner: tables, --json, one-line errors."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tvmfuse.cli.main import app

runner = CliRunner()


def _one_line(stderr: str) -> str:
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_tables(tuned_example):
    cfg, report = tuned_example
    res = runner.invoke(app, ["inspect", str(cfg.db), "--model", str(cfg.model), "--e2e-ms", "10"])
    assert res.exit_code == 0, res.output
    for title in ("fused kernels", "tuning", "model example: kernel sum", "end to end 10.000 ms"):
        assert title in res.stdout
    assert "layer_norm" in res.stdout and "gemm_epilogue" in res.stdout


def test_json_is_one_object(tuned_example):
    cfg, report = tuned_example
    res = runner.invoke(app, ["inspect", str(cfg.db), "--kernel", "matmul", "--json"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert set(obj) == {"db", "target", "device", "ceilings", "model", "kernels", "summary"}
    assert obj["kernels"] and all("matmul" in k["name"] for k in obj["kernels"])
    k = obj["kernels"][0]
    for key in ("pattern", "inputs", "outputs", "trials", "failed", "errors", "first_ms", "best_ms", "speedup",
                "hbm_bytes", "achieved_gbs", "bandwidth_share", "calls", "total_ms", "trial_ms"):
        assert key in k
    assert json.loads(obj["target"])["kind"] == "llvm"


def test_bad_db_path_is_one_line_exit_2(tmp_path):
    res = runner.invoke(app, ["inspect", str(tmp_path / "missing.db")])
    assert res.exit_code == 2
    assert "does not exist" in _one_line(res.stderr)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    res = runner.invoke(app, ["inspect", str(junk)])
    assert res.exit_code == 2
    assert _one_line(res.stderr).startswith("error: ")


def test_wrong_target_is_one_line_exit_2(tuned_example):
    cfg, _ = tuned_example
    res = runner.invoke(app, ["inspect", str(cfg.db), "--target", "cuda"])
    assert res.exit_code == 2
    assert "no records for target" in _one_line(res.stderr)


@pytest.fixture
def wide_tables(monkeypatch):
    """Tables wide enough that no header wraps (rich fits them to the terminal, 80 columns without one)."""
    from rich.console import Console

    import tvmfuse.cli.inspect as cli_inspect

    monkeypatch.setattr(cli_inspect, "out", Console(width=250, soft_wrap=True))


def test_cpu_bandwidth_is_dram_and_has_no_share(tuned_example, wide_tables):
    """Kernels tuned on a CPU are timed on data that stays in its caches: their GB/s pass the DRAM ceiling many
    times over, so inspect neither calls the memory HBM nor prints a share of the ceiling."""
    cfg, _ = tuned_example
    res = runner.invoke(app, ["inspect", str(cfg.db), "--model", str(cfg.model)])
    assert res.exit_code == 0, res.output
    assert "HBM" not in res.stdout and "of BW" not in res.stdout and "%" not in res.stdout, res.stdout
    assert "DRAM bandwidth ceiling" in res.stdout and "bytes read+written" in res.stdout
    assert "GB/s" in res.stdout  # the achieved bandwidth itself is still shown
    obj = json.loads(runner.invoke(app, ["inspect", str(cfg.db), "--json"]).stdout)
    assert obj["ceilings"]["memory"] == "DRAM"


def test_gpu_bandwidth_is_hbm_with_its_share(tuned_example, wide_tables, capsys):
    """The same report as if its records came from the H200: HBM bytes and the share of its ceiling."""
    from tvmfuse.cli.inspect import _print
    from tvmfuse.inspect.ceilings import ceilings_for

    cfg, _ = tuned_example
    report = json.loads(runner.invoke(app, ["inspect", str(cfg.db), "--json"]).stdout)
    report["target"] = json.dumps({"kind": "cuda", "arch": "sm_90a"})
    report["ceilings"] = ceilings_for(kind="cuda", device="NVIDIA H200 sm_90").to_json()
    for k in report["kernels"]:
        k["bandwidth_share"] = k["achieved_gbs"] / report["ceilings"]["bandwidth_gbs"]
    capsys.readouterr()
    _print(report)
    text = capsys.readouterr().out
    assert "HBM bandwidth ceiling 4275.0 GB/s" in text and "HBM bytes" in text and "of HBM BW" in text
    assert "%" in text and "DRAM" not in text
