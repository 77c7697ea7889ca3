"""What every command shares: error handling, ``--json`` output, tables."""
from __future__ import annotations

import json
import logging
import sys
import traceback
from contextlib import contextmanager
from typing import Any, Iterator

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperCommand, TyperGroup

from tvmfuse.errors import TvmfuseError, headline

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

JsonOpt = typer.Option(False, "--json", help="Print one JSON object on stdout instead of tables.")
VerboseOpt = typer.Option(False, "--verbose", "-v", help="Show tracebacks and TVM's logs.")
ThreadsOpt = typer.Option(None, "--threads", help="CPU threads of TVM's runtime (default: the physical cores); "
                          "tuning measures with the same count.")


def _plain_flags(params: list) -> list:
    # typer's rich help prints a flag's type ("<bool>") in the column that shows what a value option takes,
    # which reads as if `--json` wanted a value; an empty metavar leaves that column blank for flags only
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class FlagCommand(TyperCommand):
    """A command whose help shows boolean options as plain flags (``--json``, not ``--json <bool>``)."""

    def get_params(self, ctx):
        return _plain_flags(super().get_params(ctx))


class FlagGroup(TyperGroup):
    """A command group whose help, and every subcommand's, shows boolean options as plain flags."""

    def get_params(self, ctx):
        return _plain_flags(super().get_params(ctx))

    def get_command(self, ctx, cmd_name):
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None and not isinstance(cmd, (FlagCommand, FlagGroup)):
            _plain_flags(cmd.get_params(ctx))
        return cmd


@contextmanager
def handle_errors(verbose: bool) -> Iterator[None]:
    """Turn errors into one line on stderr and an exit code; a traceback only with ``--verbose``.

    TvmfuseError -> its exit code (2 for bad input); anything else is a bug -> exit 3. TVM's native log
    output is shown only with ``--verbose`` (``tvmfuse.logs.capture_native_stderr``).
    """
    from tvmfuse.logs import capture_native_stderr

    if not verbose:
        logging.getLogger("tvm").setLevel(logging.ERROR)
    # TVM's C++ warnings go straight to fd 2, past every Python filter: captured, and one summary line on exit
    with capture_native_stderr(verbose=verbose):
        try:
            yield
        except typer.Exit:
            raise
        except TvmfuseError as e:
            if verbose:
                traceback.print_exc()
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            raise typer.Exit(130) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence: one line, no traceback
            if verbose:
                traceback.print_exc()
            print(f"error: internal error: {type(e).__name__}: {headline(e)} (rerun with --verbose for the traceback)",
                  file=sys.stderr)
            raise typer.Exit(3) from None


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=None, default=str) + "\n")


def table(title: str | None, columns: list[str], rows: list[list[Any]], caption: str | None = None) -> Table:
    t = Table(title=title, caption=caption, show_lines=False, header_style="bold")
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    return t


def fmt_bytes(n: float | int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_ms(seconds: float | None) -> str:
    """A duration given in seconds, shown in µs or ms."""
    if seconds is None:
        return "-"
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.3f} ms"


def fmt_duration(seconds: float | None) -> str:
    """A wall time for people: 42 s, 3 min, 1 h 05 min."""
    if seconds is None:
        return "-"
    if seconds < 59.5:
        return f"{max(0.0, seconds):.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"
