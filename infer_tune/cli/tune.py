"""`infer-tune tune`: the fastest configuration within a drift budget, found and measured on this machine."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from infer_tune.cli import executor_opts as xo
from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.errors import ConfigError

MaxPplDelta = Annotated[float, typer.Option("--max-ppl-delta", help="Largest perplexity change allowed, in percent.")]
MaxBleuDrift = Annotated[float, typer.Option("--max-bleu-drift", help="Largest BLEU loss allowed vs the baseline (points).")]
RequireLossless = Annotated[bool, typer.Option("--require-lossless", help="Only configs whose outputs equal the baseline's token for token.")]
Objective = Annotated[str, typer.Option("--objective", help="decode (TPOT p50), ttft (TTFT p50), throughput (output tok/s) "
                                                            "or goodput (requests/s meeting --slo-ttft-ms and --slo-tpot-ms "
                                                            "on a Poisson trace at --rate).")]
Rate = Annotated[float | None, typer.Option("--rate", help="--objective goodput: offered load, requests/s of the seeded "
                                                           "Poisson trace, one request per prompt (default 1).")]
BudgetMinutes = Annotated[float, typer.Option("--budget-minutes", help="Wall-clock budget for the whole search.")]
Methods = Annotated[str | None, typer.Option("--methods", help="Quantize methods to consider, comma-separated "
                                                               "(default: int4-rtn-a8,int4-rtn,int4-weight,int8-dynamic,int8-static,bf16; "
                                                               "-a8: with int8 activations).")]
Reference = Annotated[bool, typer.Option("--reference/--no-reference", help="Measure llama.cpp at its best as a reference row: the fastest of Q4_0 / Q4_K_M / Q8_0 made from the same checkpoint (needs scripts/build-llama-cpp.sh; else llama-cpp-python on the shipped GGUF).")]
Engine = Annotated[str | None, typer.Option("--engine", help="Search an engine's own settings instead (llama.cpp: launches on loopback; openvino: in-process, docs/engines.md), quality against its default launch (docs/tune.md, 'Tuning a deployed engine').")]
Compile = Annotated[bool, typer.Option("--compile/--no-compile", help="Allow candidates that compile the decode step (minutes each on few cores).")]


def render(outcome) -> None:
    """The tried table, the winner, the reference verdict and how to reproduce."""
    table = Table(title=f"tune · {outcome.baseline['model']['ref']} · {outcome.baseline['workload']['suite']} "
                        f"({outcome.elapsed_s / 60:.1f} min)")
    goodput = outcome.objective == "goodput"
    names = ["config", "status", "decode tok/s", "TTFT p50 ms", "speedup", "ppl Δ%", "BLEU drift", "why not"]
    if goodput:  # good req/s (the baseline's on the same trace) and the ratio with its 95% interval
        names[5:5] = ["goodput req/s (base)", "goodput ratio [95%]"]
    for name in names:
        table.add_column(name, justify="left" if name in ("config", "status", "why not") else "right")
    blank = ["-", "-"] if goodput else []
    base = outcome.baseline
    table.add_row("baseline", "measured", output.fmt(1000 / base.tpot_p50_ms if base.tpot_p50_ms else None, ".1f"),
                  output.fmt(base.ttft_p50_ms, ".0f"), "1.00", *blank, "-", "-", "")
    if outcome.reference is not None:
        ref = outcome.reference
        table.add_row(ref.label, "reference", output.fmt(1000 / ref.tpot_p50_ms if ref.tpot_p50_ms else None, ".1f"),
                      output.fmt(ref.ttft_p50_ms, ".0f"), output.fmt(ref.speedup), *blank,
                      "-", output.fmt(ref.bleu_drift, "+.2f"), "")
    for row in outcome.tried():
        status = row["status"] + (" ✓" if row["eligible"] else "")
        cells = [goodput_cell(row["goodput_req_s"], row["baseline_goodput_req_s"]),
                 ratio_cell(row["goodput_ratio_vs_baseline"], row["goodput_ratio_vs_baseline_ci95"])] if goodput else []
        table.add_row(row["label"], status, output.fmt(row["decode_tok_s"], ".1f"), output.fmt(row["ttft_p50_ms"], ".0f"),
                      output.fmt(row["speedup_vs_baseline"]), *cells, output.fmt(row["ppl_delta_pct"], "+.2f"),
                      output.fmt(row["bleu_drift"], "+.2f"), row["reason"] or "")
    output.out.print(table)
    winner = outcome.winner
    m = winner.metrics
    if goodput and winner.technique != "baseline":  # the definition and the trace are in the notes
        base_goodput = (m.get("goodput_vs_baseline") or {}).get("baseline_goodput_req_s")
        ratio = ratio_cell(m.get("goodput_ratio_vs_baseline"), m.get("goodput_ratio_vs_baseline_ci95"))
        output.out.print(f"winner's goodput: {output.fmt(m.get('goodput_req_s'))} req/s against the baseline's "
                         f"{output.fmt(base_goodput)} on the same trace, ratio {ratio}, SLO attainment "
                         f"{output.fmt(m.get('slo_attainment'), '.0%')}", soft_wrap=True)
    found = outcome.winner_found_s
    output.out.print(f"winner: {winner.label} ({winner.technique}"
                     + (f", measured {found / 60:.1f} min into the search" if found is not None else "") + "): "
                     f"{output.fmt(1000 / winner.tpot_p50_ms if winner.tpot_p50_ms else None, '.1f')} tok/s decode, "
                     f"TTFT p50 {output.fmt(winner.ttft_p50_ms, '.0f')} ms, speedup "
                     f"{output.fmt(winner.speedup or 1.0)}x, ppl "
                     f"{output.fmt(winner.ppl_delta_pct, '+.2f')}%, BLEU drift {output.fmt(winner.bleu_drift, '+.2f')}",
                     soft_wrap=True)
    vs = outcome.versus_reference
    if vs is not None:
        verdict = "beat" if vs["beat_decode"] else "did not beat"
        which = f"its fastest format here, {vs['reference_format']}" if vs.get("reference_format") else "the GGUF the model came from"
        output.out.print(f"vs llama.cpp ({which}, same run): {verdict} it on decode "
                         f"({output.fmt(vs['decode_tok_s'], '.1f')} vs {output.fmt(vs['reference_decode_tok_s'], '.1f')} "
                         f"tok/s, {output.fmt(vs['decode_ratio'])}x); TTFT {output.fmt(vs['ttft_ms'], '.0f')} vs "
                         f"{output.fmt(vs['reference_ttft_ms'], '.0f')} ms ({output.fmt(vs['ttft_ratio'])}x)", soft_wrap=True)
    for line in outcome.notes:
        output.out.print(f"note: {line}", soft_wrap=True)
    output.out.print(f"result: {winner.location or '-'}/result.json", soft_wrap=True)
    output.out.print(f"reproduce: {outcome.command}", soft_wrap=True)
    if outcome.weights_dir:
        output.out.print(f"weights: {outcome.weights_dir} (load with --model {outcome.weights_dir})", soft_wrap=True)


def goodput_cell(value: float | None, baseline: float | None) -> str:
    return f"{output.fmt(value)} ({output.fmt(baseline)})" if value is not None else "-"


def ratio_cell(value: float | None, ci: list[float] | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else " (no interval)")


@opt.measuring_command(limit=4, max_new_tokens=64, min_duration=2.0)
def tune(
    opts: opt.MeasureOptions,
    max_ppl_delta: MaxPplDelta = 5.0,
    max_bleu_drift: MaxBleuDrift = 1.0,
    require_lossless: RequireLossless = False,
    objective: Objective = "decode",
    budget_minutes: BudgetMinutes = 20.0,
    methods: Methods = None,
    reference: Reference = True,
    compile: Compile = True,
    executor: xo.Executor = "local",
    ray_address: xo.RayAddress = None,
    rate: Rate = None,
    slo_ttft_ms: opt.SloTtft = None,
    slo_tpot_ms: opt.SloTpot = None,
    engine: Engine = None,
) -> None:
    """Search the configurations the techniques offer (and their stacks) for the fastest one within the
    drift budget, on this machine; print the winner, its numbers and how to reproduce it.

    Example: infer-tune tune --model smollm2-135m --max-ppl-delta 5 --objective decode --budget-minutes 20

    Example: infer-tune tune --model smollm2-135m --objective goodput --rate 1 --slo-ttft-ms 5000 --slo-tpot-ms 500

    Goodput: requests per second that meet every SLO (TTFT from the request's arrival, queueing included,
    at most --slo-ttft-ms, default 5000; TPOT at most --slo-tpot-ms, default 500) over the replay of a
    seeded Poisson trace at --rate (default 1 req/s, one request per prompt). The candidates are the
    batched stacks (a quantize method within the budgets + continuous batching on the slot engine, 4 and
    8 slots); the baseline serves the same trace one request at a time, first come first served, from
    its own times measured in the same rounds. The winner's goodput ratio must exceed 1 with its whole
    95% interval (one ratio per round).

    Kernels are timed on the model's own shapes first, interleaved with fp32; a method whose 95%
    interval says slower than fp32 here is pruned; the survivors are measured against the baseline in
    one run (each a saved result in --out), and a method that may win has its stacks (with the lean
    decode path) measured right after it; llama.cpp at its best is a reference row when built (the
    fastest of Q4_0 / Q4_K_M / Q8_0 made from the same checkpoint, by llama-bench here). --json prints
    {"winner": <result document>, "tried": [...], ...}.
    """
    from infer_tune.cli.measure import run_spec
    from infer_tune.scenarios.tune import check_serving, run_tune
    from infer_tune.scenarios.tune_plan import OBJECTIVES, TuneSpec, tune_methods

    if budget_minutes <= 0:
        raise ConfigError(f"--budget-minutes must be > 0, got {budget_minutes}")
    if max_ppl_delta < 0:
        raise ConfigError(f"--max-ppl-delta must be >= 0 (percent), got {max_ppl_delta}")
    if max_bleu_drift < 0:
        raise ConfigError(f"--max-bleu-drift must be >= 0 (BLEU points lost), got {max_bleu_drift}")
    if engine is not None:
        from infer_tune.cli.engine_tune import tune_engine

        return tune_engine(opts, engine, max_ppl_delta=max_ppl_delta, max_bleu_drift=max_bleu_drift,
                           objective=objective, budget_s=budget_minutes * 60)
    chosen = tuple(m.strip() for m in methods.split(",") if m.strip()) if methods else None
    if objective not in OBJECTIVES:
        raise ConfigError(f"--objective must be {', '.join(OBJECTIVES[:-1])} or {OBJECTIVES[-1]}, got '{objective}'")
    known = tune_methods()  # what the registry's entries answer to (tuners/base.py `Tuning.methods`)
    if chosen is not None and set(chosen) - set(known):
        raise ConfigError(f"--methods: unknown {', '.join(sorted(set(chosen) - set(known)))}; "
                          f"choose from {', '.join(known)}")
    serving = {"--rate": rate, "--slo-ttft-ms": slo_ttft_ms, "--slo-tpot-ms": slo_tpot_ms}
    for flag, value in serving.items():
        if value is not None and not 0 < value < float("inf"):
            unit = "requests/s" if flag == "--rate" else "milliseconds"
            raise ConfigError(f"{flag} must be a finite number of {unit} > 0, got {value}")
        if value is not None and objective != "goodput":
            raise ConfigError(f"{flag} applies to --objective goodput, not {objective}")
    given = {"rate": rate, "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms}
    spec = TuneSpec(max_ppl_delta=max_ppl_delta, max_bleu_drift=max_bleu_drift, require_lossless=require_lossless,
                    objective=objective, budget_s=budget_minutes * 60, reference=reference, compile=compile,
                    methods=chosen, seed=opts.seed, **{k: v for k, v in given.items() if v is not None})
    measured = run_spec(opts)
    check_serving(measured, spec, remote=executor != "local")  # before anything loads, starts or is written
    with xo.scope(executor, ray_address, opts.device), output.progress_bar(not opts.json_out, out_dir=opts.out) as progress:
        outcome = run_tune(measured, spec, progress=progress)
    if opts.json_out:
        output.print_json(outcome.to_dict())
        return
    render(outcome)
