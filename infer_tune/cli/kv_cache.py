"""`infer-tune kv-cache`: cache variants, per-position latency, KV memory and the cache claims."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.cli.common import handle_errors, resolve_device, setup_threads

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


@handle_errors
def kv_cache(
    model: opt.Model = "smollm2-135m",
    impl: Impl = "none,dynamic,static,quantized,offloaded",
    context_lengths: ContextLengths = "128,512,1024",
    max_new_tokens: opt.MaxNewTokens = 256,
    kv_bits: KvBits = 4,
    kv_backend: KvBackend = "quanto",
    compile_static: Compile = False,
    model_config: ModelConfig = None,
    context: Context = 131072,
    suite: opt.Suite = "chat",
    threads: opt.Threads = None,
    seed: opt.Seed = 0,
    warmup: opt.Warmup = 1,
    min_iterations: opt.MinIterations = 2,
    min_duration: opt.MinDuration = 5.0,
    out: opt.Out = Path("runs"),
    resume: opt.Resume = False,
    dtype: opt.Dtype = "auto",
    device: opt.Device = "cpu",
    json_out: opt.Json = False,
    debug: opt.Debug = False,
) -> None:
    """Compare no cache, dynamic, static, quantized and offloaded KV caches: per-token latency vs position,
    TTFT/TPOT, measured and analytic KV bytes, FLOPs with and without the cache, drift vs dynamic.

    Examples:
      infer-tune kv-cache --impl none,dynamic,static --context-lengths 128,512 --max-new-tokens 64
      infer-tune kv-cache --impl dynamic,quantized --kv-bits 2 --context-lengths 1024
      infer-tune kv-cache --model-config ./Llama-3.1-8B/config.json --context 131072
    """
    from infer_tune.metrics import kv

    if model_config is not None:
        return _config_only(kv, model_config, context, json_out)

    from infer_tune import env as envinfo
    from infer_tune import models
    from infer_tune.runners import Protocol
    from infer_tune.tuners import kv_cache as kvc

    spec = kvc.KVSweepSpec(impls=kvc.parse_impls(impl), context_lengths=kvc.parse_context_lengths(context_lengths),
                           max_new_tokens=max_new_tokens, kv_bits=kv_bits, kv_backend=kv_backend,
                           compile=compile_static, suite=suite, seed=seed)
    protocol = Protocol(warmup=warmup, min_iterations=min_iterations, min_duration_s=min_duration)
    shape = kv.load_model_config(models.resolve(model))  # fail on a too-long context before loading weights
    kvc.check_context_fits(shape, spec.context_lengths, max_new_tokens, model)
    n_threads = setup_threads(threads)
    device = resolve_device(device)
    loaded = models.load(model, dtype=dtype, device=device)
    env = envinfo.collect_env(n_threads)
    with output.progress_bar(not json_out) as progress:
        sweep = kvc.run_kv_sweep(loaded, spec, protocol, env=env, out_dir=out, device=device, resume=resume,
                                 progress=progress)
    if json_out:
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


def render_sweep(docs: list[dict], not_applicable: list[dict]) -> None:
    """One table per context length: a row per variant."""
    by_ctx: dict[int, list[dict]] = {}
    for doc in docs:
        by_ctx.setdefault(doc["metrics"]["prompt_tokens"], []).append(doc)
    for ctx, group in by_ctx.items():
        first = group[0]
        table = Table(title=f"kv-cache · {first['model']['ref']} · {ctx}-token prompt + "
                            f"{first['workload']['max_new_tokens']} new tokens")
        for col in ("impl", "TTFT ms", "TPOT ms", "e2e s", "step ms first/last", "KV measured (analytic)",
                    "GFLOP", "vs dynamic"):
            table.add_column(col, justify="left" if col in ("impl", "vs dynamic") else "right")
        for doc in group:
            m = doc["metrics"]
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
        ref = next((d["metrics"] for d in group if d["config"]["impl"] == "dynamic"), group[0]["metrics"])
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
