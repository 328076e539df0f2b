"""`infer-tune quantize`: calibrate, apply, save, reload and measure against the baseline."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from infer_tune.cli import options as opt
from infer_tune.cli import output
from infer_tune.cli.bench import render_result
from infer_tune.cli.common import handle_errors, resolve_device, setup_threads
from infer_tune.errors import ConfigError

Method = Annotated[str, typer.Option("--method", help="bf16, int8-dynamic, int8-static, int4-weight or int4-rtn.")]
Sweep = Annotated[str | None, typer.Option("--sweep", help="Comma-separated methods, one result each "
                                                            "(e.g. int8-dynamic,int8-static,int4-weight).")]
Backend = Annotated[str, typer.Option("--backend", help="auto (fastest measured for the device), torch, quanto, torchao.")]
CalibSuite = Annotated[str, typer.Option("--calib-suite", help="Suite whose activations calibrate int8-static.")]
CalibSamples = Annotated[int, typer.Option("--calib-samples", help="Calibration prompts (int8-static).")]
Alpha = Annotated[float, typer.Option("--alpha", help="SmoothQuant migration strength for int8-static, 0..1.")]
GroupSize = Annotated[int, typer.Option("--group-size", help="Weights per 4-bit group (int4-*); must divide in_features.")]
Save = Annotated[Path | None, typer.Option("--save", help="Where the quantized model goes (a sweep writes DIR/<method>); "
                                                          "default: a temporary folder, deleted at the end.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace an existing --save folder.")]


def save_targets(save: Path | None, methods: list[str], overwrite: bool) -> dict[str, Path] | None:
    """Where each method's checkpoint goes; refuses existing folders unless --overwrite (checked up front)."""
    if save is None:
        return None
    targets = {m: (save / m if len(methods) > 1 else save) for m in methods}
    for target in targets.values():
        if target.exists() and not overwrite:
            raise ConfigError(f"--save folder {target} already exists; pass --overwrite to replace it")
        if target.exists() and not (target / "quantization.json").is_file() and any(target.iterdir()):
            raise ConfigError(f"--save folder {target} holds something that is not a quantized model; "
                              "refusing to overwrite it")
    return targets


def render_claim(claim: dict) -> None:
    verdict = "held" if claim["held"] else "did not hold here"
    output.out.print(
        f"claim check ({claim['method']}): size {output.fmt(claim['bytes_ratio_vs_16bit'], '.0%')} of 16-bit "
        f"({'ok' if claim['size_held'] else 'no'}), speed {output.fmt(claim['speedup_judged'])}x vs "
        f"{'bf16' if claim['speedup_vs_16bit'] is not None else 'baseline'} "
        f"({'ok' if claim['speed_held'] else 'no'}), ppl {output.fmt(claim['ppl_delta_pct'], '+.2f')}% / BLEU drift "
        f"{output.fmt(claim['bleu_drift'], '+.2f')} ({'ok' if claim['quality_held'] else 'no'}) -> {verdict}")


@handle_errors
def quantize(
    model: opt.Model = "smollm2-135m",
    method: Method = "int8-dynamic",
    sweep: Sweep = None,
    backend: Backend = "auto",
    calib_suite: CalibSuite = "chat",
    calib_samples: CalibSamples = 16,
    alpha: Alpha = 0.5,
    group_size: GroupSize = 32,
    save: Save = None,
    overwrite: Overwrite = False,
    suite: opt.Suite = "chat",
    limit: opt.Limit = 8,
    max_new_tokens: opt.MaxNewTokens = 64,
    threads: opt.Threads = None,
    seed: opt.Seed = 0,
    warmup: opt.Warmup = 1,
    min_iterations: opt.MinIterations = 2,
    min_duration: opt.MinDuration = 5.0,
    out: opt.Out = Path("runs"),
    device: opt.Device = "cpu",
    ppl: opt.Ppl = True,
    resume: opt.Resume = False,
    json_out: opt.Json = False,
    debug: opt.Debug = False,
) -> None:
    """Calibrate, quantize, save, reload and measure each method against the baseline of the same workload.

    Example: infer-tune quantize --method int8-dynamic --save ./smollm2-int8 --limit 4 --max-new-tokens 32
    Sweep:   infer-tune quantize --sweep bf16,int8-dynamic,int8-static,int4-weight,int4-rtn --out runs/q
    """
    from infer_tune import atomic, models
    from infer_tune import env as envinfo
    from infer_tune.runners import Protocol
    from infer_tune.session import prepare_inputs, run_configs
    from infer_tune.tuners.quantize import QuantizeConfig, parse_sweep, resolve_backend
    from infer_tune.tuners.quantize.apply import check_quantizable
    from infer_tune.tuners.quantize.calibrate import calibration_batches
    from infer_tune.tuners.quantize.pipeline import claim_check, make_prepare
    from infer_tune.workload import Workload

    methods = parse_sweep(sweep) if sweep else [method]
    configs = [QuantizeConfig(method=m, backend=backend, alpha=alpha, group_size=group_size, calib_suite=calib_suite,
                              calib_samples=calib_samples) for m in methods]
    device = resolve_device(device)
    # record the backend that really runs (auto -> measured-fast choice for this device)
    configs = [dataclasses.replace(c, backend=resolve_backend(c, device)) for c in configs]
    targets = save_targets(save, methods, overwrite)
    workload = Workload(suite=suite, limit=limit, seed=seed, max_new_tokens=max_new_tokens)
    protocol = Protocol(warmup=warmup, min_iterations=min_iterations, min_duration_s=min_duration)
    n_threads = setup_threads(threads)
    loaded = models.load(model, device=device)
    for config in configs:  # every bad input fails here, before any result or checkpoint is written
        check_quantizable(loaded.model, config)
    calib = (calibration_batches(loaded.tokenizer, calib_suite, calib_samples)
             if any(c.calibrated for c in configs) else None)
    inputs = prepare_inputs(loaded, workload)
    env = envinfo.collect_env(n_threads)
    with tempfile.TemporaryDirectory(prefix="infer-tune-quantized-") as scratch:
        where = targets or {m: Path(scratch) / m for m in methods}
        with output.progress_bar(not json_out) as progress:
            prepare = make_prepare(save_dir=lambda c: where[c.method], calib=calib, device=device, progress=progress)
            baseline, docs = run_configs(loaded, inputs, workload, protocol, configs, env=env, out_dir=out,
                                         device=device, resume=resume, measure_ppl=ppl, progress=progress,
                                         prepare=prepare)
    claim = claim_check(docs)
    if claim is not None:
        doc = next(d for d in docs if d["run_id"] == claim["run_id"])
        doc["metrics"]["claim_check"] = claim
        atomic.write_json(Path(doc["_path"]) / "result.json", {k: v for k, v in doc.items() if k != "_path"})
    if json_out:
        output.print_json(docs[0] if len(docs) == 1 else docs)
        return
    for doc in docs:
        render_result(doc, doc.get("_path"))
        m = doc["metrics"]
        output.out.print(f"  {'quantized':<22} {doc['config']['method']} via {m.get('backend_resolved')}, "
                         f"{m.get('quantized_layers')} layers, {output.fmt(m.get('bytes_ratio_vs_16bit'), '.0%')} "
                         f"of 16-bit bytes, saved to {m.get('save_dir') if targets else '(temporary)'}")
    if claim is not None:
        render_claim(claim)
