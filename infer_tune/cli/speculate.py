"""`infer-tune speculate`: pair draft sources with the target, sweep K, measure acceptance and speedup;
`infer-tune speculate distill`: train a self-draft on the target's own greedy outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.engines.base import LEAN, TORCH, spelled
from infer_tune.errors import ConfigError

app = typer.Typer(invoke_without_command=True, no_args_is_help=False)

Draft = Annotated[list[str] | None, typer.Option("--draft", help="A draft model (alias, HF id, checkpoint dir, "
                                                 ".gguf); repeatable. Another tokenizer goes through transformers' "
                                                 "universal assisted generation.")]
SelfDraftLayers = Annotated[list[int] | None, typer.Option("--self-draft-layers", help="Self-draft from the target's "
                                                           "first N layers (+ its embeddings and head); repeatable.")]
EarlyExit = Annotated[list[int] | None, typer.Option("--early-exit", help="transformers' assistant_early_exit after "
                                                     "N layers (hf engine); repeatable.")]
PromptLookup = Annotated[bool, typer.Option("--prompt-lookup", help="n-gram prompt lookup (no draft model).")]
NumDraftTokens = Annotated[str, typer.Option("--num-draft-tokens", "-k", help="Comma-separated draft lengths K "
                                                                              "(tokens proposed per verify pass).")]
Engine = Annotated[str, typer.Option("--engine", help="hf (transformers' assisted generation), lean (infer-tune's "
                                                      "own loop), or hf,lean for both.")]
DraftVocab = Annotated[int | None, typer.Option("--draft-vocab", help="Lean engine, a draft from `speculate distill`: "
                                                                      "keep only the N tokens the target emitted most "
                                                                      "(+ the prompt's) in the draft's output head.")]
NgramSize = Annotated[int | None, typer.Option("--max-matching-ngram-size", help="Prompt lookup: longest n-gram "
                                                                                "matched (default 2).")]


def parse_engines(text: str) -> list[str]:
    from infer_tune.engines.base import config_engine

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"--engine must be hf, lean or hf,lean; got '{text}'")
    return list(dict.fromkeys(config_engine(n, technique="speculate", where="--engine")
                              for n in names))


def draft_sources(draft: list[str] | None, self_draft_layers: list[int] | None, early_exit: list[int] | None,
                  prompt_lookup: bool) -> list[str]:
    """The flags as `SpeculateConfig.draft` strings, with the flags' own range checks."""
    for flag, values in (("--self-draft-layers", self_draft_layers), ("--early-exit", early_exit)):
        bad = [v for v in values or [] if v < 1]
        if bad:
            raise ConfigError(f"{flag} must be a layer count >= 1, got {bad[0]}")
    sources = list(draft or [])
    sources += [f"self-draft:{n}" for n in self_draft_layers or []]
    sources += [f"early-exit:{n}" for n in early_exit or []]
    if prompt_lookup:
        sources.append("prompt-lookup")
    if not sources:
        raise ConfigError("give at least one draft source: --draft MODEL, --self-draft-layers N, --early-exit N "
                          "or --prompt-lookup")
    return sources


@app.callback(invoke_without_command=True)
@opt.measuring_command(suite="code,code-edit,chat", ppl=False)
def speculate(
    opts: opt.MeasureOptions,
    ctx: typer.Context,
    draft: Draft = None,
    self_draft_layers: SelfDraftLayers = None,
    early_exit: EarlyExit = None,
    prompt_lookup: PromptLookup = False,
    num_draft_tokens: NumDraftTokens = "2,4,6,8,10",
    engine: Engine = spelled(TORCH, "speculate"),
    max_matching_ngram_size: NgramSize = None,
    draft_vocab: DraftVocab = None,
) -> None:
    """Measure every (draft source, K) against the target alone, per suite (--suite takes a comma-separated list):
    acceptance rate, mean acceptance length, acceptance per draft position (plotted), target forward passes,
    where a verify round's time goes, TTFT / TPOT / tok/s and the speedup; outputs must equal the target's.

    Examples:
      infer-tune speculate --prompt-lookup --self-draft-layers 4 -k 2,4,8 --suite code,code-edit,chat
      infer-tune speculate --draft ./drafts/smollm2-135m-self-draft4 -k 4 --engine hf,lean
      infer-tune speculate distill --self-draft-layers 4 --minutes 8

    Exit 1 when any output differs from the target alone (greedy speculative decoding must be lossless).
    """
    if ctx.invoked_subcommand is not None:  # `speculate distill ...`
        return
    from infer_tune.cli.measure import run_spec
    from infer_tune.scenarios import speculate as scen
    from infer_tune.tuners.speculate import parse_draft_lengths
    from infer_tune.tuners.speculate.claim import render_claim

    if opts.batch_size != 1:
        raise ConfigError(f"--batch-size {opts.batch_size}: speculative decoding runs one request at a time "
                          "(transformers' assisted generation and the lean loop are batch size 1); drop --batch-size")
    if draft_vocab is not None and (draft_vocab < 1 or spelled(LEAN, "speculate") not in parse_engines(engine) or not draft):
        raise ConfigError(f"--draft-vocab {draft_vocab}: give N >= 1, with --engine lean and a --draft model made "
                          "by `speculate distill`")
    if max_matching_ngram_size is not None and max_matching_ngram_size < 1:
        raise ConfigError(f"--max-matching-ngram-size must be >= 1, got {max_matching_ngram_size}")
    try:
        lengths = parse_draft_lengths(num_draft_tokens)
    except ConfigError:
        raise ConfigError(f"--num-draft-tokens must be comma-separated integers >= 1, got '{num_draft_tokens}'") from None
    sweep = scen.SpeculateSweep(drafts=draft_sources(draft, self_draft_layers, early_exit, prompt_lookup),
                                draft_lengths=lengths, suites=[s.strip() for s in opts.suite.split(",") if s.strip()],
                                engines=parse_engines(engine), max_matching_ngram_size=max_matching_ngram_size,
                                draft_vocab=draft_vocab)
    sweep.configs()  # every config validated before anything loads
    with output.progress_bar(not opts.json_out, out_dir=opts.out) as progress:
        outcome = scen.run_speculate(run_spec(opts, measure_ppl=False), sweep, progress=progress)
    if opts.json_out:
        output.print_json({"results": [d for s in outcome.suites for d in s.docs],
                           "baselines": [s.baseline for s in outcome.suites],
                           "recommendations": outcome.recommendations, "claim": outcome.claim,
                           "warnings": outcome.warnings, "mismatched": [d["label"] for d in outcome.mismatched]})
    else:
        for suite in outcome.suites:
            render_suite(suite)
        for rec in outcome.recommendations:
            output.out.print(f"recommendation ({rec['suite']}): {render_recommendation(rec)}", soft_wrap=True)
        if outcome.claim is not None:
            output.out.print(f"claim check: {render_claim(outcome.claim)}", soft_wrap=True)
    for warning in outcome.warnings:
        output.note(f"warning: {warning}")
    if outcome.mismatched:
        rows = ", ".join(f"{d['label']} on {d['workload']['suite']} ({d.metrics['output_mismatches']})"
                         for d in outcome.mismatched)
        output.error(f"speculative output differs from the target alone (must be identical under greedy): {rows}")
        raise typer.Exit(1)


def _pct(value) -> str:
    return output.fmt(value, ".0%")


def render_suite(suite) -> None:
    """One table per suite: the target alone, then a row per (draft, K, engine)."""
    base = suite.baseline.metrics
    wl = suite.baseline["workload"]
    table = Table(title=f"speculate · {suite.baseline['model']['ref']} · {suite.suite} ({wl['prompts']} prompts x "
                        f"{wl['max_new_tokens']} tokens, batch 1, greedy)")
    for col in ("draft-K", "accept", "len", "tok/pass", "accept by position", "TTFT ms", "TPOT ms", "tok/s",
                "speedup", "ms/round draft/verify/other", "output"):
        table.add_column(col, justify="left" if col in ("draft-K", "accept by position", "output") else "right")
    table.add_row("target alone", "-", "-", "1.00", "-", output.fmt(base["ttft_ms"]["p50"], ".1f"),
                  output.fmt(base["tpot_ms"]["p50"], ".1f"), output.fmt(base["output_throughput_tok_s"], ".1f"),
                  "1.00x", "-", "reference")
    for doc in suite.docs:
        m = doc.metrics
        curve = ",".join(f"{v:.2f}" for v in (m.get("acceptance_by_position") or [])[:8])
        rounds = "/".join(output.fmt(m.get(k), ".1f") for k in ("draft_ms_per_round", "verify_ms_per_round",
                                                                "overhead_ms_per_round"))
        mismatch = m.get("output_mismatches")
        table.add_row(doc["label"], _pct(m.get("acceptance_rate")), output.fmt(m.get("mean_acceptance_length")),
                      output.fmt(m.get("tokens_per_target_pass")), curve or "-", output.fmt(m["ttft_ms"]["p50"], ".1f"),
                      output.fmt(m["tpot_ms"]["p50"], ".1f"), output.fmt(m["output_throughput_tok_s"], ".1f"),
                      f"{output.fmt(m.get('speedup_vs_baseline'))}x", rounds,
                      "identical" if mismatch == 0 else Text.from_markup(f"[bold red]MISMATCH ({mismatch})[/]"))
    output.out.print(table)
    if suite.docs and suite.docs[0].location:
        output.out.print(f"  acceptance per position plotted in each result's acceptance.png; results: "
                         f"{Path(suite.docs[0].location).parent}/", soft_wrap=True)


def render_recommendation(rec: dict) -> str:
    if rec["best"] is None:
        best = (f" (best {rec['best_label']}: {output.fmt(rec['best_speedup'])}x, under the "
                f"{rec['threshold']:.2f}x bar)" if rec.get("best_label") else "")
        return f"{rec['verdict']}{best}"
    return (f"{rec['verdict']}: {output.fmt(rec['best_speedup'])}x decode, {output.fmt(rec['throughput_ratio'])}x "
            f"tok/s, acceptance {_pct(rec['acceptance_rate'])}, {output.fmt(rec['mean_acceptance_length'])} "
            "tokens per verify pass")


Minutes = Annotated[float, typer.Option("--minutes", help="Wall-clock budget: generating the target's outputs "
                                                          "(up to 40%) and training (the rest).")]
Layers = Annotated[int, typer.Option("--self-draft-layers", help="Layers of the self-draft (the target's first N).")]
Save = Annotated[Path | None, typer.Option("--save", help="Where the draft goes (default drafts/<model>-self-draft<N>); "
                                                          "use it as --draft DIR.")]
Holdout = Annotated[int, typer.Option("--holdout", help="The first N prompts of each suite (in --seed order) are never "
                                                        "trained on: a measurement with --limit <= N stays unseen.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace an existing --save folder.")]
DistillSuites = Annotated[str, typer.Option("--suite", "-s", help="Comma-separated suites whose prompts the target "
                                                                  "answers for training.")]


@app.command("distill")
def distill(
    model: opt.Model = "smollm2-135m",
    self_draft_layers: Layers = 4,
    minutes: Minutes = 8.0,
    suite: DistillSuites = "code,code-edit,chat",
    save: Save = None,
    holdout: Holdout = 16,
    max_new_tokens: opt.MaxNewTokens = 64,
    seed: opt.Seed = 0,
    threads: opt.Threads = None,
    lang: opt.Lang = "en",
    chat_template: opt.ChatTemplate = True,
    max_prompt_tokens: opt.MaxPromptTokens = 512,
    dtype: opt.Dtype = "auto",
    device: opt.Device = "cpu",
    overwrite: Overwrite = False,
    json_out: opt.Json = False,
    debug: opt.Debug = False,
) -> None:
    """Fine-tune a self-draft (the target's first N layers) on the target's own greedy outputs.

    Training prompts come from --suite without each suite's first --holdout prompts, so a later
    `speculate --limit <= holdout` measures on prompts the draft never saw (the result says how many
    measured prompts it did see: draft_train_overlap). Saved as a model directory for --draft.

    Example: infer-tune speculate distill --self-draft-layers 4 --minutes 8 --save drafts/smol-self4
    Then:    infer-tune speculate --draft drafts/smol-self4 -k 2,4,8 --suite code,chat
    """
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.scenarios.speculate import DistillSpec, run_distill
    from infer_tune.workload import Protocol, Workload

    for flag, value, low in (("--minutes", minutes, 0.0), ("--self-draft-layers", self_draft_layers, 0),
                             ("--max-new-tokens", max_new_tokens, 0)):
        if not value > low or value == float("inf"):
            raise ConfigError(f"{flag} must be > {low:g}, got {value}")
    if holdout < 0:
        raise ConfigError(f"--holdout must be >= 0, got {holdout}")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    suites = [s.strip() for s in suite.split(",") if s.strip()]
    target = save or Path("drafts") / f"{Path(model).name.removesuffix('.gguf')}-self-draft{self_draft_layers}"
    spec = RunSpec(model=model, workload=Workload(suite=suites[0] if suites else "code", seed=seed, lang=lang,
                                                  chat_template=chat_template, max_prompt_tokens=max_prompt_tokens),
                   protocol=Protocol(), threads=threads, device=device, dtype=dtype, measure_ppl=False)
    with distill_bar(not json_out) as progress:
        outcome = run_distill(spec, DistillSpec(layers=self_draft_layers, minutes=minutes, save=target, suites=suites,
                                                holdout=holdout, max_new_tokens=max_new_tokens, overwrite=overwrite),
                              progress)
    if json_out:
        output.print_json({"save_dir": str(outcome.save_dir), **outcome.manifest})
        return
    m = outcome.manifest
    output.out.print(f"self-draft ({m['layers']} of the target's layers) distilled on {m['samples']} target outputs "
                     f"from {', '.join(m['suites'])} in {m['elapsed_s'] / 60:.1f} min: {m['steps']} steps, "
                     f"{m['epochs']} epoch(s), loss {m['loss_first']:.3f} -> {m['loss_last']:.3f}", soft_wrap=True)
    output.out.print(f"held out: the first {m['holdout_per_suite']} prompts of each suite (seed {m['seed']}); "
                     f"saved to {outcome.save_dir} (use --draft {outcome.save_dir})", soft_wrap=True)


def distill_bar(enabled: bool):
    """A progress bar with the loss and the time left (stage, done, total, info)."""
    from contextlib import contextmanager

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    @contextmanager
    def bar():
        if not enabled or not output.err.is_terminal:
            with output.progress_bar(enabled) as lines:  # a log: heartbeat lines while it trains
                yield lines
            return
        columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        with Progress(*columns, console=output.err, transient=True) as progress:
            tasks: dict[str, int] = {}

            def update(stage: str, done: float, total: float | None, info: dict | None = None) -> None:
                text = " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in (info or {}).items())
                if stage not in tasks:
                    tasks[stage] = progress.add_task(stage, total=total, info=text)
                progress.update(tasks[stage], completed=done, total=total, info=text)

            yield update

    return bar()
