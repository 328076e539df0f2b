"""The whole decode step in one native call (step.cpp), for the models it recognizes: the lean path's
`native_step` (LeanConfig; docs/tune.md, "The native decode step").

The compiled step (tuners/lean/loop.py) runs the same kernels, but each step also pays for what sits
around them: about 150 custom-op calls through the dispatcher, inductor's wrapper converting some 370
input tensors, a Python frame per call, an allocation per intermediate. Profiled on SmolLM2 int4 a8 (2
threads, `perf`), that was about a quarter of the calling thread's time. `LlamaStep` does the step's
norms, rotary embedding, cache writes and residual adds in plain C++ loops between the same w4a8 / w8a8
matmuls and decode attention, so the step is one call.

It runs a model only where every part is one it knows, checked part by part (`recognize`): transformers'
Llama classes (`LlamaForCausalLM`: SmolLM2, Llama 2 / 3, TinyLlama, ...), fp32, every projection an
`Int4A8Linear` on its `w4a8` kernel without bias, the head `Int8A8Linear` (w8a8) or `Int4A8Linear`, RMS
norms, SiLU, a rotary embedding whose frequencies do not change with the position, no forward hooks, a
static cache. Anything else (another family, a bias, a sliding window, a wrapped module) gets the compiled
step and the reason (`lean_native_fallback`): a step that silently computed something else would be worse
than none. Values equal the compiled step's up to fp32 rounding (tests/test_native_step.py).
"""

from __future__ import annotations

import torch

ROPE_TYPES = ("default", "linear", "llama3")  # frequencies fixed at load (dynamic ones change with the position)


def _hooked(module: torch.nn.Module) -> bool:
    return any(bool(getattr(m, name, None)) for m in module.modules()
               for name in ("_forward_hooks", "_forward_pre_hooks"))


def recognize(model: torch.nn.Module) -> tuple[dict | None, str]:
    """(what step.cpp needs of `model`, "") when it runs this model's decode step exactly; (None, why) if not."""
    from infer_tune import native

    ok, detail = native.available()
    if not ok:
        return None, detail
    try:
        from transformers.activations import SiLUActivation
        from transformers.models.llama import modeling_llama as llama
    except ImportError as exc:  # pragma: no cover - transformers without Llama
        return None, f"transformers has no Llama classes ({exc})"
    from infer_tune.tuners.quantize.modules import Int4A8Linear, Int8A8Linear

    if type(model) is not llama.LlamaForCausalLM:
        return None, f"{type(model).__name__} is not LlamaForCausalLM (the only family the native step runs)"
    config = model.config
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return None, "the model's projections have biases"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return None, "pretraining_tp > 1"
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in model.parameters()):
        return None, "not every parameter is fp32 on the CPU"
    body = model.model
    rotary = body.rotary_emb
    if getattr(rotary, "rope_type", "default") not in ROPE_TYPES:
        return None, f"rotary embedding '{rotary.rope_type}' changes with the position"
    if _hooked(model):
        return None, "a module has forward hooks"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return None, "a layer does not attend over the full cache"

    def projection(module, name: str) -> torch.Tensor | str:
        if type(module) is not Int4A8Linear or module.decode_kernel != "w4a8" or module.bias_f is not None:
            return f"{name} is {type(module).__name__} (kernel {getattr(module, 'decode_kernel', None)}), not int4 a8 on w4a8"
        if module.out_features % 8 or module.in_features % module.group_size:
            return (f"{name} has {module.out_features} outputs and {module.in_features} inputs (the step needs outputs "
                    f"in multiples of 8 and inputs in whole groups of {module.group_size})")
        return module._w4a8

    def norm(module, name: str) -> torch.Tensor | str:
        if type(module) is not llama.LlamaRMSNorm:
            return f"{name} is {type(module).__name__}, not LlamaRMSNorm"
        return module.weight.detach()

    layers = list(body.layers)
    first = layers[0].self_attn
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = first.head_dim
    group = layers[0].self_attn.q_proj.group_size if type(first.q_proj) is Int4A8Linear else None
    eps = layers[0].input_layernorm.variance_epsilon if type(layers[0].input_layernorm) is llama.LlamaRMSNorm else None
    tensors: list[torch.Tensor] = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer) is not llama.LlamaDecoderLayer or type(attn) is not llama.LlamaAttention \
                or type(mlp) is not llama.LlamaMLP:
            return None, f"layer {i} is not transformers' Llama decoder layer"
        if not isinstance(mlp.act_fn, (SiLUActivation, torch.nn.SiLU)):
            return None, f"layer {i}'s activation is {type(mlp.act_fn).__name__}, not SiLU"
        if attn.head_dim != head_dim or abs(attn.scaling - head_dim ** -0.5) > 1e-12 * attn.scaling:
            return None, f"layer {i} attends with another head size or scale"
        parts = [norm(layer.input_layernorm, f"layer {i}'s input norm"),
                 *(projection(getattr(attn, n), f"layer {i}'s {n}") for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                 norm(layer.post_attention_layernorm, f"layer {i}'s post-attention norm"),
                 *(projection(getattr(mlp, n), f"layer {i}'s {n}") for n in ("gate_proj", "up_proj", "down_proj"))]
        why = next((p for p in parts if isinstance(p, str)), None)
        if why:
            return None, why
        if any(getattr(m, "group_size", group) != group for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                                     mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return None, f"layer {i}'s int4 groups differ"
        if layer.input_layernorm.variance_epsilon != eps or layer.post_attention_layernorm.variance_epsilon != eps:
            return None, f"layer {i}'s norms have another epsilon"
        tensors += parts
    final = norm(body.norm, "the final norm")
    if isinstance(final, str):
        return None, final
    if body.norm.variance_epsilon != eps:
        return None, "the final norm has another epsilon"
    tensors.append(final)
    head = model.lm_head
    if type(head) is Int8A8Linear and head.decode_kernel == "w8a8" and head.bias_f is None:
        tensors += list(head._w8a8)
        head_group = 0
    elif type(head) is Int4A8Linear and head.decode_kernel == "w4a8" and head.bias_f is None:
        tensors.append(head._w4a8)
        head_group = head.group_size
    else:
        return None, f"the head is {type(head).__name__} (kernel {getattr(head, 'decode_kernel', None)}), not w8a8 or w4a8"
    if heads * head_dim != layers[0].self_attn.o_proj.in_features or heads % kv_heads:
        return None, "the attention's head counts do not match its projections"
    inv_freq = rotary.inv_freq.detach().float().contiguous()
    if inv_freq.numel() != head_dim // 2:
        return None, "the rotary embedding does not cover the whole head (partial rotary)"
    ints = [len(layers), heads, kv_heads, head_dim, config.hidden_size, layers[0].mlp.gate_proj.out_features,
            group, head_group]
    floats = [float(eps), float(first.scaling), float(getattr(rotary, "attention_scaling", 1.0))]
    return {"tensors": tensors, "inv_freq": inv_freq, "ints": ints, "floats": floats,
            "vocab": head.out_features}, ""


def llama_step(parts: dict, keys: list, values: list, lengths: list = (), cls=None):
    """step.cpp's LlamaStep over `recognize`'s parts and a cache's per-layer keys, values (and length counters,
    which a one-row step advances); `cls` another build of the class (bench/native_ab.py)."""
    cls = cls or torch.classes.infer_tune_native.LlamaStep
    return cls(parts["tensors"], list(keys), list(values), list(lengths), parts["inv_freq"], parts["ints"],
               parts["floats"])


class NativeStep:
    """The decode step of one model on one static cache as `step(input_ids [1, 1], cache_position [1]) ->
    logits [1, 1, vocab]`, the call the lean loop makes of a compiled step. The token is embedded by the
    model's own embedding (whatever its quantization); everything after runs in step.cpp. Built at the
    first call, after the prefill has allocated the cache's tensors (again if the cache reallocates them)."""

    def __init__(self, model: torch.nn.Module, cache, parts: dict) -> None:
        self.embed = model.get_input_embeddings()
        self.cache, self.parts = cache, parts
        self._native = None
        self._keys = None

    def __call__(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        layers = self.cache.layers
        if self._native is None or layers[0].keys is not self._keys:
            if any(type(layer).__name__ != "StaticLayer" or not layer.is_initialized for layer in layers):
                raise RuntimeError("the native step needs a static cache whose layers the prefill has filled")
            self._native = llama_step(self.parts, [c.keys for c in layers], [c.values for c in layers],
                                      [c.cumulative_length for c in layers])
            self._keys = layers[0].keys
        logits = self._native.step(self.embed(input_ids).reshape(1, -1), int(cache_position[0]))
        return logits[:, :self.parts["vocab"]].unsqueeze(0)


class NativeSlotStep:
    """The slot engine's decode step (tuners/batch/slots.py) as `step(input_ids [R, 1], positions [R]) -> logits
    [R, 1, vocab]`: rows 0..R-1 of its slot cache (`keys`, `values`: per layer [slots, kv heads, length, head
    dim], filled by its admits before the first step), each at its own position. Built at the first call."""

    def __init__(self, model: torch.nn.Module, keys: list, values: list, parts: dict) -> None:
        self.embed = model.get_input_embeddings()
        self.keys, self.values, self.parts = keys, values, parts
        self._native = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._native is None:
            self._native = llama_step(self.parts, self.keys, self.values)
        logits = self._native.step_rows(self.embed(input_ids).reshape(input_ids.shape[0], -1), positions)
        return logits[:, :self.parts["vocab"]].unsqueeze(1)
