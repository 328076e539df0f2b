"""`infer-tune tune --engine llama.cpp` / `--engine openvino`: the table of launches, the winner and its launch
command."""

from __future__ import annotations

import shlex

from rich.table import Table

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.errors import ConfigError
from infer_tune.report.display import plain


def tune_engine(opts: opt.MeasureOptions, engine: str, *, max_ppl_delta: float, max_bleu_drift: float,
                objective: str, budget_s: float) -> None:
    """The engine's own scenario (engines/base.py `Engine.scenario`: launches on loopback, OpenVINO in-process)
    searches its settings; one table for every engine."""
    import importlib

    from infer_tune.cli.measure import run_spec
    from infer_tune.engines.base import ENGINES, resolve

    name = resolve(engine, where="--engine")
    if not ENGINES[name].takes_settings:
        raise ConfigError(f"--engine must be one of {', '.join(e.name for e in ENGINES.values() if e.takes_settings)}"
                          f" (an engine run from its settings), got {engine!r}")
    scenario = importlib.import_module(ENGINES[name].scenario)
    tspec = scenario.tune_spec(name, max_ppl_delta=max_ppl_delta, max_bleu_drift=max_bleu_drift,
                               objective=objective, budget_s=budget_s, seed=opts.seed)
    spec = run_spec(opts)
    with output.progress_bar(not opts.json_out, out_dir=spec.out_dir) as progress:
        outcome = scenario.tune(spec, tspec, progress=progress)
    if opts.json_out:
        output.print_json(outcome.to_dict())
        return
    render(outcome, tspec)


def render(outcome, tspec) -> None:
    table = Table(title=f"tune --engine {tspec.engine} · {outcome.baseline.model['ref']} "
                        f"({outcome.elapsed_s / 60:.1f} min, objective {tspec.objective})")
    for name in ("launch", "status", "ratio [95%]", "decode tok/s", "TTFT p50 ms", "ppl", "ppl Δ%", "BLEU drift",
                 "BLEU vs default", "why not"):
        table.add_column(name, justify="left" if name in ("launch", "status", "why not") else "right")
    base = outcome.baseline
    table.add_row(base.label, "default", "1.00", output.fmt(1000 / base.tpot_p50_ms if base.tpot_p50_ms else None, ".1f"),
                  output.fmt(base.ttft_p50_ms, ".0f"), output.fmt(base.metric("ppl"), ".3f"), "-", "-", "-", "")
    for row in outcome.tried():
        if row["status"] in ("refused", "crashed"):
            table.add_row(row["label"], row["status"], "-", "-", "-", "-", "-", "-", "-", row["reason"])
            continue
        ci = row["ratio_ci95"]
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        table.add_row(row["label"], row["status"] + (" ✓" if row["eligible"] else ""), ratio,
                      output.fmt(row["decode_tok_s"], ".1f"), output.fmt(row["ttft_p50_ms"], ".0f"),
                      output.fmt(row["ppl"], ".3f"), output.fmt(row["ppl_delta_pct"], "+.2f"),
                      output.fmt(row["bleu_drift"], "+.2f"), output.fmt(row["bleu_vs_baseline"], ".1f"),
                      row["reason"] or "")
    output.out.print(table)
    for line in outcome.notes:
        output.out.print(f"note: {line}", soft_wrap=True, markup=False)  # launch labels hold user settings
    for doc in outcome.crashed:  # quarantined for this search; how to see it again by hand
        # what an engine printed (its summary) reaches the terminal inert: no escape sequences, no line breaks
        output.out.print(plain(f"crashed: {doc.label} ({doc['crash']['summary']}; row {doc.location}); reproduce: "
                               f"{doc['crash']['reproducer']['line']}"), soft_wrap=True, markup=False)
    w = outcome.winner
    output.out.print(f"winner: {w['label']}", soft_wrap=True, markup=False)
    output.out.print(f"launch: {shlex.join(outcome.command)}", soft_wrap=True, markup=False)
    output.out.print(f"recommended: {outcome.recommended} (measure it again: infer-tune bench --recipe "
                     f"{outcome.recommended})", soft_wrap=True, markup=False)
    by_hand = by_hand_bench(outcome)
    if by_hand:
        output.out.print(f"by hand: start the launch above, then {by_hand}", soft_wrap=True, markup=False)


def by_hand_bench(outcome) -> str | None:
    """The `bench --endpoint` line that measures the printed launch, started by hand, on the run's workload
    (the same prompts and lengths, every request decoding its full length as in the search)."""
    cmd = outcome.command
    if "--port" not in cmd:
        return None
    w = outcome.winner.get("workload") or {}
    host = cmd[cmd.index("--host") + 1] if "--host" in cmd else "127.0.0.1"
    served = cmd[cmd.index("--alias") + 1] if "--alias" in cmd else outcome.winner["model"]["ref"]
    parts = ["infer-tune", "bench", "--endpoint", f"http://{host}:{cmd[cmd.index('--port') + 1]}/v1",
             "--model", str(outcome.winner["model"]["ref"]), "--served-model", served, "--ignore-eos"]
    for flag, key in (("--suite", "suite"), ("--limit", "limit"), ("--max-new-tokens", "max_new_tokens"),
                      ("--seed", "seed"), ("--max-prompt-tokens", "max_prompt_tokens"), ("--lang", "lang"),
                      ("--prompt-field", "prompt_field"), ("--reference-field", "reference_field")):
        if w.get(key) is not None:
            parts += [flag, str(w[key])]
    if w.get("chat_template") is False:
        parts.append("--no-chat-template")
    # the row's requests in flight: one per slot of the launch (engine_tune.open_launch)
    parallel = int(cmd[cmd.index("--parallel") + 1]) if "--parallel" in cmd else 1
    if parallel > 1:
        parts += ["--concurrency", str(parallel)]
    return shlex.join(parts)
