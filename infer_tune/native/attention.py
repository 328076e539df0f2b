"""The native decode attention (attention.cpp) as a transformers attention implementation.

transformers' models call their attention through `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
with the cache's keys and values as they are (before any grouped-query repeat), so registering one
function covers every family that goes through that interface. `decode_attention` takes the calls it can
do exactly what SDPA would (one query per row, fp32, no dropout, no softcap, no position bias, no attention
sinks, a bool or float mask of [B, 1 or H, 1, >= L]) and hands every other call to transformers' own SDPA
function: prefill, and anything a family adds.

`attending(model)` switches a model whose attention is `sdpa` to it for the length of a `with` block: the
compiled lean step (and the slot engine's batched step) is traced inside it, so its graph holds the
native op, while the model object itself keeps SDPA for everyone else (the eager prefill, other configs
sharing the weights). Measured on SmolLM2 (docs/tune.md, "The lean decode path").
"""

from __future__ import annotations

import contextlib
import functools

import torch

NAME = "infer_tune_decode"


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = attention_mask
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, :, : key.shape[-2]]
    plain = (query.shape[2] == 1 and not dropout and query.dtype == key.dtype == value.dtype == torch.float32
             and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
             and kwargs.get("s_aux") is None and not kwargs.get("output_attentions")
             and (mask is None or (mask.dim() == 4 and mask.shape[2] == 1 and mask.dtype in (torch.bool, torch.float32)))
             and query.shape[1] % key.shape[1] == 0)
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return torch.ops.infer_tune_native.decode_attention(query, key, value, mask, float(scale)), None


@functools.cache
def register() -> str | None:
    """Register the implementation with transformers (once); its name, or None where the kernels do not build."""
    from infer_tune import native

    if not native.available()[0]:
        return None
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks SDPA is given
    return NAME


@contextlib.contextmanager
def attending(model: torch.nn.Module, enabled: bool = True):
    """Inside the block, `model` attends with the native decode attention where it attended with SDPA.
    Yields what it attends with: NAME, or the model's own implementation (not SDPA, disabled, or no kernels)."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    name = register() if enabled and current == "sdpa" else None
    if name is None:
        yield current
        return
    config._attn_implementation = name
    try:
        yield name
    finally:
        config._attn_implementation = current
