"""Apply a `QuantizeConfig` to a model with torch's low-bit CPU kernels (the `torch` backend).

Targets: every `nn.Linear` of the decoder (attention and MLP projections). The input embedding and
the output head are not "targeted" Linears, but they are stored low-bit too: in small models they
are a large share of the weights (21% of SmolLM2-135M, one tensor since it ties them), so leaving
them in float would keep "INT8 halves memory" from ever holding. Int8 methods store them int8 per
row; int4 methods store them int4 per group. A tied head is rebuilt from the embedding's tensors
at load time and stores nothing itself. The head always runs dynamic int8 or int4 weights (no
static activation scale: its input is the final norm, calibrated by nothing else).
"""

from __future__ import annotations

import torch
from torch import nn

from infer_tune.errors import ConfigError
from infer_tune.nn_utils import set_module
from infer_tune.tuners.quantize import calibrate
from infer_tune.tuners.quantize.config import QuantizeConfig
from infer_tune.tuners.quantize.modules import (
    Int4Linear,
    Int8DynamicLinear,
    Int8StaticLinear,
    QuantEmbedding,
    int8_per_channel,
    int8_per_tensor,
    pack_nibbles,
)


def targeted_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear except the output head, by qualified name."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def check_quantizable(model: nn.Module, config: QuantizeConfig) -> dict[str, nn.Linear]:
    """Fail with one clear line before any work: no Linear layers, or a group size that does not divide."""
    targets = targeted_linears(model)
    if not targets:
        raise ConfigError(f"model {type(model).__name__} has no nn.Linear layers to quantize")
    if config.method.startswith("int4"):
        layers = dict(targets)
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if isinstance(emb, nn.Embedding):
            layers["<embeddings>"] = nn.Linear(emb.embedding_dim, 1, bias=False, device="meta")
        for name, layer in layers.items():
            if layer.in_features % config.group_size:
                raise ConfigError(f"group_size {config.group_size} does not divide in_features "
                                  f"{layer.in_features} of layer {name}; pick a divisor (e.g. 32 or 64)")
    return targets


def int4_quantize(weight: torch.Tensor, group_size: int, *, hqq: bool) -> dict[str, torch.Tensor]:
    """Group-wise asymmetric 4-bit: w ~= (q - 8) * scale + zero, q in 0..15.

    `hqq=True` takes scale/shift from optimum-quanto's HQQ optimizer (half-quadratic search of the
    zero point that minimises an lp error, no data needed); `hqq=False` is plain round-to-nearest.
    """
    w = weight.detach().float()
    n, k = w.shape
    if hqq:
        from optimum.quanto import HqqOptimizer, qint4

        scale, shift = HqqOptimizer()(w, qtype=qint4, axis=0, group_size=group_size)  # [n*k/g, 1]
        scale, minimum = scale.view(n, k // group_size), -shift.view(n, k // group_size)
    else:
        grouped = w.view(n, k // group_size, group_size)
        minimum, maximum = grouped.amin(-1), grouped.amax(-1)
        scale = (maximum - minimum) / 15
    scale = scale.clamp(min=1e-8)
    q = torch.clamp(torch.round((w.view(n, k // group_size, group_size) - minimum[..., None]) / scale[..., None]), 0, 15)
    return {"qweight_int4": pack_nibbles(q.view(n, k)), "scale": scale, "zero": minimum + 8 * scale}


def quantize_linear(layer: nn.Linear, config: QuantizeConfig, stats: calibrate.ActStats | None = None,
                    *, per_tensor: bool = False, smooth: bool = True,
                    folded_smoothing: dict[int, torch.Tensor] | None = None) -> tuple[nn.Module, dict]:
    """One Linear -> its quantized module, plus a summary of the scales chosen."""
    bias = layer.bias.detach().float() if layer.bias is not None else None
    if config.method.startswith("int4"):
        t = int4_quantize(layer.weight, config.group_size, hqq=config.method == "int4-weight")
        return Int4Linear(t["qweight_int4"], t["scale"], t["zero"], config.group_size, bias), {}
    if config.method == "int8-dynamic":
        return Int8DynamicLinear(*int8_per_channel(layer.weight), bias), {}
    assert stats is not None, "int8-static needs activation statistics"
    folded = folded_smoothing.get(id(layer)) if folded_smoothing else None
    s = folded if folded is not None else (
        calibrate.smoothing_factors(stats.absmax, layer.weight, config.alpha) if smooth else None)
    weight = layer.weight.detach().float() * s[None, :] if s is not None else layer.weight
    q, w_scale = int8_per_tensor(weight) if per_tensor else int8_per_channel(weight)
    act_scale, act_zp = calibrate.static_act_qparams(stats, s)
    smooth_inv = None if s is None or folded is not None else 1.0 / s  # folded: the norm already divides
    module = Int8StaticLinear(q, w_scale, bias, smooth_inv, act_scale, act_zp)
    summary = {"act_scale": act_scale, "act_zero_point": act_zp}
    if s is not None:
        summary.update({"smooth_min": float(s.min()), "smooth_max": float(s.max())})
    return module, summary


# Llama-family decoder layers: a norm feeds these projections, so SmoothQuant's 1/s folds into it.
NORM_GROUPS = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
               ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))


def fold_smoothing_into_norms(model: nn.Module, stats: dict[str, calibrate.ActStats],
                              alpha: float) -> dict[int, torch.Tensor]:
    """Divide each norm's weight by the group's shared s (costs nothing at run time, stores nothing).

    Returns {id(linear): s} for the linears whose input is now pre-divided; the rest keep an
    explicit `smooth_inv` vector (o_proj, down_proj: their inputs do not come from a norm).
    """
    folded: dict[int, torch.Tensor] = {}
    for prefix, block in model.named_modules():
        for norm_name, proj_names in NORM_GROUPS:
            norm = getattr(block, norm_name, None)
            try:
                projs = {f"{prefix}.{p}": block.get_submodule(p) for p in proj_names}
            except AttributeError:
                continue
            if norm is None or getattr(norm, "weight", None) is None or not all(n in stats for n in projs):
                continue
            act_absmax = torch.stack([stats[n].absmax for n in projs]).amax(0)
            w_absmax = torch.cat([p.weight.detach().float() for p in projs.values()]).abs().amax(0)
            s = calibrate.smoothing_factors(act_absmax, w_absmax[None, :], alpha)
            norm.weight.data = (norm.weight.data.float() / s).to(norm.weight.dtype)
            for proj in projs.values():
                folded[id(proj)] = s
    return folded


def quantize_embeddings_and_head(model: nn.Module, config: QuantizeConfig) -> dict:
    """Store the input embedding low-bit and make the head a low-bit Linear (sharing it when tied)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    info: dict = {}
    if isinstance(emb, nn.Embedding):
        int4 = config.method.startswith("int4")
        if int4:
            tensors = int4_quantize(emb.weight, config.group_size, hqq=config.method == "int4-weight")
        else:
            q, scale = int8_per_channel(emb.weight)
            tensors = {"qweight": q, "weight_scale": scale}
        tied = head is not None and getattr(head, "weight", None) is emb.weight
        model.set_input_embeddings(QuantEmbedding(tensors, config.group_size if int4 else None, emb.padding_idx))
        info["embedding"] = {"bits": 4 if int4 else 8, "tied_head": tied}
        if tied:
            model.set_output_embeddings(build_head(tensors, config, tied=True))
            info["head"] = {"kind": "int4" if int4 else "int8-dynamic", "tied": True}
            return info
    if isinstance(head, nn.Linear):
        fake = QuantizeConfig(method="int8-dynamic" if config.method == "int8-static" else config.method,
                              group_size=config.group_size)
        module, _ = quantize_linear(head, fake)
        model.set_output_embeddings(module)
        info["head"] = {"kind": type(module).kind, "tied": False}
    return info


def build_head(tensors: dict[str, torch.Tensor], config: QuantizeConfig, *, tied: bool) -> nn.Module:
    """The output head from portable tensors (the embedding's own when tied)."""
    if "qweight_int4" in tensors:
        head = Int4Linear.from_portable(tensors, group_size=config.group_size)
    else:
        head = Int8DynamicLinear.from_portable(tensors)
    head.tied = tied
    return head


@torch.no_grad()
def quantize_model(model: nn.Module, config: QuantizeConfig, calib: list[torch.Tensor] | None = None,
                   progress: calibrate.Progress | None = None) -> dict:
    """Quantize `model` in place with the torch backend; returns the summary saved in quantization.json."""
    if config.method == "bf16":
        model.to(torch.bfloat16)
        return {"dtype": "bfloat16"}
    targets = check_quantizable(model, config)
    stats = None
    if config.calibrated:
        if not calib:
            raise ConfigError("int8-static needs calibration prompts; give a calib_suite and calib_samples >= 1")
        stats = calibrate.collect_activation_stats(model, targets, calib, progress)
    folded = fold_smoothing_into_norms(model, stats, config.alpha) if stats else {}
    layers, scales = {}, {}
    for i, (name, layer) in enumerate(targets.items()):
        module, summary = quantize_linear(layer, config, stats[name] if stats else None, folded_smoothing=folded)
        set_module(model, name, module)
        layers[name] = type(module).kind
        if summary:
            scales[name] = summary
        if progress:
            progress("quantizing", i + 1, len(targets))
    summary = {"layers": layers, "group_size": config.group_size if config.method.startswith("int4") else None}
    summary.update(quantize_embeddings_and_head(model, config))
    if scales:
        summary["activation_scales"] = scales
        summary["alpha"] = config.alpha
    return summary
