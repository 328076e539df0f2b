"""Find the routed-expert modules of a Hugging Face MoE model and record what their routers chose.

How transformers 5.x routes (read from the installed version): every MoE architecture (Mixtral,
Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS, Granite-MoE, PhiMoE, GLM4-MoE, DBRX and ~60 more)
keeps its experts in one module with fused 3D weights (`[num_experts, ...]`), decorated with
`use_experts_implementation`, and calls it as `experts(hidden_states, top_k_index, top_k_weights)`
after its router picked `top_k_index` ([tokens, top_k] expert ids; GPT-OSS names it
`router_indices`). A forward pre-hook on those modules therefore sees every routing decision of
every architecture, whatever the router computes (softmax, sigmoid with group limits, biases).
Under transformers' own expert parallelism ids >= num_experts are sentinels; they are skipped.
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from infer_tune.errors import ConfigError

INDEX_ARGS = ("top_k_index", "router_indices", "topk_indices", "topk_idx", "selected_experts")
WEIGHT_ARGS = ("top_k_weights", "routing_weights", "topk_weights", "router_scores")
DEFAULT_ROUTE_TOKENS = 50_000


@dataclass
class MoELayer:
    """One routed-experts module: where it is and its shape."""

    index: int
    name: str
    module: torch.nn.Module
    num_experts: int

    def expert_params(self) -> dict[str, torch.nn.Parameter]:
        """The module's per-expert tensors (first dimension = num_experts)."""
        return {n: p for n, p in self.module.named_parameters(recurse=False)
                if p.dim() >= 1 and p.shape[0] == self.num_experts}

    def expert_bytes(self) -> int:
        """Bytes of one expert (all its tensors) in this layer."""
        total = sum(p.numel() * p.element_size() for p in self.expert_params().values())
        return total // self.num_experts


def _routing_arg(module: torch.nn.Module) -> str | None:
    """The name of the expert-index argument of an experts module's forward, if it is one."""
    try:
        params = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return None
    return params[2] if len(params) >= 4 and params[2] in INDEX_ARGS else None


def find_moe_layers(model: torch.nn.Module) -> list[MoELayer]:
    """Every routed-experts module, in execution order (model.named_modules order)."""
    layers = []
    for name, module in model.named_modules():
        num = getattr(module, "num_experts", None)
        if isinstance(num, int) and num > 1 and _routing_arg(module) is not None:
            layers.append(MoELayer(index=len(layers), name=name, module=module, num_experts=num))
    return layers


def require_moe(model: torch.nn.Module, ref: str) -> list[MoELayer]:
    """The MoE layers of `model`, or a ConfigError saying it has none (a dense model)."""
    layers = find_moe_layers(model)
    if not layers:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError(f"model '{ref}' ({kind}) has no experts: no mixture-of-experts layer found; "
                          "expert placement needs a MoE model (e.g. moe-demo, Mixtral, Qwen-MoE, OLMoE)")
    counts = {layer.num_experts for layer in layers}
    if len(counts) > 1:
        raise ConfigError(f"model '{ref}' mixes MoE layers of {sorted(counts)} experts; one expert count per "
                          "model is supported")
    return layers


def routed_indices(module: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The [tokens, top_k] expert ids an experts module is called with."""
    name = _routing_arg(module)
    if len(args) >= 2:
        return args[1]
    return kwargs.get(name) if name else None


def top_k_of(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    for attr in ("num_experts_per_tok", "moe_top_k", "top_k"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class RoutingRecorder:
    """Counts, per MoE layer, tokens per expert, co-activated pairs and the expert sets chosen.

    Use as a context manager around forwards; `valid_rows(n)` may be set to a callable returning a
    boolean mask of the rows to count (padding excluded), else every row counts.
    """

    def __init__(self, layers: list[MoELayer], *, route_tokens: int = DEFAULT_ROUTE_TOKENS) -> None:
        self.layers = layers
        self.num_experts = layers[0].num_experts
        n = self.num_experts
        self.counts = np.zeros((len(layers), n), dtype=np.int64)
        self.coactivation = np.zeros((len(layers), n, n), dtype=np.int64)
        self.routes: list[Counter] = [Counter() for _ in layers]
        self.routed = [0] * len(layers)
        self.tokens = [0] * len(layers)
        self.top_k: int | None = None
        self.route_tokens = route_tokens
        self.row_mask: torch.Tensor | None = None
        self._handles: list = []

    def __enter__(self) -> RoutingRecorder:
        for layer in self.layers:
            def hook(module, args, kwargs, i=layer.index):
                self._record(i, routed_indices(module, args, kwargs))

            self._handles.append(layer.module.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _record(self, layer: int, index: torch.Tensor | None) -> None:
        if index is None:
            return
        index = index.detach().reshape(index.shape[0], -1).to("cpu", torch.int64)
        if self.row_mask is not None and self.row_mask.numel() == index.shape[0]:
            index = index[self.row_mask]
        self.record(layer, index)

    def record(self, layer: int, index: torch.Tensor) -> None:
        """Add one call's routing ([tokens, top_k] expert ids) to layer `layer`."""
        n = self.num_experts
        self.top_k = self.top_k or int(index.shape[1])
        valid = (index >= 0) & (index < n)
        onehot = torch.zeros(index.shape[0], n + 1, dtype=torch.int64)
        onehot.scatter_(1, torch.where(valid, index, n), 1)
        multi = onehot[:, :n]
        self.counts[layer] += multi.sum(0).numpy()
        pairs = (multi.T @ multi).numpy()
        np.fill_diagonal(pairs, 0)
        self.coactivation[layer] += pairs
        self.tokens[layer] += int(index.shape[0])
        room = self.route_tokens - self.routed[layer]
        if room > 0:
            keep = multi[:room].bool()
            rows, counts = torch.unique(keep, dim=0, return_counts=True)
            for row, count in zip(rows, counts.tolist()):
                experts = tuple(int(e) for e in torch.nonzero(row).flatten().tolist())
                if experts:
                    self.routes[layer][experts] += count
            self.routed[layer] += int(keep.shape[0])


def load_file(model: torch.nn.Module, ref: str, path: str, layers: list[MoELayer], recorder: RoutingRecorder,
              workload: dict):
    """The load file of a profiled model (see loadfile.py)."""
    from infer_tune.models import model_bytes
    from infer_tune.tuners.experts.loadfile import LayerLoad, LoadFile, ModelInfo

    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    first = next(iter(layers[0].expert_params().values()))
    expert_bytes = max(layer.expert_bytes() for layer in layers)
    info = ModelInfo(ref=ref, path=path, model_type=str(getattr(config, "model_type", "?")),
                     num_experts=layers[0].num_experts, top_k=recorder.top_k or top_k_of(model) or 1,
                     hidden_size=int(getattr(config, "hidden_size", 0) or first.shape[-1]),
                     dtype_bytes=first.element_size(), expert_bytes=expert_bytes,
                     dense_bytes=model_bytes(model) - sum(layer.expert_bytes() * layer.num_experts for layer in layers),
                     num_groups=int(getattr(config, "n_group", None) or 1), dtype=str(first.dtype).removeprefix("torch."))
    entries = [LayerLoad(name=layer.name, counts=recorder.counts[i].copy(), coactivation=recorder.coactivation[i].copy(),
                         routes=sorted(recorder.routes[i].items(), key=lambda kv: (-kv[1], kv[0])))
               for i, layer in enumerate(layers)]
    return LoadFile(model=info, layers=entries, workload=workload, tokens=max(recorder.tokens),
                    route_tokens=max(recorder.routed))


def profile_batches(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], layers: list[MoELayer], *,
                    route_tokens: int = DEFAULT_ROUTE_TOKENS, device: str = "cpu",
                    progress=None) -> RoutingRecorder:
    """Teacher-forced forwards over `batches`, counting the routing of every non-padding token."""
    recorder = RoutingRecorder(layers, route_tokens=route_tokens)
    with recorder, torch.inference_mode():
        for i, batch in enumerate(batches):
            mask = batch["attention_mask"]
            recorder.row_mask = mask.reshape(-1).bool()
            model(input_ids=batch["input_ids"].to(device), attention_mask=mask.to(device), use_cache=False)
            if progress:
                progress("profiling", i + 1, len(batches))
    recorder.row_mask = None
    return recorder
