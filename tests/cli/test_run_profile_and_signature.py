"""`tvmfuse run --profile/--trace` and the signature check as the CLI shows them: tables, --json, one-line refusals,
the --trust-unsigned warning. The example compiled untuned (seconds), real TVM."""
from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from tvmfuse.cli.main import app

runner = CliRunner()


@pytest.fixture
def artifact(untuned_example_artifact):
    return untuned_example_artifact


def _one_line_error(stderr: str) -> str:
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def test_run_profile_json_and_table(artifact, tmp_path, monkeypatch):
    manifest = json.loads((artifact / "manifest.json").read_text())
    trace = tmp_path / "t.json"
    r = runner.invoke(app, ["run", str(artifact), "--repeat", "2", "--trace", str(trace), "--json"])
    assert r.exit_code == 0, r.stderr
    prof = json.loads(r.stdout)["profile"]  # --trace implies --profile
    assert {k["name"] for k in prof["kernels"]} == {k["name"] for k in manifest["kernels"]}
    # an untuned llvm artifact: the CPU default's kernels, and TVM's plain lowering where it takes none
    assert all(k["schedule"] in ("cpu-default", "default") and k["calls"] == 1 and k["total_ms"] > 0
               for k in prof["kernels"])
    assert prof["trace"] == str(trace) and json.loads(trace.read_text())["traceEvents"]

    # a table wide enough that no kernel name wraps: the CLI's console is given the width (rich fixes a console's
    # width at its making where COLUMNS is set, and under pytest-xdist each worker's readline had set COLUMNS=80
    # before tvmfuse.cli was imported, so an invoke with env={"COLUMNS": "250"} printed 80 columns)
    import tvmfuse.cli.main as cli_main
    from rich.console import Console

    monkeypatch.setattr(cli_main, "out", Console(width=250, soft_wrap=True))
    r = runner.invoke(app, ["run", str(artifact), "--repeat", "0", "--profile", "--profile-runs", "2"])
    assert r.exit_code == 0, r.stderr
    assert "kernels of one run (mean of 2 runs, after 3 warm-up)" in r.stdout
    assert "host-timed" in r.stdout and "launch" in r.stdout
    assert all(k["name"] in r.stdout for k in manifest["kernels"])


@pytest.mark.parametrize("args,needle", [(["--trace", "{tmp}/no/such/folder/t.json"], "does not exist"),
                                         (["--trace", "{tmp}"], "is a folder")])
def test_run_trace_errors_are_one_line(artifact, tmp_path, args, needle):
    r = runner.invoke(app, ["run", str(artifact), *[a.format(tmp=tmp_path) for a in args]])
    assert r.exit_code == 2, (r.output, r.stderr)
    assert "--trace" in _one_line_error(r.stderr) and needle in r.stderr


def _edited_copy(artifact, tmp_path, change):
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    change(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return copy


def test_run_refuses_a_tampered_manifest_in_one_line(artifact, tmp_path):
    copy = _edited_copy(artifact, tmp_path, lambda m: m["kernels"][0].update(name="renamed"))
    for extra in ([], ["--trust-unsigned"]):
        r = runner.invoke(app, ["run", str(copy), "--repeat", "0", *extra])
        assert r.exit_code == 2, (r.output, r.stderr)
        assert _one_line_error(r.stderr) == ("error: manifest signature does not match: the artifact was changed or "
                                             "signed with another key")


def test_run_trust_unsigned_runs_an_unsigned_artifact_with_one_warning(artifact, tmp_path):
    copy = _edited_copy(artifact, tmp_path, lambda m: [m.pop("signature"), m.pop("signed_by")])
    r = runner.invoke(app, ["run", str(copy), "--repeat", "0"])
    assert r.exit_code == 2
    line = _one_line_error(r.stderr)
    assert "not signed" in line and "--trust-unsigned" in line
    r = runner.invoke(app, ["run", str(copy), "--repeat", "1", "--trust-unsigned", "--json"])
    assert r.exit_code == 0, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: the artifact's manifest is not signed; loaded anyway"), lines
    report = json.loads(r.stdout)
    assert report["signature"]["status"] == "unsigned" and report["warnings"] == [lines[0][len("warning: "):]]


def test_run_refuses_another_key_and_reports_a_verified_one(artifact):
    r = runner.invoke(app, ["run", str(artifact), "--repeat", "0", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["signature"]["status"] == "verified" and not r.stderr.strip()
    r = runner.invoke(app, ["run", str(artifact), "--repeat", "0"],
                      env={"TVMFUSE_SIGNING_KEY": "another key, 16+ bytes"})
    assert r.exit_code == 2
    assert "signed with key" in _one_line_error(r.stderr)


def test_compile_prints_the_manifest_digest_and_run_refuses_another(example_artifact, tmp_path):
    """The deployer's pin: `compile` reports the manifest's digest; `run --expect-digest` refuses any other manifest
    (a rebuilt or edited artifact), one line and exit 2, before anything of it is loaded."""
    import shutil

    from typer.testing import CliRunner

    from tvmfuse.cli.main import app
    from tvmfuse.runtime.loaded import manifest_digest

    art, report = example_artifact
    digest = report["manifest_digest"]
    assert digest == manifest_digest(art) and digest.startswith("sha256:") and len(digest) == 7 + 64
    ok = CliRunner().invoke(app, ["run", str(art), "--repeat", "1", "--expect-digest", digest])
    assert ok.exit_code == 0, ok.output
    copy = tmp_path / "copy"
    shutil.copytree(art, copy)
    manifest = copy / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"planner"', '"planner" ', 1))
    bad = CliRunner().invoke(app, ["run", str(copy), "--repeat", "1", "--expect-digest", digest])
    assert bad.exit_code == 2 and "not the expected one" in bad.output and "Traceback" not in bad.output
