"""``tvmfuse db ...``: inspect and maintain tuning databases (parses, calls tvmfuse.db.ops, prints)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from tvmfuse.cli.common import FlagGroup, JsonOpt, VerboseOpt, emit_json, handle_errors, out, table

app = typer.Typer(help="Inspect and maintain tuning databases (info, merge, export, import, prune, recover).",
                  no_args_is_help=True, cls=FlagGroup)

_DEFAULT = Path("tuning_logs") / "tvmfuse.db"
DbArg = typer.Argument(_DEFAULT, help="The tuning database file.")
DbOpt = typer.Option(_DEFAULT, "--db", help="The tuning database file.")


def _canonical(target: Optional[str]) -> Optional[str]:
    if target is None:
        return None
    from tvmfuse.target import resolve_target

    return resolve_target(target).canonical


@app.command("info")
def info_cmd(path: Path = DbArg, json_out: bool = JsonOpt, verbose: bool = VerboseOpt) -> None:
    """Counts of records, failed trials and workloads, per target/device and per model."""
    from tvmfuse.db import ops

    with handle_errors(verbose):
        res = ops.info(path=path)
        if json_out:
            emit_json(res)
            return
        out.print(f"{res['path']}: {res['records']} records ({res['failed']} failed), "
                  f"{res['workloads']} workloads")
        out.print(table("Targets", ["target", "device", "workloads", "records", "failed"],
                        [[t["target"], t["device"], t["workloads"], t["records"], t["failed"]]
                         for t in res["targets"]]))
        if any(m["model"] for m in res["models"]):
            out.print(table("Models", ["model", "target", "device", "workloads", "records"],
                            [[m["model"] or "-", m["target"], m["device"], m["workloads"], m["records"]]
                             for m in res["models"]]))


@app.command("merge")
def merge_cmd(sources: List[Path] = typer.Argument(..., help="Databases to merge from."),
              into: Path = typer.Option(..., "--into", help="Database to merge into (created if missing)."),
              json_out: bool = JsonOpt, verbose: bool = VerboseOpt) -> None:
    """Merge databases: workloads matched structurally, identical trials copied once."""
    from tvmfuse.db import ops

    with handle_errors(verbose):
        res = ops.merge(sources=list(sources), dest=into)
        if json_out:
            emit_json(res)
            return
        out.print(table(f"Merged into {into}", ["added", "duplicates", "workloads added", "records"],
                        [[res["added"], res["duplicates"], res["workloads_added"],
                          res["records"]]]))


@app.command("export")
def export_cmd(out_dir: Path = typer.Argument(..., help="Folder for database_workload.json and "
                                                        "database_tuning_record.json."),
               db: Path = DbOpt,
               target: Optional[str] = typer.Option(None, "--target", help="Only this target (llvm, cuda, JSON)."),
               device: Optional[str] = typer.Option(None, "--device", help="Only this device identity."),
               no_failed: bool = typer.Option(False, "--no-failed", help="Leave failed trials out."),
               json_out: bool = JsonOpt, verbose: bool = VerboseOpt) -> None:
    """Export to MetaSchedule's JSON database files."""
    from tvmfuse.db import ops

    with handle_errors(verbose):
        res = ops.export_json(path=db, out_dir=out_dir, target=_canonical(target), device=device,
                              include_failed=not no_failed)
        if json_out:
            emit_json(res)
            return
        out.print(table(f"Exported {db}", ["workloads", "records", "files"],
                        [[res["workloads"], res["records"], " ".join(res["files"])]]))


@app.command("import")
def import_cmd(src_dir: Path = typer.Argument(..., help="Folder with MetaSchedule's database_*.json files."),
               db: Path = DbOpt,
               target: str = typer.Option("auto", "--target", help="Target the records were measured on."),
               json_out: bool = JsonOpt, verbose: bool = VerboseOpt) -> None:
    """Import MetaSchedule's JSON database files (a torn last line is skipped)."""
    from tvmfuse.db import ops
    from tvmfuse.target import resolve_target

    with handle_errors(verbose):
        res = ops.import_json(path=db, src_dir=src_dir, target=resolve_target(target))
        if json_out:
            emit_json(res)
            return
        out.print(table(f"Imported into {db}", ["added", "duplicates", "skipped", "torn lines", "records"],
                        [[res["added"], res["duplicates"], res["skipped"], res["torn_lines"], res["records"]]]))


@app.command("prune")
def prune_cmd(path: Path = DbArg,
              top_k: int = typer.Option(..., "--top-k", help="Valid records to keep per workload and target."),
              target: Optional[str] = typer.Option(None, "--target", help="Only this target (llvm, cuda, JSON)."),
              json_out: bool = JsonOpt, verbose: bool = VerboseOpt) -> None:
    """Keep the best K records per workload and target (pruned trials still count as spent)."""
    from tvmfuse.db import ops

    with handle_errors(verbose):
        res = ops.prune(path=path, top_k=top_k, target=_canonical(target))
        if json_out:
            emit_json(res)
            return
        out.print(table(f"Pruned {path}", ["removed", "records"], [[res["removed"], res["records"]]]))


@app.command("recover")
def recover_cmd(src: Path = typer.Argument(..., help="The damaged database (left untouched)."),
                dest: Path = typer.Argument(..., help="New file for what can be read."),
                json_out: bool = JsonOpt, verbose: bool = VerboseOpt) -> None:
    """Salvage the readable workloads and records of a damaged database into a new file."""
    from tvmfuse.db import ops

    with handle_errors(verbose):
        res = ops.recover(src=src, dest=dest)
        if json_out:
            emit_json(res)
            return
        out.print(table(f"Recovered {src} -> {dest}", ["workloads", "records", "dropped workloads",
                                                       "dropped records"],
                        [[res["workloads"], res["records"], res["dropped_workloads"], res["dropped_records"]]]))
        for e in res["errors"]:
            out.print(f"  damaged: {e}")
