"""Apply a `QuantizeConfig` to a model with torch's low-bit CPU kernels (the `torch` backend).

Targets: every plain `nn.Linear` of the decoder (attention and MLP projections; a Linear subclass
may do more than a matmul and is kept in float). The input embedding and
the output head are not "targeted" Linears, but they are stored low-bit too: in small models they
are a large share of the weights (21% of SmolLM2-135M, one tensor since it ties them), so leaving
them in float would keep "INT8 halves memory" from ever holding. Int8 methods store them int8 per
row; int4 methods too by default (`head_bits: 8`: the head is the layer whose error shows most in
perplexity), or int4 per group (`head_bits: 4`). A tied head is rebuilt from the embedding's tensors
at load time and stores nothing itself. The head always runs dynamic int8 or int4 weights (no
static activation scale: its input is the final norm, calibrated by nothing else). Embeddings, heads
and norms are wrapped, never replaced by a generic module (wrap.py says why and how).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from infer_tune.errors import ConfigError
from infer_tune.nn_utils import set_module
from infer_tune.tuners.quantize import calibrate, wrap
from infer_tune.tuners.quantize.config import QuantizeConfig
from infer_tune.tuners.quantize.modules import (
    Int4A8Linear,
    Int4Linear,
    Int8A8Linear,
    Int8DynamicLinear,
    Int8StaticLinear,
    int8_per_channel,
    int8_per_tensor,
    pack_nibbles,
)


def targeted_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every plain nn.Linear except the output head, by qualified name (subclasses stay float)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: m for name, m in model.named_modules() if type(m) is nn.Linear and m is not head}


def skipped_linears(model: nn.Module) -> list[str]:
    """Linear subclasses left in float (their forward may do more than x @ W.T + b)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and type(m) is not nn.Linear]


def check_quantizable(model: nn.Module, config: QuantizeConfig) -> dict[str, nn.Linear]:
    """Fail with one clear line before any work: no Linear layers, or a group size that does not divide."""
    targets = targeted_linears(model)
    if not targets:
        raise ConfigError(f"model {type(model).__name__} has no nn.Linear layers to quantize")
    if config.method.startswith("int4"):
        layers = dict(targets)
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if isinstance(emb, nn.Embedding) and config.head_bits == 4:  # the table is int4 groups too
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
        return int4_class(config)(t["qweight_int4"], t["scale"], t["zero"], config.group_size, bias), {}
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


def fold_smoothing_into_norms(model: nn.Module, stats: dict[str, calibrate.ActStats], fed_by: dict[str, str],
                              alpha: float) -> tuple[dict[int, torch.Tensor], dict]:
    """Fold each group's shared 1/s into the norm observed to feed it (costs nothing at run time).

    `fed_by` maps a projection to the norm whose output it reads as is (observed during calibration,
    wrap.NormWiring). Returns ({id(linear): s} for the projections whose input is now pre-divided,
    a summary); the others keep an explicit `smooth_inv` vector (o_proj, down_proj: no norm feeds
    them; or a norm whose fold did not verify).
    """
    groups: dict[str, list[str]] = {}
    for linear, norm in fed_by.items():
        if linear in stats:
            groups.setdefault(norm, []).append(linear)
    folded: dict[int, torch.Tensor] = {}
    summary = {"folded_norms": 0, "unfoldable_norms": []}
    for norm_name, linear_names in groups.items():
        norm = model.get_submodule(norm_name)
        projs = [model.get_submodule(n) for n in linear_names]
        act_absmax = torch.stack([stats[n].absmax for n in linear_names]).amax(0)
        w_absmax = torch.cat([p.weight.detach().float() for p in projs]).abs().amax(0)
        s = calibrate.smoothing_factors(act_absmax, w_absmax[None, :], alpha)
        if not wrap.fold_scale_into_norm(norm, s):
            summary["unfoldable_norms"].append(norm_name)
            continue
        summary["folded_norms"] += 1
        for proj in projs:
            folded[id(proj)] = s
    return folded, summary


def quantize_embeddings_and_head(model: nn.Module, config: QuantizeConfig) -> dict:
    """Store the input embedding low-bit (wrapped: its own forward still runs) and make a plain Linear
    head a low-bit Linear (sharing the embedding's tensors when tied)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    info: dict = {}
    int4 = config.head_bits == 4  # (an int4 method: QuantizeConfig checks it)
    if isinstance(emb, nn.Embedding) and not wrap.is_wrapped(emb):
        if int4:
            tensors = int4_quantize(emb.weight, config.group_size, hqq=config.method == "int4-weight")
        else:
            q, scale = int8_per_channel(emb.weight)
            tensors = {"qweight": q, "weight_scale": scale}
        tied = head is not None and getattr(head, "weight", None) is emb.weight
        original = copy.deepcopy(emb)
        wrap.wrap_embedding(emb, tensors, config.group_size if int4 else None)
        error = wrap.verify_embedding(original, emb)
        if not error <= wrap.MAX_EMBEDDING_REL_ERROR:  # e.g. a forward that bypasses the lookup it inherits
            model.set_input_embeddings(original)
            if tied:
                head.weight = original.weight
            info["embedding"] = {"bits": None, "kept_float": f"{type(original).__name__} did not match its "
                                 f"quantized wrap on probe ids (relative error {error:.3g})"}
        else:
            info["embedding"] = {"bits": 4 if int4 else 8, "tied_head": tied, "class": type(original).__name__,
                                 "probe_rel_error": error}
            if tied and type(head) is nn.Linear:
                model.set_output_embeddings(build_head(tensors, config, tied=True))
                kind = int4_class(config).kind if int4 else int8_head_class(config, emb.embedding_dim).kind
                info["head"] = {"kind": kind, "tied": True}
                return info
            if tied:
                raise ConfigError(f"the output head ({type(head).__name__}) is tied to the embedding but is not a "
                                  "plain Linear; it cannot share the quantized table")
    if type(head) is nn.Linear:
        if not int4 and int8_head_class(config, head.in_features) is Int8A8Linear:
            bias = head.bias.detach().float() if head.bias is not None else None
            module = Int8A8Linear(*int8_per_channel(head.weight), bias)
        else:
            fake = QuantizeConfig(method=config.method if int4 else "int8-dynamic", group_size=config.group_size,
                                  head_bits=config.head_bits, activations=config.activations if int4 else "bf16")
            module, _ = quantize_linear(head, fake)
        model.set_output_embeddings(module)
        info["head"] = {"kind": type(module).kind, "tied": False}
    elif head is not None:
        info["head"] = {"kind": None, "kept_float": f"{type(head).__name__} is not a plain Linear"}
    return info


def int4_class(config: QuantizeConfig) -> type:
    """The int4 Linear of a config: int8 activations (Int4A8Linear) or bf16 ones (Int4Linear)."""
    return Int4A8Linear if config.activations == "int8" else Int4Linear


def int8_head_class(config: QuantizeConfig, in_features: int) -> type:
    """The int8 head of a config: int8 activations per block of 32 (Int8A8Linear) where the config asks for them
    and the width allows, else fbgemm's dynamic int8 (Int8DynamicLinear)."""
    return Int8A8Linear if config.activations == "int8" and in_features % 32 == 0 else Int8DynamicLinear


def build_head(tensors: dict[str, torch.Tensor], config: QuantizeConfig, *, tied: bool) -> nn.Module:
    """The output head from portable tensors (the embedding's own when tied)."""
    if "qweight_int4" in tensors or "qweight_w4a8" in tensors:  # the w4a8 layout: a saved Int4A8Linear's
        head = int4_class(config).from_portable(tensors, group_size=config.group_size)
    else:
        in_features = tensors["qweight"].shape[1] if "qweight" in tensors else tensors["qweight_w8a8"].shape[1] * 32
        head = int8_head_class(config, in_features).from_portable(tensors)
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
    stats, fed_by, fold_summary = None, {}, {}
    if config.calibrated:
        if not calib:
            raise ConfigError("int8-static needs calibration prompts; give a calib_suite and calib_samples >= 1")
        wiring = wrap.NormWiring(model, targets)
        stats = calibrate.collect_activation_stats(model, targets, calib, progress, wiring=wiring,
                                                   keep_rows=ERROR_SAMPLE_ROWS)
        fed_by = wiring.fed_by
    folded = {}
    if stats:
        folded, fold_summary = fold_smoothing_into_norms(model, stats, fed_by, config.alpha)
    layers, scales, fallbacks = {}, {}, {}
    for i, (name, layer) in enumerate(targets.items()):
        module, summary = quantize_linear(layer, config, stats[name] if stats else None, folded_smoothing=folded)
        if isinstance(module, Int8StaticLinear) and stats[name].samples is not None:
            module, judged = static_or_dynamic(layer, module, stats[name].samples, folded.get(id(layer)))
            summary.update(judged)
            if isinstance(module, Int8DynamicLinear) and not isinstance(module, Int8StaticLinear):
                fallbacks[name] = judged
        set_module(model, name, module)
        layers[name] = type(module).kind
        if summary:
            scales[name] = summary
        if progress:
            progress("quantizing", i + 1, len(targets))
    summary = {"layers": layers, "group_size": config.group_size if config.method.startswith("int4") else None,
               "kept_float": skipped_linears(model), **fold_summary}
    summary.update(quantize_embeddings_and_head(model, config))
    if scales:
        summary["activation_scales"] = scales
        summary["alpha"] = config.alpha
    if config.calibrated:
        summary["dynamic_fallback_layers"] = sorted(fallbacks)
        summary["static_error_budget"] = STATIC_ERROR_BUDGET
    summary["compute_dtype"] = apply_compute_dtype(model, config)
    return summary


# need no activations (no whole-model forward): built from a skeleton, each layer filled and converted in turn
LAYERWISE_METHODS = ("bf16", "int8-dynamic", "int4-weight", "int4-rtn")


def builds_layer_by_layer(config, device: str) -> bool:
    """Whether `config` is a quantize config this module builds layer by layer on `device` (a model too large to
    load whole: a method of LAYERWISE_METHODS on the torch backend)."""
    from infer_tune.tuners.quantize.config import resolve_backend

    return isinstance(config, QuantizeConfig) and config.method in LAYERWISE_METHODS \
        and resolve_backend(config, device) == "torch"


@torch.no_grad()
def quantize_layerwise(model: nn.Module, fill, config: QuantizeConfig,
                       progress: calibrate.Progress | None = None) -> dict:
    """What `quantize_model` makes of a whole float model, built from a skeleton one Linear at a time.

    `model` holds its matrices on the meta device (weights.skeleton); `fill(module)` materialises the
    meta parameters of `module` (weights.Filler: random or from safetensors shards). Each targeted
    Linear is filled, quantized and its float copy dropped before the next one is made, so peak memory
    is the quantized model plus one float Linear plus the float embedding and head (quantized last),
    never a full float copy. Same tensors in, same quantized model out as the eager path (tested).
    """
    from infer_tune.weights import release_freed_memory

    if config.method not in LAYERWISE_METHODS:
        raise ConfigError(f"method {config.method} cannot be built layer by layer (it needs the whole model)")
    if config.method == "bf16":
        return bf16_layerwise(model, fill, progress)
    targets = check_quantizable(model, config)
    names, layers = list(targets), {}
    for i, name in enumerate(names):
        layer = targets.pop(name)  # the module's last reference but the model's and this name's
        fill(layer)
        module, _ = quantize_linear(layer, config)
        set_module(model, name, module)
        del layer  # the float Linear is no longer referenced: freed here
        release_freed_memory()
        layers[name] = type(module).kind
        if progress:
            progress("quantizing", i + 1, len(names))
    fill(model)  # what is left: embeddings, head, norms
    summary = {"layers": layers, "group_size": config.group_size if config.method.startswith("int4") else None,
               "kept_float": skipped_linears(model)}
    summary.update(quantize_embeddings_and_head(model, config))
    release_freed_memory()
    summary["compute_dtype"] = apply_compute_dtype(model, config)
    return summary


@torch.no_grad()
def bf16_layerwise(model: nn.Module, fill, progress: calibrate.Progress | None = None) -> dict:
    """What `quantize_model` makes of a float model with method bf16 (`model.to(torch.bfloat16)`), from a
    skeleton: each module holding meta parameters filled in float32 and converted before the next one is
    made (a tied tensor stays one Parameter: `to` converts it in place), then the rest (buffers) converted."""
    from infer_tune.weights import release_freed_memory

    leaves = [m for m in model.modules() if any(p.is_meta for p in m.parameters(recurse=False))]
    for i, module in enumerate(leaves):
        fill(module)
        module.to(torch.bfloat16)
        release_freed_memory()
        if progress:
            progress("converting", i + 1, len(leaves))
    fill(model)
    model.to(torch.bfloat16)
    return {"dtype": "bfloat16"}


def apply_compute_dtype(model: nn.Module, config: QuantizeConfig) -> str:
    """Float parameters (norms, a float head, biases) and thus the activations in `config.compute_dtype`;
    the quantized layers keep their low-bit tensors and return what they are given."""
    if config.compute_dtype == "bfloat16":
        model.to(torch.bfloat16)
    return config.compute_dtype


ERROR_SAMPLE_ROWS = 256  # calibration rows kept per layer to judge its static error
# A layer runs with a static activation scale when its output error on the calibration rows is at most
# this many times the error of per-token dynamic activations; beyond, it runs per-token dynamic. On
# SmolLM2 the down_proj inputs carry token outliers that one fixed 7-bit grid (hosts that saturate)
# cannot hold: static-everywhere measured +44% perplexity there, +12% with the full 8-bit range.
# On an AVX-512 VNNI host (full 8-bit range) a budget of 2.0 gave +16.28% perplexity, 1.5 gave +10.11%
# and 1.2 +9.56%, at the same decode speed (TPOT p50 13.39 / 13.13 / 13.00 ms; 4 chat prompts).
STATIC_ERROR_BUDGET = 1.5


@torch.no_grad()
def static_or_dynamic(layer: nn.Linear, static: Int8StaticLinear, samples: torch.Tensor,
                      folded: torch.Tensor | None) -> tuple[nn.Module, dict]:
    """Keep `static` unless its error on the calibration rows exceeds STATIC_ERROR_BUDGET x per-token dynamic's.

    `folded`: the smoothing vector already divided into the feeding norm (the layer then receives x / s,
    so the dynamic alternative quantizes W * s).
    """
    reference = layer(samples)
    x = samples / folded if folded is not None else samples
    weight = layer.weight.detach().float() * folded[None, :] if folded is not None else layer.weight
    bias = layer.bias.detach().float() if layer.bias is not None else None
    dynamic = Int8DynamicLinear(*int8_per_channel(weight), bias)
    errors = {}
    for label, module, kernel in (("static", static, "dequant"), ("dynamic", dynamic, "int_mm")):
        module.set_kernels(kernel, kernel)  # the numerics of each path, whatever kernel runs later
        errors[label] = float((module(x) - reference).norm() / reference.norm().clamp(min=1e-12))
    static.set_kernels(type(static).decode_kernel, type(static).prefill_kernel)
    dynamic.set_kernels(type(dynamic).decode_kernel, type(dynamic).prefill_kernel)
    judged = {"static_rel_error": errors["static"], "dynamic_rel_error": errors["dynamic"]}
    if errors["static"] > STATIC_ERROR_BUDGET * errors["dynamic"]:
        return dynamic, judged
    return static, judged
