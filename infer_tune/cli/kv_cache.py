"""`infer-tune kv-cache`: cache variants, per-position latency, KV memory and the cache claims."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.document import ResultDocument
from infer_tune.errors import ConfigError
from infer_tune.tuners.kv_cache import IMPLS

Impl = Annotated[str, typer.Option("--impl", help="Comma-separated variants: none (use_cache=False), dynamic, "
                                                  "static, quantized, offloaded (GPU only).")]
ContextLengths = Annotated[str, typer.Option("--context-lengths", help="Comma-separated prompt lengths in tokens "
                                                                       "(real suite text cut to exactly N tokens).")]
KvBits = Annotated[int, typer.Option("--kv-bits", help="Bits per cached value for `quantized` (quanto: 2 or 4; "
                                                      "fp8: 8; hqq: 1, 2, 3, 4, 8).")]
KvBackend = Annotated[str, typer.Option("--kv-backend", help="Quantized-cache backend: quanto, fp8 or hqq.")]
Compile = Annotated[bool, typer.Option("--compile", help="torch.compile the static variant (compile time reported "
                                                        "apart as compile_s, never timed).")]
ModelConfig = Annotated[str | None, typer.Option("--model-config", help="Only compute KV memory from a config.json, "
                                                                        "a folder with one, or a HF id (no weights).")]
Context = Annotated[int, typer.Option("--context", help="Context length in tokens for --model-config.")]


def parse_impls(text: str) -> list[str]:
    """`none,dynamic,...` -> list; unknown names raise ConfigError."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if unknown or not names:
        raise ConfigError(f"--impl: unknown '{','.join(unknown) or text}'; choose from {', '.join(IMPLS)}")
    return list(dict.fromkeys(names))


def parse_context_lengths(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ConfigError(f"--context-lengths must be comma-separated integers, got '{text}'") from None
    if not values or values[0] < 1:
        raise ConfigError(f"--context-lengths must be integers >= 1, got '{text}'")
    return values


@opt.measuring_command(max_new_tokens=256)
def kv_cache(
    opts: opt.MeasureOptions,
    impl: Impl = "none,dynamic,static,quantized,offloaded",
    context_lengths: ContextLengths = "128,512,1024",
    kv_bits: KvBits = 4,
    kv_backend: KvBackend = "quanto",
    compile_static: Compile = False,
    model_config: ModelConfig = None,
    context: Context = 131072,
) -> None:
    """Compare no cache, dynamic, static, quantized and offloaded KV caches: per-token latency vs position,
    TTFT/TPOT, measured and analytic KV bytes, FLOPs with and without the cache, drift vs dynamic.

    Each context length runs one prompt of exactly that many tokens of --suite text, at batch size 1;
    perplexity is not measured (a cache does not change a teacher-forced pass).

    Examples:
      infer-tune kv-cache --impl none,dynamic,static --context-lengths 128,512 --max-new-tokens 64
      infer-tune kv-cache --impl dynamic,quantized --kv-bits 2 --context-lengths 1024
      infer-tune kv-cache --model-config ./Llama-3.1-8B/config.json --context 131072
    """
    from infer_tune.metrics import kv

    if model_config is not None:
        return _config_only(kv, model_config, context, opts.json_out)

    from infer_tune.cli.measure import run_spec
    from infer_tune.scenarios import kv_cache as kvs

    for flag, name, value in (("--limit", "limit", opts.limit), ("--batch-size", "batch_size", opts.batch_size)):
        if name in opts.explicit and value != 1:
            raise ConfigError(f"{flag} {value}: kv-cache measures one prompt of exactly N tokens per context "
                              "length at batch size 1; set the lengths with --context-lengths")
    sweep_spec = kvs.KVSweepSpec(impls=parse_impls(impl), context_lengths=parse_context_lengths(context_lengths),
                                 max_new_tokens=opts.max_new_tokens, kv_bits=kv_bits, kv_backend=kv_backend,
                                 compile=compile_static, suite=opts.suite, seed=opts.seed)
    with output.progress_bar(not opts.json_out, out_dir=opts.out) as progress:
        sweep = kvs.run_kv_cache(run_spec(opts, measure_ppl=False), sweep_spec, progress=progress)
    if opts.json_out:
        output.print_json({"results": sweep.docs, "not_applicable": sweep.not_applicable, "claims": sweep.claims})
        return
    render_sweep(sweep.docs, sweep.not_applicable)
    for line in kv.claim_lines(sweep.claims):
        output.out.print(f"claim: {line}")
    for run_dir in sweep.run_dirs:
        output.out.print(f"  result {run_dir}/result.json")


def _config_only(kv, ref: str, context: int, json_out: bool) -> None:
    from infer_tune.errors import ConfigError

    if context < 1:
        raise ConfigError(f"--context must be >= 1, got {context}")
    shape = kv.load_model_config(ref)
    sizes = kv.kv_bytes_by_dtype(shape, context)
    claim = kv.long_context_claim(shape, context)
    if json_out:
        output.print_json({"model_config": ref, "context_tokens": context, "shape": shape.to_dict(),
                           "kv_bytes_by_dtype": sizes, "claims": [claim]})
        return
    table = Table(title=f"KV cache of {ref} at {context} tokens (batch 1; {shape.layers} layers x "
                        f"{shape.kv_heads} kv heads x {shape.head_dim} head dim)")
    table.add_column("KV dtype")
    table.add_column("bytes", justify="right")
    table.add_column("size", justify="right")
    for name, size in sizes.items():
        table.add_row(name, str(size), output.fmt_bytes(size))
    output.out.print(table)
    if shape.max_positions and context > shape.max_positions:
        output.note(f"note: {context} tokens is beyond the model's max_position_embeddings ({shape.max_positions})")
    output.out.print("quantized sizes exclude scales/zero-points (about 1 bit per value at group size 64)")
    for line in kv.claim_lines([claim]):
        output.out.print(f"claim: {line}")


def render_sweep(docs: list[ResultDocument], not_applicable: list[dict]) -> None:
    """One table per context length: a row per variant."""
    by_ctx: dict[int, list[dict]] = {}
    for doc in docs:
        by_ctx.setdefault(doc.metrics["prompt_tokens"], []).append(doc)
    for ctx, group in by_ctx.items():
        first = group[0]
        table = Table(title=f"kv-cache · {first['model']['ref']} · {ctx}-token prompt + "
                            f"{first['workload']['max_new_tokens']} new tokens")
        for col in ("impl", "TTFT ms", "TPOT ms", "e2e s", "step ms first/last", "KV measured (analytic)",
                    "GFLOP", "vs dynamic"):
            table.add_column(col, justify="left" if col in ("impl", "vs dynamic") else "right")
        for doc in group:
            m = doc.metrics
            curve = m["per_position_ms"]
            steps = f"{output.fmt(curve[0], '.1f')} / {output.fmt(curve[-1], '.1f')}" if curve else "-"
            name = doc["config"]["impl"] + (f" {doc['config']['kv_backend']} {doc['config']['kv_bits']}-bit"
                                            if doc["config"]["impl"] == "quantized" else "")
            if m.get("compile_s") is not None:
                name += f" +compile ({m['compile_s']:.0f} s{'' if m.get('compiled') else ', did not compile'})"
            table.add_row(name, output.fmt(m["ttft_ms"]["p50"], ".1f"), output.fmt(m["tpot_ms"]["p50"], ".1f"),
                          output.fmt(m["e2e_ms"]["p50"] / 1000), steps,
                          f"{output.fmt_bytes(m['kv_cache_bytes'])} ({output.fmt_bytes(m['kv_cache_bytes_analytic'])})",
                          f"{m['flops_executed'] / 1e9:.3g}", _drift(m))
        output.out.print(table)
        ref = next((d.metrics for d in group if d["config"]["impl"] == "dynamic"), group[0].metrics)
        output.out.print(
            f"  logits: largest logits tensor {output.fmt_bytes(ref['logits_bytes_peak'])} "
            f"({'last token only (generate uses logits_to_keep=1)' if ref['logits_last_token_only'] else 'all positions'}"
            f"; full prefill logits would be {output.fmt_bytes(ref['logits_bytes_full_prefill'])}) = "
            f"{output.fmt(ref['logits_share_of_peak_rss'], '.2%')} of peak RSS "
            f"{output.fmt_bytes(ref['peak_rss_bytes'])}; KV cache {output.fmt(ref['kv_share_of_peak_rss'], '.1%')}")
    for row in not_applicable:
        if row["context_tokens"] == min(by_ctx, default=row["context_tokens"]):
            output.out.print(f"  {row['impl']}: not applicable here: {row['reason']}")


def _drift(m: dict) -> str:
    if m["impl"] == "dynamic":
        return "reference"
    if m.get("identical_to_dynamic"):
        return "identical"
    first = m.get("first_divergence_token")
    where = f"diverges at token {first:.0f}" if first is not None else "differs"
    return where + (" (LOSSLESS VARIANT DIFFERS)" if m.get("lossless_expected") else "")
