"""Low-bit quantization: bf16, int8 dynamic / static (SmoothQuant), int4 weight-only (HQQ or round-to-nearest).

One path, whoever asks (`infer-tune quantize` or a recipe): the registry entry quantizes a copy of
the loaded model, saves it (safetensors + quantization.json, no pickle), reloads it, and the runner
measures the reloaded model, so a result vouches for the saved checkpoint. `models.load` reads a
saved directory back through the loader registered here.
"""

from __future__ import annotations

import dataclasses

from infer_tune import models
from infer_tune.tuners.base import MeasuredRow, RunContext, Tuning, register_technique
from infer_tune.tuners.quantize import pipeline, serialize, tune
from infer_tune.tuners.quantize.config import BACKENDS, METHODS, QuantizeConfig, parse_sweep, resolve_backend
from infer_tune.tuners.quantize.report import report_columns

__all__ = ["BACKENDS", "METHODS", "QuantizeConfig", "parse_sweep", "resolve_backend"]

models.register_directory_loader(serialize.MANIFEST, serialize.load_quantized)


def _resolve(config: QuantizeConfig, ctx: RunContext) -> QuantizeConfig:
    """Record the backend that really runs (`auto` -> the measured-fast choice for the device)."""
    return dataclasses.replace(config, backend=resolve_backend(config, ctx.device))


def _finish(row: MeasuredRow) -> None:
    """The INT8 claim judged against a 16-bit row measured earlier in the sweep, and the TTFT note."""
    pipeline.annotate_claim(row.doc, row.earlier)


# the metrics a quantize row carries beyond the core (its namespace: metrics/schema.py)
METRIC_KEYS = {
    **dict.fromkeys(("backend_resolved", "built", "quantize_s", "quantized_layers", "reloaded", "save_dir",
                     "saved_bytes_on_disk"), "how the quantized model was built, saved and reloaded"),
    "bytes_ratio_vs_16bit": "stored bytes over the same model's 16-bit bytes", "model_bytes_16bit": "its 16-bit bytes",
    "kernels": "the kernels timed and chosen per shape (kernel_choice)",
    "ttft_note": "why TTFT is far over the baseline's (its measured prefill kernels)",
}
register_technique(QuantizeConfig, resolve=_resolve, finish=_finish, metric_keys=METRIC_KEYS,
                   preflight=pipeline.preflight, phase=0, report_columns=report_columns,
                   tune=Tuning(offer=tune.offer, methods=tune.TUNE_METHODS))(pipeline.prepare_quantized)
