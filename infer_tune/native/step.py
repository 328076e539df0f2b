"""The whole decode step in one native call (step.cpp), for the models it recognizes: the lean path's
`native_step` (LeanConfig; docs/tune.md, "The native decode step").

The compiled step (tuners/lean/loop.py) runs the same kernels, but each step also pays for what sits
around them: about 150 custom-op calls through the dispatcher, inductor's wrapper converting some 370
input tensors, a Python frame per call, an allocation per intermediate. Profiled on SmolLM2 int4 a8 (2
threads, `perf`), that was about a quarter of the calling thread's time. `LlamaStep` does the step's
norms, rotary embedding, cache writes and residual adds in plain C++ loops between the same w4a8 / w8a8
matmuls and decode attention, so the step is one call.

It runs a model only where every part is one it knows, checked part by part (`recognize`): transformers'
classes of five families (`FAMILIES`): Llama (SmolLM2, Llama 2 / 3, TinyLlama, ...), Mistral (a sliding
window over every layer where the config sets one), Qwen2 (q / k / v biases), Qwen3 (q / k RMS norms per
head) and Gemma 3 text models (`Gemma3ForCausalLM`: (1 + w) norms around attention and MLP, GELU (tanh),
q / k norms, sliding-window layers with their own rotary frequencies, a query scale of its own, final
logit soft-capping where set; its embedding's sqrt(hidden) scale is the model's own embedding module's,
which the step calls). Every projection an `Int4A8Linear` on its `w4a8` kernel (biases of the attention's
projections allowed), the head `Int8A8Linear` (w8a8) or `Int4A8Linear`, fp32, a rotary embedding whose
frequencies do not change with the position, no forward hooks, a cache of plain full-length static layers
(`plain_cache`: position p at index p in every layer; a sliding window is the step's mask, as it is the
eager model's). Anything else (another family, an MLP bias, attention logit soft-capping, a wrapped module)
gets the compiled step and the reason (`lean_native_fallback`): a step that silently computed something
else would be worse than none. Values equal the eager model's up to fp32 rounding (tests/test_native_step.py).
"""

from __future__ import annotations

import torch

ROPE_TYPES = ("default", "linear", "llama3")  # frequencies fixed at load (dynamic ones change with the position)
# the model classes it runs: class name -> (transformers.models module, class prefix)
FAMILIES = {"LlamaForCausalLM": ("llama", "Llama"), "MistralForCausalLM": ("mistral", "Mistral"),
            "Qwen2ForCausalLM": ("qwen2", "Qwen2"), "Qwen3ForCausalLM": ("qwen3", "Qwen3"),
            "Gemma3ForCausalLM": ("gemma3", "Gemma3")}
HEAD_NORMS = ("Qwen3", "Gemma3")  # q / k RMS norms per head
GEMMA = ("Gemma3",)  # (1 + w) norms, a norm after attention and after the MLP
PER_LAYER = 17  # step.cpp's parts per layer
EMPTY = torch.empty(0)  # an absent part


def _hooked(module: torch.nn.Module) -> bool:
    return any(bool(getattr(m, name, None)) for m in module.modules()
               for name in ("_forward_hooks", "_forward_pre_hooks"))


def plain_cache(config, size: int):
    """A static cache of `size` positions whose every layer is a plain full-length `StaticLayer` (position p
    at index p), sliding-window layers included: what the native step reads and writes. transformers' own
    `StaticCache` keeps a sliding layer as a rolling buffer of the window's length instead; over a plain layer
    the eager model's mask hides what lies outside the window (absolute positions), so its values are the
    same (tests/test_native_step.py). A model without sliding layers gets its `StaticCache` as it is."""
    from transformers import StaticCache
    from transformers.cache_utils import Cache, StaticLayer

    cache = StaticCache(config=config, max_cache_len=size)
    if all(type(layer) is StaticLayer for layer in cache.layers):
        return cache
    return Cache(layers=[StaticLayer(max_cache_len=size) for _ in cache.layers])


def _family(model) -> tuple[object, str] | str:
    name = type(model).__name__
    if name not in FAMILIES:
        return f"{name} is not a model class the native step runs ({', '.join(FAMILIES)})"
    module_name, prefix = FAMILIES[name]
    try:
        import importlib

        module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    except ImportError as exc:  # pragma: no cover - an older transformers
        return f"transformers has no {prefix} classes ({exc})"
    if type(model) is not getattr(module, name, None):
        return f"{name} is not transformers' own class"
    return module, prefix


def _rotary_tables(model, prefix: str, layer_types: list[str]) -> tuple[list, list] | str:
    """Per layer type (Gemma 3's sliding and full layers have their own), (inv_freq, cos / sin scale)."""
    rotary = model.model.rotary_emb
    tables = {}
    for kind in sorted(set(layer_types)):
        if prefix in GEMMA:
            rope_type = rotary.rope_type.get(kind, "default")
            inv_freq = getattr(rotary, f"{kind}_inv_freq", None)
            scale = getattr(rotary, f"{kind}_attention_scaling", 1.0)
        else:
            rope_type = getattr(rotary, "rope_type", "default")
            inv_freq, scale = rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0)
        if rope_type not in ROPE_TYPES:
            return f"rotary embedding '{rope_type}' changes with the position"
        if inv_freq is None:
            return f"no rotary frequencies for {kind} layers"
        tables[kind] = (inv_freq.detach().float().contiguous(), float(scale if scale is not None else 1.0))
    return tables


def recognize(model: torch.nn.Module) -> tuple[dict | None, str]:
    """(what step.cpp needs of `model`, "") when it runs this model's decode step exactly; (None, why) if not."""
    from infer_tune import native

    ok, detail = native.available()
    if not ok:
        return None, detail
    from transformers.activations import GELUTanh, SiLUActivation

    from infer_tune.tuners.quantize.modules import Int4A8Linear, Int8A8Linear

    family = _family(model)
    if isinstance(family, str):
        return None, family
    module, prefix = family
    classes = {part: getattr(module, f"{prefix}{part}") for part in ("DecoderLayer", "Attention", "MLP", "RMSNorm")}
    config = model.config
    gemma = prefix in GEMMA
    if getattr(config, "mlp_bias", False):
        return None, "the model's MLP projections have biases"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return None, "pretraining_tp > 1"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return None, "its attention soft-caps the scores"
    if getattr(config, "use_bidirectional_attention", False):
        return None, "its attention is bidirectional"
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in model.parameters()):
        return None, "not every parameter is fp32 on the CPU"
    if _hooked(model):
        return None, "a module has forward hooks"
    body = model.model
    layers = list(body.layers)
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
    if len(layer_types) != len(layers) or any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        return None, f"a layer is of a type the native step does not run ({sorted(set(layer_types))})"
    tables = _rotary_tables(model, prefix, layer_types)
    if isinstance(tables, str):
        return None, tables

    def projection(module, name: str) -> tuple[torch.Tensor, torch.Tensor] | str:
        if type(module) is not Int4A8Linear or module.decode_kernel != "w4a8":
            return f"{name} is {type(module).__name__} (kernel {getattr(module, 'decode_kernel', None)}), not int4 a8 on w4a8"
        if module.out_features % 8 or module.in_features % module.group_size:
            return (f"{name} has {module.out_features} outputs and {module.in_features} inputs (the step needs outputs "
                    f"in multiples of 8 and inputs in whole groups of {module.group_size})")
        bias = module.bias_f
        return module._w4a8, (EMPTY if bias is None else bias.detach().float().contiguous())

    def norm(module, name: str) -> torch.Tensor | str:
        if type(module) is not classes["RMSNorm"]:
            return f"{name} is {type(module).__name__}, not {prefix}RMSNorm"
        weight = module.weight.detach().float()
        return (1.0 + weight).contiguous() if gemma else weight.contiguous()  # Gemma: x_normed * (1 + w)

    def epsilon(module) -> float | None:
        return getattr(module, "variance_epsilon", getattr(module, "eps", None))

    first = layers[0].self_attn
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = first.head_dim
    group = first.q_proj.group_size if type(first.q_proj) is Int4A8Linear else None
    eps = epsilon(layers[0].input_layernorm)
    act = None
    tensors: list[torch.Tensor] = []
    windows: list[int] = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer) is not classes["DecoderLayer"] or type(attn) is not classes["Attention"] \
                or type(mlp) is not classes["MLP"]:
            return None, f"layer {i} is not transformers' {prefix} decoder layer"
        if isinstance(mlp.act_fn, (SiLUActivation, torch.nn.SiLU)):
            kind = 0
        elif isinstance(mlp.act_fn, GELUTanh) or (type(mlp.act_fn) is torch.nn.GELU and mlp.act_fn.approximate == "tanh"):
            kind = 1
        else:
            return None, f"layer {i}'s activation is {type(mlp.act_fn).__name__}, not SiLU or GELU (tanh)"
        if act is not None and kind != act:
            return None, f"layer {i}'s activation differs"
        act = kind
        if attn.head_dim != head_dim or attn.scaling != first.scaling:
            return None, f"layer {i} attends with another head size or scale"
        projections = {n: projection(getattr(attn, n), f"layer {i}'s {n}") for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        projections |= {n: projection(getattr(mlp, n), f"layer {i}'s {n}") for n in ("gate_proj", "up_proj", "down_proj")}
        norms = {"in": norm(layer.input_layernorm, f"layer {i}'s input norm")}
        if gemma:
            norms["mlp_in"] = norm(layer.pre_feedforward_layernorm, f"layer {i}'s pre-MLP norm")
            norms["attn_out"] = norm(layer.post_attention_layernorm, f"layer {i}'s post-attention norm")
            norms["mlp_out"] = norm(layer.post_feedforward_layernorm, f"layer {i}'s post-MLP norm")
        else:
            norms["mlp_in"] = norm(layer.post_attention_layernorm, f"layer {i}'s post-attention norm")
        if prefix in HEAD_NORMS:
            norms["q"], norms["k"] = norm(attn.q_norm, f"layer {i}'s q norm"), norm(attn.k_norm, f"layer {i}'s k norm")
        why = next((p for p in (*projections.values(), *norms.values()) if isinstance(p, str)), None)
        if why:
            return None, why
        if any(projections[n][1].numel() for n in ("gate_proj", "up_proj", "down_proj")):
            return None, f"layer {i}'s MLP projections have biases"
        if any(getattr(m, "group_size", group) != group for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                                     mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return None, f"layer {i}'s int4 groups differ"
        norm_modules = [layer.input_layernorm, layer.post_attention_layernorm]
        norm_modules += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm] if gemma else []
        norm_modules += [attn.q_norm, attn.k_norm] if prefix in HEAD_NORMS else []
        if any(epsilon(m) != eps for m in norm_modules):
            return None, f"layer {i}'s norms have another epsilon"
        if prefix == "Mistral":  # every layer slides where the config sets a window (MistralModel's mask)
            window = getattr(config, "sliding_window", None)
        else:  # the layer's own (Qwen2, Qwen3, Gemma 3: sliding layers by config.layer_types)
            window = getattr(attn, "sliding_window", None)
            if (window is not None) != (layer_types[i] == "sliding_attention"):
                return None, f"layer {i}'s sliding window does not match its type"
        windows.append(int(window or 0))
        tensors += [norms["in"], *(projections[n][0] for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj")),
                    norms["mlp_in"], norms.get("attn_out", EMPTY), norms.get("mlp_out", EMPTY),
                    *(projections[n][1] for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                    norms.get("q", EMPTY), norms.get("k", EMPTY)]
    final = norm(body.norm, "the final norm")
    if isinstance(final, str):
        return None, final
    if epsilon(body.norm) != eps:
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
    if heads * head_dim != first.o_proj.in_features or heads % kv_heads:
        return None, "the attention's head counts do not match its projections"
    kinds = sorted(tables)
    if any(inv.numel() != head_dim // 2 for inv, _ in tables.values()):
        return None, "the rotary embedding does not cover the whole head (partial rotary)"
    inv_freq = torch.stack([tables[k][0] for k in kinds]).contiguous()
    softcap = getattr(config, "final_logit_softcapping", None) if gemma else None
    ints = [len(layers), heads, kv_heads, head_dim, config.hidden_size, layers[0].mlp.gate_proj.out_features,
            group, head_group, act, len(kinds)]
    for window, kind in zip(windows, layer_types):
        ints += [window, kinds.index(kind)]
    floats = [float(eps), float(first.scaling), float(softcap or 0.0), *(tables[k][1] for k in kinds)]
    return {"tensors": tensors, "inv_freq": inv_freq, "ints": ints, "floats": floats,
            "vocab": head.out_features, "windows": windows}, ""


KV_DTYPES = ("fp32", "int8")  # the native step's caches: fp32, or int8 with one fp32 scale per vector


class NativeCache:
    """The cache the native step owns (the slot engine's, the speculative verifier's): per layer keys and values
    [rows, kv heads, length, head dim], fp32 or int8 (`kv_dtype`; int8 with per layer scales [rows, kv heads,
    length]: each vector of a head at a position is int8 times its scale, max |x| / 127)."""

    def __init__(self, parts: dict, rows: int, length: int, kv_dtype: str = "fp32") -> None:
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got '{kv_dtype}'")
        ints = parts["ints"]
        layers, kv_heads, head_dim = ints[0], ints[2], ints[3]
        dtype = torch.int8 if kv_dtype == "int8" else torch.float32
        self.kv_dtype, self.rows, self.length = kv_dtype, rows, length
        self.keys = [torch.zeros((rows, kv_heads, length, head_dim), dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros((rows, kv_heads, length, head_dim), dtype=dtype) for _ in range(layers)]
        scaled = kv_dtype == "int8"
        self.key_scales = [torch.zeros((rows, kv_heads, length)) for _ in range(layers)] if scaled else []
        self.value_scales = [torch.zeros((rows, kv_heads, length)) for _ in range(layers)] if scaled else []

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache, per layer: keys, values (and their scales)."""
        return [*self.keys, *self.values, *self.key_scales, *self.value_scales]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def row_parts(self, layer: int) -> list[torch.Tensor]:
        """Layer `layer`'s tensors whose first two dimensions are (row, kv head) and third the position."""
        parts = [self.keys[layer], self.values[layer]]
        return parts + ([self.key_scales[layer], self.value_scales[layer]] if self.key_scales else [])

    def step(self, parts: dict, cls=None):
        """step.cpp's LlamaStep over this cache."""
        return llama_step(parts, self.keys, self.values, cls=cls, key_scales=self.key_scales,
                          value_scales=self.value_scales)


def llama_step(parts: dict, keys: list, values: list, lengths: list = (), cls=None, key_scales: list = (),
               value_scales: list = ()):
    """step.cpp's LlamaStep over `recognize`'s parts and a cache's per-layer keys, values (and length counters,
    which a one-row step advances; an int8 cache: its per-layer scales, passed after the keys and the values);
    `cls` another build of the class (bench/native_ab.py)."""
    cls = cls or torch.classes.infer_tune_native.LlamaStep
    return cls(parts["tensors"], [*keys, *key_scales], [*values, *value_scales], list(lengths), parts["inv_freq"],
               parts["ints"], parts["floats"])


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
                raise RuntimeError("the native step needs a plain static cache (plain_cache) whose layers the "
                                   "prefill has filled")
            self._native = llama_step(self.parts, [c.keys for c in layers], [c.values for c in layers],
                                      [c.cumulative_length for c in layers])
            self._keys = layers[0].keys
        logits = self._native.step(self.embed(input_ids).reshape(1, -1), int(cache_position[0]))
        return logits[:, :self.parts["vocab"]].unsqueeze(0)


class NativeCachedStep:
    """The native step over a one-row `NativeCache` of its own (the lean loop's int8 cache, which only step.cpp
    reads and writes; the speculative verifier's; a perplexity pass's): `rows(ids, start, keep_from)` runs ids as
    consecutive rows of the slot from position `start` on (`step_mixed`, `chunk` rows a call: each row writes its
    keys and values before the rows after it attend, and gets the values of a step of its own), `prefill` a
    prompt, and `step(input_ids [1, 1], cache_position [1])` as `NativeStep`."""

    def __init__(self, model: torch.nn.Module, cache: NativeCache, parts: dict, chunk: int | None = 128) -> None:
        self.embed = model.get_input_embeddings()
        self.cache, self.parts, self.chunk = cache, parts, chunk
        self._native = cache.step(parts)

    def rows(self, ids: torch.Tensor, start: int = 0, keep_from: int = 0) -> torch.Tensor:
        """`ids` [n] at positions start.. -> the logits of rows keep_from..n-1 [n - keep_from, vocab] (a call
        that keeps none of its rows asks for its last, dropped)."""
        ids = ids.reshape(-1)
        n = len(ids)
        if start + n > self.cache.length:
            raise ValueError(f"{start + n} positions do not fit a cache of {self.cache.length}")
        kept = []
        for first in range(0, n, self.chunk or n):
            part = ids[first:first + (self.chunk or n)]
            keep = [i for i in range(len(part)) if first + i >= keep_from]
            logits = self._native.step_mixed(self.embed(part.view(-1, 1)).reshape(len(part), -1),
                                             torch.zeros(len(part), dtype=torch.long),
                                             torch.arange(start + first, start + first + len(part), dtype=torch.long),
                                             0, torch.tensor(keep or [len(part) - 1], dtype=torch.long))
            if keep:
                kept.append(logits)
        return torch.cat(kept)[:, :self.parts["vocab"]]

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt [1, P] into the cache from position 0 -> its last position's logits [1, 1, vocab]."""
        return self.rows(input_ids, 0, input_ids.numel() - 1).unsqueeze(0)

    def __call__(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        logits = self._native.step(self.embed(input_ids).reshape(1, -1), int(cache_position[0]))
        return logits[:, :self.parts["vocab"]].unsqueeze(0)


class NativeSlotStep:
    """The slot engine's decode step (tuners/batch/slots.py) as `step(input_ids [R, 1], positions [R]) -> logits
    [R, 1, vocab]`: rows 0..R-1 of its slot cache (a `NativeCache` of one row per slot, filled by its admits
    before the first step), each at its own position. Built at the first call."""

    def __init__(self, model: torch.nn.Module, cache: NativeCache, parts: dict) -> None:
        self.embed = model.get_input_embeddings()
        self.cache, self.parts = cache, parts
        self._native = None

    def _built(self):
        if self._native is None:
            self._native = self.cache.step(self.parts)
        return self._native

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self._built().step_rows(self.embed(input_ids).reshape(input_ids.shape[0], -1), positions)
        return logits[:, :self.parts["vocab"]].unsqueeze(1)

    def mixed(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, decode: int,
              keep: torch.Tensor) -> torch.Tensor:
        """One step over rows of several kinds (step.cpp's `step_mixed`): rows 0..decode-1 the decode tokens of
        slots 0..decode-1, then prompt rows (`ids` [N], each at its slot and position); logits of the rows
        `keep` [M] -> [M, vocab]."""
        logits = self._built().step_mixed(self.embed(ids.view(-1, 1)).reshape(ids.shape[0], -1), slots, positions,
                                          decode, keep)
        return logits[:, :self.parts["vocab"]]
