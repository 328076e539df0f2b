"""What every measuring command shares below its own options: the library's RunSpec from the parsed
common options, and the one-result summary table."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.document import ResultDocument


def render_result(doc: ResultDocument, run_dir: Path | str | None = None) -> None:
    """A one-result summary table (shared by every measuring command)."""
    m, w = doc.metrics, doc.workload
    table = Table(title=f"{doc.technique} · {doc.model['ref']} · {w['suite']} "
                        f"({w['prompts']} prompts x {w['max_new_tokens']} tokens)")
    table.add_column("metric")
    table.add_column("p50", justify="right")
    table.add_column("p90", justify="right")
    table.add_column("p99", justify="right")
    table.add_column("n", justify="right")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = m[key]
        table.add_row(key, output.fmt(s["p50"]), output.fmt(s["p90"]), output.fmt(s["p99"]), str(s["n"]))
    output.out.print(table)
    facts = [
        ("output throughput", f"{output.fmt(m['output_throughput_tok_s'])} tok/s"),
        ("roofline", f"{output.fmt(m.get('roofline_tok_s'), '.1f')} tok/s ceiling, "
                     + (f"fraction refused: {m['roofline_refused']}" if m.get("roofline_refused") else
                        f"achieved {output.fmt(m.get('roofline_fraction'), '.1%')}"
                        + (" [{:.1%}, {:.1%}] of each round's read".format(*m["roofline_fraction_ci95"])
                           if m.get("roofline_fraction_ci95") else ""))),
        ("peak RSS / model", f"{output.fmt_bytes(m['peak_rss_bytes'])} / {output.fmt_bytes(m['model_bytes'])}"),
    ]
    if m.get("quality"):  # random weights: quality is n/a, never a number
        facts.append(("quality", str(m["quality"])))
    else:
        facts += [("BLEU / chrF", f"{output.fmt(m.get('bleu'))} / {output.fmt(m.get('chrf'))}"),
                  ("perplexity", output.fmt(m.get("ppl")))]
    if doc["model"].get("weights") == "random":
        facts.append(("weights", f"random (seed {doc['model'].get('weights_seed')}, {doc['model'].get('architecture')}; "
                                 f"tokenizer {doc['model'].get('tokenizer')})"))
    if m.get("pass_at_1") is not None:
        facts.append(("pass@1", output.fmt(m["pass_at_1"], ".1%")))
    if m.get("broken"):
        facts.append(("verdict", f"BROKEN, not a speedup: {m.get('broken_why')}"))
    elif m.get("speedup_vs_baseline") is not None:
        facts.append(("speedup vs baseline", f"{output.fmt(m['speedup_vs_baseline'])}x decode, "
                                             f"{output.fmt(m.get('ttft_speedup_vs_baseline'))}x TTFT"))
    if m.get("speedup_vs_baseline") is not None and not m.get("quality"):
        facts.append(("drift", f"BLEU {output.fmt(m.get('bleu_drift'), '+.2f')}, exact match "
                               f"{output.fmt(m.get('exact_match_vs_baseline'), '.0%')}, ppl "
                               f"{output.fmt(m.get('ppl_delta_pct'), '+.2f')}%"))
    if m.get("verdict_evidence"):
        facts.append(("verdict evidence", str(m["verdict_evidence"])))
    noise = m.get("noise") or {}
    if noise.get("noisy"):
        facts.append(("noise", "SHAKY: " + "; ".join(noise.get("why") or [])))
    for name, value in facts:
        output.out.print(f"  {name:<22} {value}", soft_wrap=True)
    if run_dir is not None:
        output.out.print(f"  {'result':<22} {run_dir}/result.json", soft_wrap=True)




def run_spec(opts: opt.MeasureOptions, **overrides):
    """The library's RunSpec from the parsed common options."""
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.workload import Protocol, Workload

    values = dict(model=opts.model, weights=opts.weights, workload=Workload(**opts.workload_values()),
                  protocol=Protocol(**opts.protocol_values()), threads=opts.threads, device=opts.device,
                  dtype=opts.dtype, out_dir=opts.out, trust_remote_code=opts.trust_remote_code,
                  measure_ppl=opts.ppl, resume=opts.resume)
    values.update(overrides)
    return RunSpec(**values)
