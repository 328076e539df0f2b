"""Library backends: optimum-quanto (installed) and torchao (optional extra `infer-tune[torchao]`).

On CUDA these are the right kernels; on this project's CPU they measured slower than fp32 (quanto w8
6.5 tok/s, torchao int8 weight-only 7.6, int8-dynamic 7.3, vs fp32 15.5 on SmolLM2-135M), which is
why `--backend auto` picks the torch kernels on CPU. quanto method mapping: int8-dynamic -> qint8
weights (quanto has no per-call activation quantization, so this is weight-only), int8-static -> qint8
weights + qint8 activations calibrated with `quanto.Calibration`, int4-weight -> qint4 with quanto's
HQQ optimizer, int4-rtn -> qint4 with its max (round-to-nearest) optimizer.
"""

from __future__ import annotations

import torch
from torch import nn

from infer_tune.tuners.quantize.calibrate import Progress
from infer_tune.tuners.quantize.config import QuantizeConfig


@torch.no_grad()
def quantize_quanto(model: nn.Module, config: QuantizeConfig, targets: list[str],
                    calib: list[torch.Tensor] | None = None, progress: Progress | None = None) -> dict:
    """Quantize the targeted Linears with optimum-quanto and freeze the weights."""
    from optimum.quanto import Calibration, HqqOptimizer, MaxOptimizer, freeze, qint4, qint8, quantize

    if config.method == "int8-static":
        quantize(model, weights=qint8, activations=qint8, include=targets)
        with Calibration():
            for i, ids in enumerate(calib or []):
                model(input_ids=ids, use_cache=False)
                if progress:
                    progress("calibrating", i + 1, len(calib))
    elif config.method == "int8-dynamic":
        quantize(model, weights=qint8, include=targets)
    else:
        optimizer = HqqOptimizer() if config.method == "int4-weight" else MaxOptimizer()
        quantize(model, weights=qint4, include=targets, optimizer=optimizer)
    freeze(model)
    return {"layers": {name: config.method for name in targets},
            "note": "quanto chooses its own int4 group size (128 where it divides the layer)"}


@torch.no_grad()
def quantize_torchao(model: nn.Module, config: QuantizeConfig, targets: list[str]) -> dict:
    """Quantize the targeted Linears with torchao's `quantize_` (int8 dynamic or int4 weight-only)."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, quantize_

    wanted = set(targets)
    ao_config = (Int8DynamicActivationInt8WeightConfig() if config.method == "int8-dynamic"
                 else Int4WeightOnlyConfig(group_size=config.group_size, **int4_tinygemm_options(Int4WeightOnlyConfig)))
    quantize_(model, ao_config, filter_fn=lambda module, fqn: fqn in wanted)
    return {"layers": {name: config.method for name in targets},
            "note": "torchao tensors serialize only with pickle; measured in memory, not saved or reloaded"}


def int4_tinygemm_options(config_class: type) -> dict:
    """Keyword arguments that make torchao's int4 weight-only config pack for torch's own int4 kernel
    (tinygemm, `aten._weight_int4pack_mm`). torchao's second config version defaults to a plain packing
    whose matmul lives in a separate kernel package (mslk) that a plain `pip install torchao` lacks; the
    first version (no `int4_packing_format` argument) packs for tinygemm already."""
    import inspect

    if "int4_packing_format" in inspect.signature(config_class).parameters:
        return {"int4_packing_format": "tile_packed_to_4d"}
    return {}
