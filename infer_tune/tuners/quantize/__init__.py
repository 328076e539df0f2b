"""Low-bit quantization: bf16, int8 dynamic / static (SmoothQuant), int4 weight-only (HQQ or round-to-nearest).

`apply(loaded, QuantizeConfig(...))` (the registry entry) quantizes a copy of the model in memory;
`pipeline.make_prepare` adds save -> reload for the `quantize` command; `serialize.load_quantized`
reads a saved directory back (and `models.load` calls it for directories with quantization.json).
"""

from __future__ import annotations

import copy
from dataclasses import replace

from infer_tune.models import LoadedModel
from infer_tune.runners.prepared import PreparedModel
from infer_tune.tuners.base import register_tuner
from infer_tune.tuners.quantize.config import BACKENDS, METHODS, QuantizeConfig, parse_sweep, resolve_backend

__all__ = ["BACKENDS", "METHODS", "QuantizeConfig", "apply_quantize", "parse_sweep", "resolve_backend"]


@register_tuner(QuantizeConfig)
def apply_quantize(loaded: LoadedModel, config: QuantizeConfig) -> PreparedModel:
    """Quantize a copy of `loaded.model` in memory (int8-static calibrates on `config.calib_suite`)."""
    from infer_tune.tuners.quantize.calibrate import calibration_batches
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    model = copy.deepcopy(loaded.model)
    calib = (calibration_batches(loaded.tokenizer, config.calib_suite, config.calib_samples)
             if config.calibrated else None)
    backend = resolve_backend(config, "cpu")
    summary = quantize_in_memory(model, config, backend, calib)
    return PreparedModel(model=model, tokenizer=loaded.tokenizer, label=replace(config, backend=backend).label(),
                         metrics={"backend_resolved": backend, "quantized_layers": len(summary.get("layers", {}))})
