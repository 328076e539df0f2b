"""KV-cache arithmetic: analytic cache bytes per dtype, bytes measured from cache tensors, and an
analytic FLOP count of greedy generation with and without the cache.

FLOP model (dense decoder, 2 FLOPs per multiply-accumulate), per processed token at position i
(1-based, it attends to i keys):
  linear    = 2 x layers x (hidden*q_dim + 2*hidden*kv_dim + q_dim*hidden + 3*hidden*intermediate)
  attention = 4 x layers x heads x head_dim x i          (Q.K^T and attention.V)
and once per forward call the LM head on the last position only, 2 x hidden x vocab (transformers'
`generate` passes `logits_to_keep=1`). Norms, rotary, softmax and the embedding lookup are left
out (each well under 1% of the total). With the cache, step k>0 processes one new token; without
it, step k reprocesses the whole prompt plus the k tokens generated so far.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from infer_tune.errors import ConfigError

KV_DTYPE_BITS: dict[str, int] = {"fp32": 32, "bf16/fp16": 16, "int8": 8, "int4": 4, "int2": 2}
_REQUIRED = ("num_hidden_layers", "num_attention_heads", "hidden_size")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder config that KV bytes and FLOPs depend on."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    max_positions: int | None
    model_type: str | None = None

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config object or a config.json dict (a nested `text_config` is used)."""
        data = config if isinstance(config, dict) else config.to_dict()
        if "num_hidden_layers" not in data and isinstance(data.get("text_config"), dict):
            data = {**data["text_config"], "model_type": data.get("model_type")}
        missing = [k for k in _REQUIRED if not data.get(k)]
        if missing:
            raise ConfigError(f"not a decoder model config: it lacks {', '.join(missing)}")
        heads = int(data["num_attention_heads"])
        hidden = int(data["hidden_size"])
        return cls(
            layers=int(data["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            hidden=hidden,
            intermediate=int(data.get("intermediate_size") or 4 * hidden),
            vocab=int(data.get("vocab_size") or 0),
            max_positions=data.get("max_position_embeddings"),
            model_type=data.get("model_type"),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def load_model_config(ref: str) -> ModelShape:
    """A config.json file, a directory holding one, or (online) a Hugging Face id -> ModelShape.

    No weights are loaded. Anything that is not a decoder model config raises ConfigError.
    """
    path = Path(ref).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"model config {ref}: directory has no config.json")
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"model config {ref}: not a JSON model config ({type(exc).__name__})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"model config {ref}: not a model config (expected a JSON object)")
    elif ref.startswith((".", "/", "~")):
        raise ConfigError(f"model config {ref}: no such file or directory")
    else:
        from transformers import AutoConfig

        try:
            data = AutoConfig.from_pretrained(ref, trust_remote_code=False).to_dict()
        except (OSError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"model config {ref}: cannot fetch the config ({first})") from None
    try:
        return ModelShape.from_config(data)
    except ConfigError as exc:
        raise ConfigError(f"model config {ref}: {exc}") from None


def kv_bytes(shape: ModelShape, tokens: int, bits: float, batch_size: int = 1) -> int:
    """Analytic cache size: 2 (K and V) x layers x kv_heads x head_dim x tokens x bits/8 (no scales)."""
    return int(2 * shape.layers * shape.kv_heads * shape.head_dim * tokens * batch_size * bits / 8)


def kv_bytes_by_dtype(shape: ModelShape, tokens: int) -> dict[str, int]:
    """Cache bytes at `tokens` for each KV dtype in KV_DTYPE_BITS."""
    return {name: kv_bytes(shape, tokens, bits) for name, bits in KV_DTYPE_BITS.items()}


def measured_cache_bytes(cache: Any) -> int:
    """Bytes held by a transformers Cache's tensors (full-precision, residual and quantized states)."""
    from infer_tune.models import tensor_bytes

    if cache is None:
        return 0
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, name, None))
    return total


def linear_flops_per_token(shape: ModelShape) -> int:
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = (shape.hidden * q_dim + 2 * shape.hidden * kv_dim + q_dim * shape.hidden
                 + 3 * shape.hidden * shape.intermediate)
    return 2 * shape.layers * per_layer


def forward_flops(shape: ModelShape, new_tokens: int, past_tokens: int) -> int:
    """One forward call over `new_tokens` positions after `past_tokens` cached ones (LM head on the last)."""
    first, last = past_tokens + 1, past_tokens + new_tokens
    keys_total = (first + last) * new_tokens // 2  # sum of positions first..last
    attention = 4 * shape.layers * shape.heads * shape.head_dim * keys_total
    return new_tokens * linear_flops_per_token(shape) + attention + 2 * shape.hidden * shape.vocab


def flops_with_cache(shape: ModelShape, prompt_tokens: int, new_tokens: int) -> int:
    """Prefill of the prompt, then one token per step (the last generated token is never fed back)."""
    total = forward_flops(shape, prompt_tokens, 0)
    for k in range(1, new_tokens):
        total += forward_flops(shape, 1, prompt_tokens + k - 1)
    return total


def flops_without_cache(shape: ModelShape, prompt_tokens: int, new_tokens: int) -> int:
    """Every step recomputes the prompt and all tokens generated so far."""
    return sum(forward_flops(shape, prompt_tokens + k, 0) for k in range(new_tokens))


def compute_saved(shape: ModelShape, prompt_tokens: int, new_tokens: int) -> dict[str, float | int]:
    """FLOPs with and without the cache and the share the cache saves."""
    with_cache = flops_with_cache(shape, prompt_tokens, new_tokens)
    without = flops_without_cache(shape, prompt_tokens, new_tokens)
    return {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "flops_with_cache": with_cache,
            "flops_without_cache": without, "compute_saved_fraction": 1.0 - with_cache / without}


# --------------------------------------------------------------------------- claim checks
COMPUTE_CLAIM_NEW_TOKENS = 500
COMPUTE_CLAIM_SAVED = 0.80
LONG_CONTEXT_TOKENS = 131072
LONG_CONTEXT_CLAIM_BYTES = 1_000_000_000  # "several GB": at least 1 GB in 16-bit


def compute_claim(shape: ModelShape, prompt_tokens: int, measured: dict | None = None) -> dict:
    """"A 500-token answer needs over 80% less compute with the cache", for one prompt length.

    `measured` (optional) holds `e2e_ms_dynamic`, `e2e_ms_none` and `new_tokens` of a real run; the wall
    time saved is then reported and judged against the same 80% line.
    """
    saved = compute_saved(shape, prompt_tokens, COMPUTE_CLAIM_NEW_TOKENS)
    claim = {"claim": "compute_saved_at_500_tokens", "prompt_tokens": prompt_tokens,
             "new_tokens": COMPUTE_CLAIM_NEW_TOKENS, "threshold": COMPUTE_CLAIM_SAVED,
             "flops_with_cache": saved["flops_with_cache"], "flops_without_cache": saved["flops_without_cache"],
             "flops_saved_fraction": saved["compute_saved_fraction"],
             "held": saved["compute_saved_fraction"] > COMPUTE_CLAIM_SAVED}
    if measured and measured.get("e2e_ms_none") and measured.get("e2e_ms_dynamic"):
        wall_saved = 1.0 - measured["e2e_ms_dynamic"] / measured["e2e_ms_none"]
        claim.update({"measured_new_tokens": measured["new_tokens"], "e2e_ms_dynamic": measured["e2e_ms_dynamic"],
                      "e2e_ms_none": measured["e2e_ms_none"], "wall_saved_fraction": wall_saved,
                      "wall_held": wall_saved > COMPUTE_CLAIM_SAVED})
    claim["statement"] = "KV cache: a 500-token answer needs over 80% less compute"
    claim["value"] = claim["flops_saved_fraction"]
    claim["finding"] = (f"{claim['new_tokens']} tokens after a {prompt_tokens}-token prompt: "
                        f"{claim['flops_saved_fraction']:.1%} fewer FLOPs with the cache")
    if "wall_saved_fraction" in claim:
        claim["finding"] += (f"; measured at {claim['measured_new_tokens']} tokens: "
                             f"{claim['wall_saved_fraction']:.1%} less wall time")
    return claim


def long_context_claim(shape: ModelShape, tokens: int = LONG_CONTEXT_TOKENS) -> dict:
    """"The price is memory: several GB of cache at 128K context" (16-bit cache, batch 1)."""
    size = kv_bytes(shape, tokens, 16)
    return {"claim": "kv_bytes_at_long_context", "context_tokens": tokens, "kv_bytes_16bit": size,
            "kv_bytes_by_dtype": kv_bytes_by_dtype(shape, tokens), "threshold_bytes": LONG_CONTEXT_CLAIM_BYTES,
            "beyond_model_max_positions": bool(shape.max_positions and tokens > shape.max_positions),
            "held": size >= LONG_CONTEXT_CLAIM_BYTES,
            "statement": "KV cache costs memory: several GB at 128K context", "value": size,
            "finding": f"{size / 1e9:.2f} GB in 16-bit at {tokens} tokens"}


def claim_lines(claims: list[dict]) -> list[str]:
    """One human line per claim check, ending in "held" or "did not hold here"."""

    def verdict(ok: bool) -> str:
        return "held" if ok else "did not hold here"

    lines = []
    for c in claims:
        if c["claim"] == "compute_saved_at_500_tokens":
            line = (f"{c['new_tokens']} generated tokens after a {c['prompt_tokens']}-token prompt: the cache needs "
                    f"{c['flops_saved_fraction']:.1%} fewer FLOPs ({c['flops_with_cache']:.3g} vs "
                    f"{c['flops_without_cache']:.3g}); claim >{c['threshold']:.0%}: {verdict(c['held'])}")
            if "wall_saved_fraction" in c:
                line += (f"; measured wall time at {c['measured_new_tokens']} tokens: dynamic "
                         f"{c['e2e_ms_dynamic'] / 1000:.2f} s vs none {c['e2e_ms_none'] / 1000:.2f} s = "
                         f"{c['wall_saved_fraction']:.1%} less: {verdict(c['wall_held'])}")
            lines.append(line)
        elif c["claim"] == "kv_bytes_at_long_context":
            note = " (beyond the model's trained context)" if c["beyond_model_max_positions"] else ""
            lines.append(f"KV cache at {c['context_tokens']} tokens{note}: {c['kv_bytes_16bit'] / 1e9:.2f} GB in "
                         f"16-bit; claim 'several GB' (>= {c['threshold_bytes'] / 1e9:.0f} GB): {verdict(c['held'])}")
    return lines
