"""One place that prints: human tables on stdout, JSON with --json, progress and errors on stderr."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# Piped or in a CI log there is no terminal width: rich would use 80 columns and cut every table to
# "tar… │ smo…". Tables there are as wide as they need (up to PIPE_WIDTH); COLUMNS still wins.
PIPE_WIDTH = 200


def _console(**kwargs) -> Console:
    console = Console(highlight=False, **kwargs)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(highlight=False, width=PIPE_WIDTH, **kwargs)
    return console


# stdout never interprets markup: labels, model names and server text are printed as they are (a label
# `x[/]` must not crash rich); the few styled cells use rich Text objects.
out = _console(markup=False, emoji=False)
err = _console(stderr=True)
_CONTROL = {c: None for c in [*range(0x00, 0x20), *range(0x7F, 0xA0), 0x200E, 0x200F, *range(0x202A, 0x202F),
                              *range(0x2066, 0x206A)] if c not in (0x09, 0x0A)}


def clean(text: str) -> str:
    """`text` without control characters (ESC sequences, BEL, backspace, bidi overrides): text that came
    from a server or a file reaches the terminal inert."""
    return str(text).translate(_CONTROL)


class _State:
    """Per-invocation output state (set while options are parsed)."""

    debug = False


state = _State()


def _json_default(value):
    """A result document prints as its JSON keys plus `location` (the folder it was saved in), which is
    where the CLI says it is and never part of the saved result (infer_tune/document.py); the rest as text."""
    if hasattr(value, "to_dict") and hasattr(value, "location"):
        where = value.location
        return {**value.to_dict(), **({"location": str(where)} if where is not None else {})}
    return str(value)


def print_json(document) -> None:
    sys.stdout.write(json.dumps(document, indent=2, default=_json_default) + "\n")
    sys.stdout.flush()


def error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(clean(message))}", soft_wrap=True)


def warn(message: str) -> None:
    """A loud warning on stderr (the command goes on)."""
    err.print(f"[bold yellow]warning:[/] {escape(clean(message))}", soft_wrap=True)


def note(message: str) -> None:
    err.print(escape(clean(message)), soft_wrap=True)


@contextmanager
def progress_bar(enabled: bool = True, out_dir: Path | str | None = None) -> Iterator:
    """Yield a `progress(stage, done, total)` callback: live bars on a terminal; in a log (no terminal)
    one line per finished config and a heartbeat during long silent steps (progress.LineProgress),
    reading each finished config's label and key figure from `out_dir` when given. A no-op when disabled."""
    if not enabled:
        yield lambda *args, **kwargs: None
        return
    if not err.is_terminal:
        from infer_tune.cli.progress import LineProgress

        with LineProgress(lambda line: err.print(line, markup=False, highlight=False, soft_wrap=True),
                          out_dir=out_dir) as lines:
            yield lines
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("ETA"), TimeRemainingColumn(), console=err, transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int | None, *info) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(escape(stage), total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield update


def fmt(value, spec: str = ".2f", none: str = "-") -> str:
    if value is None:
        return none
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
