"""`moe-demo`: a real MoE model built from SmolLM2 by MoEfication, so routing means something.

No hub is reachable here, so the demo MoE is made from the provisioned dense model. Each of
SmolLM2-135M's 30 SwiGLU MLPs (1536 neurons) is split, from its activations on calibration text:
- the `shared` neurons with the largest mean output become an always-on shared expert;
- the other neurons are clustered into `experts` experts of equal size by what fires together
  (balanced k-means on each neuron's output-magnitude profile over the calibration tokens);
- the router is a linear map of the MLP input fitted (ridge least squares) to the log of each
  expert's output norm on that token; a token takes its `top_k` experts.
The result is saved as a transformers Qwen2-MoE checkpoint (SmolLM2's attention, norms and
embeddings map onto it exactly with `qkv_bias=False`; experts in the fused 3D layout) that every MoE
path of transformers runs: hot and cold experts and co-activated sets come from what SmolLM2 really
computes on suite text. It is lossy (half the MLP neurons run per token): the build reports the
held-out perplexity of both models.

Qwen2-MoE renormalizes the top-k router weights to sum to 1 (`norm_topk_prob`) and gates the shared
expert with a sigmoid, while the split MLP adds its parts with weight 1: the router logits are scaled
down (ROUTER_SCALE; a positive scale keeps the top-k choice) so the weights are close to 1/k and
the routed down projections are multiplied by k; the shared gate is zero (sigmoid 0.5) and the
shared down projection doubled. With every expert selected the model equals SmolLM2 (a test checks).
Calibration and held-out text come from suite prompts with their references, past the ones
workloads pick first (chat prompts from CHAT_OFFSET on, HumanEval tasks from CODE_OFFSET on).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from infer_tune import atomic, contenthash, models
from infer_tune.errors import ConfigError

ALIAS = "moe-demo"
SOURCE = "smollm2-135m"
CHAT_OFFSET = 200
CODE_OFFSET = 100
ROUTER_SCALE = 0.05
RIDGE = 1e-2
# bumped whenever what `build` computes changes: a saved model built by another version is built again
BUILDER_VERSION = 1


@dataclass
class DemoSpec:
    """How the demo MoE is built."""

    experts: int = 16
    top_k: int = 4
    shared: int = 512  # neurons always on (Qwen2-MoE's shared expert)
    calib_texts: int = 40
    max_tokens: int = 96  # per calibration text
    eval_texts: int = 8
    kmeans_iterations: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.experts < 2 or self.shared < 0:
            raise ConfigError(f"experts must be >= 2 and shared >= 0, got {self.experts} and {self.shared}")
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"top_k must be in 1..{self.experts}, got {self.top_k}")
        if self.calib_texts < 4 or self.max_tokens < 8:
            raise ConfigError("calib_texts must be >= 4 and max_tokens >= 8")


def calibration_texts(count: int, skip: int = 0) -> list[str]:
    """`count` suite texts (prompt + reference), three chat texts per code text, after the first `skip`."""
    from infer_tune.suites import SuiteSpec, load_suite

    chat = load_suite(SuiteSpec(name="chat", seed=0, max_prompt_chars=10**9))
    code = load_suite(SuiteSpec(name="code"))
    n_code, skip_code = count // 4, skip // 4
    picked = (chat[CHAT_OFFSET + skip - skip_code:][:count - n_code]
              + code[CODE_OFFSET + skip_code:][:n_code])
    return [p.text + "\n" + (p.reference or "") for p in picked]


def balanced_clusters(features: np.ndarray, clusters: int, iterations: int, seed: int) -> np.ndarray:
    """Assign rows of `features` (unit vectors) to `clusters` equal-size groups (balanced k-means)."""
    n = features.shape[0]
    size = n // clusters
    rng = np.random.default_rng(seed)
    centers = features[rng.choice(n, clusters, replace=False)]
    assign = np.zeros(n, dtype=np.int64)
    for _ in range(iterations):
        order = np.argsort(-(features @ centers.T), axis=None).tolist()
        taken = [-1] * n
        fill = [0] * clusters
        for flat in order:
            row, cluster = divmod(flat, clusters)
            if taken[row] < 0 and fill[cluster] < size:
                taken[row] = cluster
                fill[cluster] += 1
        assign = np.asarray(taken)
        centers = np.stack([features[assign == c].mean(0) for c in range(clusters)])
        centers /= np.linalg.norm(centers, axis=1, keepdims=True) + 1e-12
    return assign


def _ppl(model, batches: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    with torch.inference_mode():
        for ids in batches:
            loss = model(ids, labels=ids).loss.item()
            total += loss * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return math.exp(total / max(count, 1))


def collect(model, batches: list[torch.Tensor], progress=None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer: the MLP inputs [N, H] and the SwiGLU activations [N, I] of every calibration token."""
    layers = model.model.layers
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]
    acts: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.mlp.register_forward_pre_hook(
            lambda _m, a, i=i: inputs[i].append(a[0].reshape(-1, a[0].shape[-1]).clone())))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(
            lambda _m, a, i=i: acts[i].append(a[0].reshape(-1, a[0].shape[-1]).clone())))
    try:
        with torch.inference_mode():
            for n, ids in enumerate(batches):
                model(ids)
                if progress:
                    progress("calibration forward", n + 1, len(batches))
    finally:
        for hook in hooks:
            hook.remove()
    return ([torch.cat(x).numpy().astype(np.float64) for x in inputs],
            [torch.cat(a).numpy().astype(np.float64) for a in acts])


@dataclass
class LayerSplit:
    """One MLP split into a shared part and routed experts, with its router and how well it does."""

    shared: np.ndarray  # neuron ids always on
    groups: list[np.ndarray]  # neuron ids of each routed expert
    router: np.ndarray  # [E, H]
    error: float  # relative L2 error of the MoE MLP vs the dense MLP on held-back calibration tokens
    recall: float  # share of the true top-k experts (by output norm) the router picks


def split_layer(x: np.ndarray, act: np.ndarray, down: np.ndarray, spec: DemoSpec, seed: int) -> LayerSplit:
    """Shared neurons (largest mean output), balanced co-activation clusters, least-squares router."""
    fit = slice(0, int(len(x) * 0.8))
    check = slice(fit.stop, len(x))
    magnitude = np.abs(act) * np.linalg.norm(down, axis=0)[None, :]  # [N, I] each neuron's output size
    order = np.argsort(-magnitude[fit].mean(0))
    shared, rest = np.sort(order[:spec.shared]), np.sort(order[spec.shared:])
    profiles = magnitude[fit][:, rest].T
    profiles /= np.linalg.norm(profiles, axis=1, keepdims=True) + 1e-12
    assign = balanced_clusters(profiles, spec.experts, spec.kmeans_iterations, seed)
    groups = [rest[assign == e] for e in range(spec.experts)]
    parts = np.stack([act[:, g] @ down[:, g].T for g in groups], 1)  # [N, E, H]
    importance = np.linalg.norm(parts, axis=2)
    target = np.log(importance + 1e-6)
    target -= target.mean(1, keepdims=True)
    xf = x[fit]
    router = np.linalg.solve(xf.T @ xf + RIDGE * len(xf) * np.eye(x.shape[1]), xf.T @ target[fit]).T
    chosen = np.argsort(-(x @ router.T), 1)[:, :spec.top_k]
    truth = np.argsort(-importance, 1)[:, :spec.top_k]
    recall = float(np.mean([len(set(a) & set(b)) / spec.top_k for a, b in zip(chosen[check], truth[check])]))
    dense = act @ down.T
    approx = act[:, shared] @ down[:, shared].T + np.take_along_axis(parts, chosen[:, :, None], 1).sum(1)
    error = float(np.linalg.norm((approx - dense)[check]) / (np.linalg.norm(dense[check]) + 1e-30))
    return LayerSplit(shared=shared, groups=groups, router=router, error=error, recall=recall)


def qwen2_moe_config(dense_config, spec: DemoSpec, dense_layers: list[int]):
    from transformers import Qwen2MoeConfig

    c = dense_config
    routed = (c.intermediate_size - spec.shared) // spec.experts
    return Qwen2MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=routed, shared_expert_intermediate_size=spec.shared,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=getattr(c, "head_dim", None),
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters, tie_word_embeddings=c.tie_word_embeddings, hidden_act=c.hidden_act,
        num_experts=spec.experts, num_experts_per_tok=spec.top_k, norm_topk_prob=True, qkv_bias=False,
        mlp_only_layers=dense_layers, use_sliding_window=False, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id)


def assemble(dense, splits: dict[int, LayerSplit], spec: DemoSpec):
    """The Qwen2-MoE model: dense weights copied, MoE layers filled from their splits."""
    from transformers import Qwen2MoeForCausalLM

    layers = dense.model.layers
    dense_layers = [i for i in range(len(layers)) if i not in splits]
    moe = Qwen2MoeForCausalLM(qwen2_moe_config(dense.config, spec, dense_layers)).eval()
    state = dense.state_dict()
    size = moe.config.moe_intermediate_size
    with torch.no_grad():
        for name, tensor in moe.state_dict().items():
            if name in state:
                tensor.copy_(state[name])
        for i, split in splits.items():
            mlp, block = layers[i].mlp, moe.model.layers[i].mlp
            shared = torch.from_numpy(split.shared)
            block.shared_expert.gate_proj.weight.copy_(mlp.gate_proj.weight[shared])
            block.shared_expert.up_proj.weight.copy_(mlp.up_proj.weight[shared])
            block.shared_expert.down_proj.weight.copy_(mlp.down_proj.weight[:, shared] * 2)  # gate: sigmoid(0)
            block.shared_expert_gate.weight.zero_()
            for e, group in enumerate(split.groups):
                index = torch.from_numpy(group)
                block.experts.gate_up_proj[e, :size] = mlp.gate_proj.weight[index]
                block.experts.gate_up_proj[e, size:] = mlp.up_proj.weight[index]
                block.experts.down_proj[e] = mlp.down_proj.weight[:, index] * spec.top_k
            block.gate.weight.copy_(torch.from_numpy(split.router * ROUTER_SCALE).float())
    return moe


def build_key(spec: DemoSpec) -> dict:
    """What a saved `moe-demo` must have been built from to be reused: the spec, the source's bytes, the builder."""
    return {"spec": asdict(spec), "source_sha256": contenthash.tree_digest(models.resolve(SOURCE)),
            "builder_version": BUILDER_VERSION}


def cached_build(spec: DemoSpec) -> dict | None:
    """The saved build facts when the cached `moe-demo` was built from this spec, source and builder; else None."""
    folder = models.built_model_dir(ALIAS)
    try:
        saved = json.loads((folder / "infer_tune_source.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        return None
    if saved.get("key") != build_key(spec):
        return None
    return {**saved["built"], "path": str(folder), "cached": True}


def build(spec: DemoSpec, *, progress=None, activations=None, rebuild: bool = True) -> dict:
    """Build `moe-demo` from SmolLM2 into the model cache; returns the build facts (also saved).

    With `rebuild=False` a cached model built from the same spec, source bytes and builder version is kept
    (its saved facts come back with `cached: True`); anything else builds anew.
    """
    if not rebuild and activations is None and (facts := cached_build(spec)) is not None:
        return facts
    start = time.perf_counter()
    dense = models.load(SOURCE, dtype="float32")
    tokenizer, model = dense.tokenizer, dense.model
    if getattr(model.config, "model_type", None) != "llama" or model.config.hidden_act != "silu":
        raise ConfigError(f"the demo is built from {SOURCE}'s Llama SwiGLU MLPs; found {model.config.model_type}")
    routed = model.config.intermediate_size - spec.shared
    if routed < spec.experts or routed % spec.experts:
        raise ConfigError(f"experts ({spec.experts}) must divide the {routed} routed neurons "
                          f"({model.config.intermediate_size} minus {spec.shared} shared)")
    texts = calibration_texts(spec.calib_texts) + calibration_texts(spec.eval_texts, skip=spec.calib_texts)
    encode = [tokenizer(t, return_tensors="pt", truncation=True, max_length=spec.max_tokens)["input_ids"]
              for t in texts]
    calib, held_out = encode[:spec.calib_texts], encode[spec.calib_texts:]
    inputs, acts = activations or collect(model, calib, progress)
    splits: dict[int, LayerSplit] = {}
    for i, layer in enumerate(model.model.layers):
        splits[i] = split_layer(inputs[i], acts[i], layer.mlp.down_proj.weight.detach().numpy().astype(np.float64),
                                spec, spec.seed + i)
        if progress:
            progress("experts and routers", i + 1, len(model.model.layers))
    moe = assemble(model, splits, spec)
    result = {
        "alias": ALIAS, "source": SOURCE, "architecture": "qwen2_moe",
        "method": "MoEfication: shared neurons + balanced co-activation clusters + least-squares router",
        "experts": spec.experts, "top_k": spec.top_k, "shared_neurons": spec.shared,
        "expert_neurons": moe.config.moe_intermediate_size, "layers": len(model.model.layers),
        "layer_errors": [round(split.error, 4) for split in splits.values()],
        "router_topk_recall_mean": float(np.mean([s.recall for s in splits.values()])),
        "calibration_texts": spec.calib_texts, "calibration_tokens": int(sum(t.shape[1] for t in calib)),
        "held_out_ppl_dense": _ppl(model, held_out), "held_out_ppl_moe": _ppl(moe, held_out),
        "held_out_tokens": int(sum(t.shape[1] for t in held_out)),
    }
    target_dir = models.built_model_dir(ALIAS)
    with atomic.staged_dir(target_dir) as staging:
        moe.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if model.generation_config is not None:
            moe.generation_config = model.generation_config
            moe.generation_config.save_pretrained(staging)
        result["build_s"] = time.perf_counter() - start
        atomic.write_json(staging / "infer_tune_source.json", {"built": result, "key": build_key(spec)})
    result["path"] = str(target_dir)
    return result


def register() -> None:
    """Make `moe-demo` a model name (resolved to its cache folder once built)."""
    models.register_built_model(ALIAS, "infer-tune experts build-demo",
                                f"MoEfied {SOURCE}: Mixtral layout, experts split from SmolLM2's MLPs")
