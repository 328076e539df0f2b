"""Quantize -> save -> reload (the technique's `prepare`), its preflight checks, and the INT8 claim check.

The measured model is always the one reloaded from disk, so a result vouches for the saved checkpoint.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from infer_tune import models
from infer_tune.document import ResultDocument, as_document
from infer_tune.metrics import deltas
from infer_tune.runners.prepared import PreparedModel
from infer_tune.tuners.base import RunContext
from infer_tune.tuners.quantize import apply as torch_backend
from infer_tune.tuners.quantize import library, serialize
from infer_tune.tuners.quantize.calibrate import Progress, calibration_batches
from infer_tune.tuners.quantize.config import QuantizeConfig, resolve_backend

# The claim usually made for INT8 (docs/architecture.md, "Claims"), as thresholds (what "held" means here).
INT8_CLAIM = "INT8 halves weight memory vs 16-bit, decodes 2-3x faster, quality loss < 1% (BLEU drift ~0.7)"
CLAIM_MAX_BYTES_RATIO = 0.55  # "halves": at most 55% of the 16-bit bytes
CLAIM_MIN_SPEEDUP = 2.0
CLAIM_MAX_PPL_DELTA_PCT = 1.0
CLAIM_MIN_BLEU_DRIFT = -1.0


def bytes_16bit(model: torch.nn.Module) -> int:
    """Bytes of the model with every floating tensor stored in 16 bits (shared tensors once)."""
    return models.model_bytes(model, float_bytes=2)


def quantize_in_memory(model: torch.nn.Module, config: QuantizeConfig, backend: str,
                       calib: list[torch.Tensor] | None = None, progress: Progress | None = None) -> dict:
    """Quantize `model` in place with `backend`; returns the summary that goes into quantization.json."""
    if backend == "torch":
        return torch_backend.quantize_model(model, config, calib, progress)
    targets = list(torch_backend.check_quantizable(model, config))
    if backend == "quanto":
        return library.quantize_quanto(model, config, targets, calib, progress)
    return library.quantize_torchao(model, config, targets)


def calibration_for(loaded: models.LoadedModel, config: QuantizeConfig, ctx: RunContext) -> list[torch.Tensor] | None:
    """Calibration batches of `config` (int8-static), computed once per run for each (suite, samples)."""
    if not config.calibrated:
        return None
    key = ("quantize-calibration", config.calib_suite, config.calib_samples)
    if key not in ctx.cache:
        ctx.cache[key] = calibration_batches(loaded.tokenizer, config.calib_suite, config.calib_samples)
    return ctx.cache[key]


def preflight(loaded: models.LoadedModel, config: QuantizeConfig, ctx: RunContext) -> None:
    """Fail before any measurement: nothing to quantize, a group size that does not divide, no calibration text."""
    torch_backend.check_quantizable(loaded.model, config)
    calibration_for(loaded, config, ctx)


def prepare_quantized(loaded: models.LoadedModel, config: QuantizeConfig, ctx: RunContext) -> PreparedModel:
    """Quantize a copy of the loaded model, save it to `ctx.artifact_dir(config)`, return the reloaded model."""
    device = ctx.device
    backend = resolve_backend(config, device)
    started = time.perf_counter()
    if layerwise(loaded, config, backend):
        model, summary = build_layerwise(loaded, config, ctx)
    else:
        model = copy.deepcopy(loaded.model)
        summary = quantize_in_memory(model, config, backend, calibration_for(loaded, config, ctx), ctx.progress)
    quantize_s = time.perf_counter() - started
    facts = {"backend_resolved": backend, "quantize_s": quantize_s,
             "model_bytes_16bit": bytes_16bit(loaded.model), "reloaded": backend != "torchao",
             "built": "layer by layer" if layerwise(loaded, config, backend) else "from a copy of the loaded model"}
    if backend != "torchao":
        target = ctx.artifact_dir(config)
        manifest = {"method": config.method, "backend": backend, "config": _config_fields(config),
                    "source_model": loaded.ref, "summary": summary}
        serialize.save_quantized(model, loaded.tokenizer, target, manifest)
        del model
        model = serialize.load_quantized(target, choose_kernels=False).to(device)
        facts["save_dir"] = str(target)
        facts["saved_bytes_on_disk"] = sum(f.stat().st_size for f in Path(target).iterdir() if f.is_file())
    if backend == "torch" and config.method != "bf16":
        facts["kernels"] = model.infer_tune_kernels = choose_kernels(model, config, ctx)
    facts["quantized_layers"] = len(summary.get("layers", {}))
    facts["bytes_ratio_vs_16bit"] = models.model_bytes(model) / facts["model_bytes_16bit"]
    return PreparedModel(model=model, tokenizer=loaded.tokenizer, metrics=facts, label=config.label(), device=device)


def layerwise(loaded: models.LoadedModel, config: QuantizeConfig, backend: str) -> bool:
    """Build the quantized model layer by layer (no float copy) when its weights can be made again tensor by
    tensor (random weights: weights.py) and the method needs no activations."""
    return (loaded.weights is not None and backend == "torch"
            and config.method in torch_backend.LAYERWISE_METHODS)


def build_layerwise(loaded: models.LoadedModel, config: QuantizeConfig, ctx: RunContext) -> tuple[torch.nn.Module, dict]:
    """The quantized model made from a skeleton, one Linear filled, quantized and dropped at a time."""
    from infer_tune import weights

    model = loaded.weights.skeleton()
    summary = torch_backend.quantize_layerwise(model, weights.Filler(model, loaded.weights.values()), config,
                                               ctx.progress)
    return model.eval(), summary


def choose_kernels(model: torch.nn.Module, config: QuantizeConfig, ctx: RunContext) -> dict:
    """Time the method's candidate kernels on this model's shapes (once per run) and apply the fastest."""
    from infer_tune.tuners.quantize import kernel_choice

    rows = int(ctx.cache.get("prefill_rows", 64))
    shapes = tuple(sorted((kind, tuple(sorted(c.items()))) for kind, c in kernel_choice.linear_shapes(model).items()))
    timings = ctx.cache.setdefault(("quantize-kernel-timings", shapes, config.group_size, rows), {})
    if ctx.progress:
        ctx.progress("timing kernels", 0, 1)
    record = kernel_choice.choose_for_model(model, config.method, prefill_rows=rows, group_size=config.group_size,
                                      forced=config.forced_kernels(), timings=timings,
                                      activations=config.activations, keep="store")
    if ctx.progress:
        ctx.progress("timing kernels", 1, 1)
    return record


TTFT_NOTE_RATIO = 3.0  # a TTFT this many times the baseline's gets an explanation in the result


def annotate_claim(doc: ResultDocument, earlier: list[dict]) -> None:
    """An int8 result carries the INT8 claim check, judged against a bf16 run measured earlier in the sweep;
    a result whose TTFT is over TTFT_NOTE_RATIO x the baseline's says why (its measured prefill kernels)."""
    m = doc.metrics
    ttft_speedup = m.get("ttft_speedup_vs_baseline")
    if ttft_speedup is not None and ttft_speedup < 1 / TTFT_NOTE_RATIO:
        prefill = (m.get("kernels") or {}).get("prefill") or {}
        note = (f"TTFT {1 / ttft_speedup:.1f}x the baseline's: the fastest prefill kernels measured here "
                          f"({prefill.get('chosen')}) run this model's Linears at "
                          f"{output_ratio(prefill.get('speedup_vs_fp32'))} fp32 speed" if prefill else
                f"TTFT {1 / ttft_speedup:.1f}x the baseline's; no kernel choice was recorded")
        doc.add_metrics({"ttft_note": note}, source="quantize's finish")
    if doc["config"].get("method") in ("int8-dynamic", "int8-static"):
        same_sweep = [d for d in earlier if d.get("technique") == doc["technique"]]
        doc.set_sweep_metrics({"claim_check": claim_check([*same_sweep, doc], method=doc["config"]["method"])},
                              source="quantize's INT8 claim")


def output_ratio(value: float | None) -> str:
    return "an unmeasured fraction of" if value is None else f"{value:.2f}x"


def _config_fields(config: QuantizeConfig) -> dict:
    data = config.to_dict()
    data.pop("kind", None)
    return data


def claim_check(docs: list[dict], method: str | None = None) -> dict | None:
    """Check the INT8 claim on the int8 result (`method`, else int8-dynamic first): size, speed, drift -> held or not."""
    by_method = {d["config"]["method"]: as_document(d) for d in docs}  # rows made by hand (a test's) typed here
    doc = by_method.get(method) if method else (by_method.get("int8-dynamic") or by_method.get("int8-static"))
    if doc is None:
        return None
    m = doc.metrics
    ratio, speedup = m.get("bytes_ratio_vs_16bit"), m.get("speedup_vs_baseline")
    reference = "the baseline as measured (the loaded model's dtype)"
    bf16 = by_method.get("bf16")
    speedup_vs_16bit = None
    if bf16 is not None:  # the claim is against 16-bit weights: judge speed against the bf16 run when there is one
        speedup_vs_16bit = deltas.speedup(bf16.metrics, m)
        speedup, reference = speedup_vs_16bit, "the bf16 run of the same sweep (16-bit weights)"
    ppl_delta, drift = m.get("ppl_delta_pct"), m.get("bleu_drift")
    size_held = ratio is not None and ratio <= CLAIM_MAX_BYTES_RATIO
    speed_held = speedup is not None and speedup >= CLAIM_MIN_SPEEDUP
    quality_held = (ppl_delta is None or ppl_delta < CLAIM_MAX_PPL_DELTA_PCT) and \
        (drift is None or drift >= CLAIM_MIN_BLEU_DRIFT) and (ppl_delta is not None or drift is not None)
    return {
        "claim": INT8_CLAIM,
        "method": doc["config"]["method"],
        "run_id": doc["run_id"],
        "bytes_ratio_vs_16bit": ratio, "size_held": size_held,
        "speedup_vs_baseline": m.get("speedup_vs_baseline"), "speedup_vs_16bit": speedup_vs_16bit,
        "speedup_judged": speedup, "speed_held": speed_held,
        "ppl_delta_pct": ppl_delta, "bleu_drift": drift, "quality_held": quality_held,
        "held": size_held and speed_held and quality_held,
        "thresholds": {"max_bytes_ratio_vs_16bit": CLAIM_MAX_BYTES_RATIO, "min_speedup": CLAIM_MIN_SPEEDUP,
                       "max_ppl_delta_pct": CLAIM_MAX_PPL_DELTA_PCT, "min_bleu_drift": CLAIM_MIN_BLEU_DRIFT},
        "speed_reference": reference,
        "value": speedup,
        "finding": claim_finding(doc["config"]["method"], ratio, speedup, speedup_vs_16bit is not None, ppl_delta,
                                 drift),
        "why": ", ".join(part for part, held in (("size", size_held), ("speed", speed_held),
                                                 ("quality", quality_held)) if not held) + " missed"
        if not (size_held and speed_held and quality_held) else "",
    }


def claim_finding(method: str, ratio, speedup, against_bf16: bool, ppl_delta, drift) -> str:
    """What the INT8 claim check measured, in one line (the claims table shows the verdict beside it)."""
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    return (f"{method}: {f(ratio, '.0%')} of the 16-bit bytes; {f(speedup, '.2f')}x decode vs "
            f"{'bf16' if against_bf16 else 'the baseline'}; perplexity {f(ppl_delta, '+.2f')}%, "
            f"BLEU drift {f(drift, '+.2f')}")
