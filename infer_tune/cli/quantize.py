"""`infer-tune quantize`: calibrate, apply, save, reload and measure against the baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.cli.measure import render_result

Method = Annotated[str, typer.Option("--method", help="bf16, int8-dynamic, int8-static, int4-weight or int4-rtn.")]
Sweep = Annotated[str | None, typer.Option("--sweep", help="Comma-separated methods, one result each "
                                                            "(e.g. int8-dynamic,int8-static,int4-weight).")]
Backend = Annotated[str, typer.Option("--backend", help="auto (fastest measured for the device), torch, quanto, torchao.")]
CalibSuite = Annotated[str, typer.Option("--calib-suite", help="Suite whose activations calibrate int8-static.")]
CalibSamples = Annotated[int, typer.Option("--calib-samples", help="Calibration prompts (int8-static).")]
Alpha = Annotated[float, typer.Option("--alpha", help="SmoothQuant migration strength for int8-static, 0..1.")]
GroupSize = Annotated[int, typer.Option("--group-size", help="Weights per 4-bit group (int4-*); must divide in_features.")]
HeadBits = Annotated[int, typer.Option("--head-bits", help="int4 methods: embedding table and head in 8 bits "
                                                           "(default: 4 bits cost most there) or 4.")]
Activations = Annotated[str, typer.Option("--activations", help="int4 methods: what the weights multiply: bf16 "
                                                                "(torch's int4 kernel) or int8 (per block of 32, the "
                                                                "project's w4a8 kernel; lossy on top of the weights).")]
ComputeDtype = Annotated[str, typer.Option("--compute-dtype", help="Activations between quantized layers: float32 "
                                                                   "or bfloat16 (faster only with native bf16).")]
Save = Annotated[Path | None, typer.Option("--save", help="Where the quantized model goes (a sweep writes DIR/<method>); "
                                                          "default: a temporary folder, deleted at the end.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace an existing --save folder.")]


def kernel_names(chosen) -> str:
    """{kind: kernel} of a regime -> "w4a8 (int4-a8), w8a8 (int8-a8)"; one kind: its kernel alone."""
    if not isinstance(chosen, dict):
        return str(chosen)
    if len(chosen) == 1:
        return str(next(iter(chosen.values())))
    return ", ".join(f"{kernel} ({kind})" for kind, kernel in chosen.items())


def render_claim(claim: dict) -> None:
    verdict = "held" if claim["held"] else "did not hold here"
    output.out.print(
        f"claim check ({claim['method']}): size {output.fmt(claim['bytes_ratio_vs_16bit'], '.0%')} of 16-bit "
        f"({'ok' if claim['size_held'] else 'no'}), speed {output.fmt(claim['speedup_judged'])}x vs "
        f"{'bf16' if claim['speedup_vs_16bit'] is not None else 'baseline'} "
        f"({'ok' if claim['speed_held'] else 'no'}), ppl {output.fmt(claim['ppl_delta_pct'], '+.2f')}% / BLEU drift "
        f"{output.fmt(claim['bleu_drift'], '+.2f')} ({'ok' if claim['quality_held'] else 'no'}) -> {verdict}")


@opt.measuring_command()
def quantize(
    opts: opt.MeasureOptions,
    method: Method = "int8-dynamic",
    sweep: Sweep = None,
    backend: Backend = "auto",
    calib_suite: CalibSuite = "chat",
    calib_samples: CalibSamples = 16,
    alpha: Alpha = 0.5,
    group_size: GroupSize = 32,
    head_bits: HeadBits = 8,
    activations: Activations = "bf16",
    compute_dtype: ComputeDtype = "float32",
    save: Save = None,
    overwrite: Overwrite = False,
) -> None:
    """Calibrate, quantize, save, reload and measure each method against the baseline of the same workload.

    Example: infer-tune quantize --method int8-dynamic --save ./smollm2-int8 --limit 4 --max-new-tokens 32
    int8 activations: infer-tune quantize --method int4-rtn --activations int8
    Sweep:   infer-tune quantize --sweep bf16,int8-dynamic,int8-static,int4-weight,int4-rtn --out runs/q

    A sweep measures bf16 first when it is swept (the 16-bit reference of the INT8 claim check).
    """
    from infer_tune.cli.measure import run_spec
    from infer_tune.scenarios.quantize import run_quantize
    from infer_tune.tuners.quantize import QuantizeConfig, parse_sweep

    methods = parse_sweep(sweep) if sweep else [method]
    configs = [QuantizeConfig(method=m, backend=backend, alpha=alpha, group_size=group_size, calib_suite=calib_suite,
                              calib_samples=calib_samples, head_bits=head_bits if m.startswith("int4") else 8,
                              activations=activations if m.startswith("int4") else "bf16",
                              compute_dtype=compute_dtype) for m in methods]
    with output.progress_bar(not opts.json_out, out_dir=opts.out) as progress:
        outcome = run_quantize(run_spec(opts), configs, save=save, overwrite=overwrite, progress=progress)
    if opts.json_out:
        output.print_json(outcome.docs[0] if len(outcome.docs) == 1 else outcome.docs)
        return
    for doc in outcome.docs:
        render_result(doc, doc.location)
        m = doc.metrics
        output.out.print(f"  {'quantized':<22} {doc['config']['method']} via {m.get('backend_resolved')}, "
                         f"{m.get('quantized_layers')} layers, {output.fmt(m.get('bytes_ratio_vs_16bit'), '.0%')} "
                         f"of 16-bit bytes, saved to {m.get('save_dir') if outcome.saved else '(temporary)'}")
        chosen = m.get("kernels") or {}
        if chosen.get("decode"):
            rng = chosen.get("activation_range")
            output.out.print(f"  {'kernels (measured)':<22} decode {kernel_names(chosen['decode']['chosen'])} "
                             f"({output.fmt(chosen['decode']['speedup_vs_fp32'])}x fp32), prefill "
                             f"{kernel_names(chosen['prefill']['chosen'])} "
                             f"({output.fmt(chosen['prefill']['speedup_vs_fp32'])}x fp32)"
                             + (f"; activations 0..{rng['qmax']} ({rng['why']})" if rng else ""), soft_wrap=True)
    if outcome.claim is not None:
        render_claim(outcome.claim)
