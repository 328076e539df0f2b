"""Save a quantized model as a checkpoint directory (no pickle) and load it back.

Layout of a saved directory:
  config.json, tokenizer files      the transformers config and tokenizer, as for any checkpoint
  model.safetensors                 float tensors by their usual names; each quantized layer's portable
                                    tensors under its name (`<layer>.qweight` int8, `<layer>.weight_scale`,
                                    `<layer>.qweight_int4` uint8 two-per-byte, `.scale`, `.zero`, ...); an
                                    int4 a8 layer its kernel's layout (`<layer>.qweight_w4a8` uint8, scales and
                                    zeros inside, `.out_features`), an int8 a8 head its own (`.qweight_w8a8`
                                    int8, `.weight_scale`): what the w4a8 / w8a8 kernels and the native step read
  quantization.json                 method, backend, layer kinds, scales summary, library versions

Loading builds the model from config.json on the meta device, swaps in the quantized modules named by
quantization.json from their tensors, and assigns the remaining float tensors (a missing one is an error).
The tensors are safetensors' memory-mapped ones: an int4 a8 / int8 a8 layer holds the mapped bytes of its
kernel's layout as they are (no copy, no float weights), so the weights are resident once, as the file's pages.
Format version 1 (int4 a8 layers as `qweight_int4`, `scale`, `zero`; the int8 a8 head as `qweight`) still loads:
those layers are packed on load.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import torch
from torch import nn

from infer_tune import atomic, hub, jsonsafe, weights
from infer_tune.errors import ModelError
from infer_tune.nn_utils import set_module
from infer_tune.tuners.quantize import wrap
from infer_tune.tuners.quantize.config import QuantizeConfig
from infer_tune.tuners.quantize.modules import LINEAR_KINDS

FORMAT = "infer-tune-quantized"
FORMAT_VERSION = 2  # 2: int4 a8 / int8 a8 layers saved in their kernels' layouts
READ_VERSIONS = (1, 2)
MANIFEST = "quantization.json"


def library_versions() -> dict[str, str | None]:
    versions = {}
    for package in ("torch", "transformers", "optimum-quanto", "torchao", "safetensors"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with every tensor stored once (tied tensors keep their first name), contiguous."""
    seen: set[tuple[int, int, tuple]] = set()
    state = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        state[name] = tensor.detach().contiguous()
    return state


def save_quantized(model: nn.Module, tokenizer, target: Path, manifest: dict) -> Path:
    """Write the checkpoint to `target` atomically (a staged folder renamed at the end)."""
    from safetensors.torch import save_file

    from infer_tune.models import model_bytes

    atomic.check_free_space(Path(target).parent, model_bytes(model) + (64 << 20), f"the quantized model {Path(target).name}")
    with atomic.staged_dir(Path(target)) as staging:
        model.config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if manifest["backend"] == "quanto":  # quanto modules flatten their QTensors into plain tensors
            from optimum.quanto import quantization_map

            manifest = {**manifest, "quantization_map": quantization_map(model)}
        save_file(unique_state(model), str(staging / "model.safetensors"), metadata={"format": "pt"})
        full = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "versions": library_versions()}
        atomic.write_json(staging / MANIFEST, full)
    return Path(target)


def read_manifest(path: str | Path) -> dict:
    file = Path(path) / MANIFEST
    try:
        manifest = jsonsafe.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {file}: {exc}") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") not in READ_VERSIONS:
        raise ModelError(f"{file} is not an infer-tune quantized checkpoint of format version "
                         f"{' or '.join(map(str, READ_VERSIONS))}")
    return manifest


def load_quantized(path: str | Path, *, choose_kernels: bool = True) -> nn.Module:
    """Rebuild the quantized model saved in `path` (CPU, eval mode).

    `choose_kernels`: run the fastest candidate kernels on this host (kernels.py), from the screen `quantize`
    kept on this host for these shapes when there is one, else timed now; the record is kept on the model as
    `infer_tune_kernels`.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    manifest = read_manifest(path)
    config = QuantizeConfig(**manifest["config"])
    if manifest["method"] == "bf16":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, use_safetensors=True,
                                                     trust_remote_code=False, **hub.PLAIN_MODULES)
        return model.eval()
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=False)  # a saved dir never runs its code
    # the matrices on the meta device: the saved tensors replace them (quantized layers swapped in, the rest
    # assigned), so no float copy of the model is ever built (at 1B that copy alone was 4.9 GB of fp32)
    model = weights.skeleton(hf_config, torch.float32)
    state = load_file(str(path / "model.safetensors"))
    if manifest["backend"] == "quanto":
        from optimum.quanto import requantize

        requantize(model, state, manifest["quantization_map"], device=torch.device("cpu"))
        return model.eval()
    summary = manifest["summary"]
    for name, kind in summary["layers"].items():
        layer = LINEAR_KINDS[kind].from_portable(_take(state, name), group_size=config.group_size)
        _check_shape(path, name, model, layer)
        set_module(model, name, layer)
    _load_embeddings_and_head(model, state, summary, config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    head = model.get_output_embeddings()
    if isinstance(getattr(head, "weight", None), torch.Tensor) and head.weight.is_meta:  # a float head tied to
        model.tie_weights()  # the embedding: assigning the embedding's table left the head's meta one behind
    if unexpected:
        raise ModelError(f"{path}: unexpected tensors {', '.join(unexpected[:3])}; the checkpoint does not match "
                         f"{MANIFEST}")
    float_missing = [k for k in missing if not k.endswith("inv_freq")]
    left_on_meta = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if float_missing or left_on_meta:
        raise ModelError(f"{path}: missing tensors {', '.join((float_missing or left_on_meta)[:3])}")
    from infer_tune.tuners.quantize.apply import apply_compute_dtype

    apply_compute_dtype(model, config)
    if choose_kernels:
        from infer_tune.tuners.quantize.kernel_choice import choose_for_model

        model.infer_tune_kernels = choose_for_model(model, manifest["method"], group_size=config.group_size,
                                                    forced=config.forced_kernels(), activations=config.activations,
                                                    keep="reuse")
    return model.eval()


def _check_shape(path: Path, name: str, model: nn.Module, layer: nn.Module) -> None:
    """A saved layer must have the shape the model's config gives it: a checkpoint whose manifest and tensors
    agree on a cut `q_proj` (192 outputs for 576) is refused here (ModelError: `cannot load model`, exit 2),
    not in a kernel at the first forward pass."""
    try:
        original = model.get_submodule(name)
    except AttributeError:
        raise ModelError(f"{path}: {name} is not a layer of the model its config.json describes") from None
    want = (getattr(original, "in_features", None), getattr(original, "out_features", None))
    got = (getattr(layer, "in_features", None), getattr(layer, "out_features", None))
    if None not in want and got != want:
        raise ModelError(f"cannot load model {path}: {name} is saved as {got[0]} -> {got[1]} features but config.json makes it "
                         f"{want[0]} -> {want[1]}; the checkpoint is damaged or was altered")


def _load_embeddings_and_head(model: nn.Module, state: dict, summary: dict, config: QuantizeConfig) -> None:
    from infer_tune.tuners.quantize.apply import build_head

    emb_name = _module_name(model, model.get_input_embeddings())
    head_name = _module_name(model, model.get_output_embeddings())
    if summary.get("embedding", {}).get("bits"):  # wrapped in place: the family's own forward still runs
        tensors = _take(state, emb_name)
        wrap.wrap_embedding(model.get_input_embeddings(), tensors,
                            config.group_size if "qweight_int4" in tensors else None)
        if summary["embedding"]["tied_head"]:
            model.set_output_embeddings(build_head(tensors, config, tied=True))
            return
    if summary.get("head", {}).get("kind"):
        model.set_output_embeddings(build_head(_take(state, head_name), config, tied=False))


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _take(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Pop the tensors of module `prefix` from `state`, keyed by their local names."""
    keys = [k for k in state if k.startswith(prefix + ".") and "." not in k[len(prefix) + 1:]]
    if not keys:
        raise ModelError(f"checkpoint has no tensors for quantized layer {prefix}")
    return {k[len(prefix) + 1:]: state.pop(k) for k in keys}

