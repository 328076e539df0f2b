"""Weights that are not a checkpoint's: a model built from its architecture's config with seeded random
values (`--weights random`), and the skeleton + per-tensor filling that lets a quantizer build a model
one Linear at a time (docs/architecture.md, "Random weights and layer-by-layer builds").

Speed does not depend on the values of the weights, so a model of any published architecture can be
measured without downloading it. Every tensor's values depend only on (seed, its qualified name), so
filling a model all at once or one layer at a time gives the same tensors, bit for bit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infer_tune.errors import ConfigError, ModelError

PRESETS_DIR = Path(__file__).parent / "architectures"
KINDS = ("pretrained", "random")
QUALITY_NA = "n/a (random weights)"


@dataclass(frozen=True)
class WeightsChoice:
    """`--weights`: the checkpoint's own weights, or random ones from `seed`."""

    kind: str = "pretrained"
    seed: int = 0

    @property
    def random(self) -> bool:
        return self.kind == "random"

    def __str__(self) -> str:
        return f"random:{self.seed}" if self.random else "pretrained"


def parse(value: str | WeightsChoice | None) -> WeightsChoice:
    """`pretrained`, `random` (seed 0) or `random:SEED`; ConfigError naming the field otherwise."""
    if isinstance(value, WeightsChoice):
        return value
    text = (value or "pretrained").strip()
    if text == "pretrained":
        return WeightsChoice()
    match = re.fullmatch(r"random(?::(\d{1,18}))?", text)
    if match:
        return WeightsChoice("random", int(match.group(1) or 0))
    raise ConfigError(f"weights must be 'pretrained', 'random' or 'random:SEED' (SEED a whole number >= 0), got '{text}'")


def presets() -> list[str]:
    """The architecture presets shipped with the project (config.json files, no weights)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def preset_path(name: str) -> Path | None:
    path = PRESETS_DIR / f"{name}.json"
    return path if re.fullmatch(r"[A-Za-z0-9][\w.-]*", name) and path.is_file() else None


def config_from_dict(data: dict, where: str) -> Any:
    """A transformers config from a config.json's contents (keys starting with '_' are the file's notes)."""
    from transformers import AutoConfig

    data = {k: v for k, v in data.items() if not k.startswith("_")}
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ModelError(f"{where} has no model_type; give a transformers config.json")
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelError(f"cannot build a config from {where}: {' '.join(str(exc).split())[:300]}") from None


def architecture_config(ref: str, *, trust_remote_code: bool = False, resolve: Callable[[str], str] | None = None
                        ) -> tuple[Any, str]:
    """(config, where it came from) of a preset name, a config.json path, a checkpoint folder, a built-in
    model (its cached folder, through `resolve`) or a Hugging Face id (AutoConfig, online or cached)."""
    preset = preset_path(ref)
    if preset is not None:
        return config_from_dict(json.loads(preset.read_text(encoding="utf-8")), f"preset {ref}"), f"preset:{ref}"
    path = Path(ref).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.name == "config.json" or path.exists():
        if not path.is_file():
            raise ModelError(f"config not found: {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read {path}: {' '.join(str(exc).split())[:200]}") from None
        if not isinstance(data, dict):
            raise ModelError(f"{path} is not a config.json object")
        return config_from_dict(data, str(path)), f"config:{path.resolve()}"
    if resolve is not None:
        location = resolve(ref)  # a built-in alias or a hub id the hub (or its cache) can serve; ModelError otherwise
        if Path(location).is_dir():
            return architecture_config(location)
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code)
        except Exception as exc:  # hub errors come in many types
            raise ModelError(f"cannot load the config of '{ref}': {' '.join(str(exc).split())[:300]}") from None
        return config, f"hub:{ref}"
    raise ModelError(f"unknown architecture '{ref}': use a preset ({', '.join(presets())}), a config.json path "
                     "or a Hugging Face id")


# --------------------------------------------------------------------------- skeletons
@contextlib.contextmanager
def parameters_on_meta():
    """New nn.Parameters of more than one dimension are created on the meta device (no memory); vectors
    (norm weights, biases) and buffers (rotary frequencies, embedding scales) stay real, keeping the
    values the model's own constructor and initializer give them."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.dim() > 1 and not param.is_meta:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def skeleton(config: Any, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """The model of `config` with its matrices on the meta device (see `parameters_on_meta`)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]), parameters_on_meta():
        torch.manual_seed(seed)  # what the constructor draws for vectors (none in the known families) is seeded
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError as exc:
            raise ModelError(f"transformers cannot build a causal LM of {type(config).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}") from None
    return model.eval()


def meta_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters take once materialised (shared tensors once), meta ones included."""
    seen, total = set(), 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: from the run's seed and the tensor's qualified name only."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


Values = Callable[[str, torch.Size, torch.dtype], torch.Tensor]


def random_values(seed: int, std: float) -> Values:
    """name, shape, dtype -> normal(0, std) values drawn in float32 from the tensor's own generator."""
    def values(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        generator = torch.Generator().manual_seed(tensor_seed(seed, name))
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator).to(dtype)

    return values


def safetensors_values(folder: Path) -> Values:
    """name, shape, dtype -> the checkpoint's tensor of that name (from whichever shard holds it), cast."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    else:
        weight_map = {}
        for shard in sorted(folder.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as handle:
                weight_map.update(dict.fromkeys(handle.keys(), shard.name))

    def values(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if name not in weight_map:
            raise ModelError(f"{folder} has no tensor '{name}'")
        with safe_open(str(folder / weight_map[name]), framework="pt") as handle:
            tensor = handle.get_tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ModelError(f"{folder}: '{name}' is {tuple(tensor.shape)}, the model wants {tuple(shape)}")
        return tensor.to(dtype)

    return values


@dataclass
class Filler:
    """Materialises a skeleton's meta parameters from `values`, in any order and any number of calls,
    keeping tied parameters one tensor (the embedding and a tied head)."""

    model: nn.Module
    values: Values
    _names: dict[int, str] = field(default_factory=dict)
    _shared: set[int] = field(default_factory=set)
    # tied tensors only (the one made for the first owner, for the others): any other filled tensor is
    # referenced by its module alone, so a quantizer that replaces the module frees it
    _done: dict[int, tuple[nn.Parameter, nn.Parameter]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if id(param) in self._names:
                self._shared.add(id(param))
            else:
                self._names[id(param)] = name  # a tied tensor is named by its first owner, as state dicts do

    @torch.no_grad()
    def __call__(self, under: nn.Module | None = None) -> int:
        """Fill every meta parameter of `under` (default: the whole model); returns the bytes made."""
        made = 0
        for module in (under if under is not None else self.model).modules():
            for key, param in list(module._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                entry = self._done.get(id(param))
                if entry is None:
                    tensor = self.values(self._names[id(param)], param.shape, param.dtype)
                    entry = (param, nn.Parameter(tensor, requires_grad=param.requires_grad))
                    if id(param) in self._shared:
                        self._done[id(param)] = entry
                    made += tensor.numel() * tensor.element_size()
                module._parameters[key] = entry[1]
        return made


@dataclass
class RandomWeights:
    """What `--weights random` loaded: the architecture, the seed, the dtype and the tokenizer used."""

    config: Any
    seed: int
    dtype: torch.dtype
    source: str  # preset:NAME, config:PATH or hub:ID
    tokenizer: str  # which tokenizer encodes the prompts (docs/commands.md "Random weights")

    @property
    def std(self) -> float:
        return float(getattr(self.config, "initializer_range", None) or 0.02)

    def values(self) -> Values:
        return random_values(self.seed, self.std)

    def skeleton(self) -> nn.Module:
        return skeleton(self.config, self.dtype, self.seed)

    def build(self) -> nn.Module:
        """The whole model, every tensor filled (the eager path)."""
        model = self.skeleton()
        Filler(model, self.values())()
        return model

    def config_digest(self) -> str:
        text = json.dumps(self.config.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def content_id(self) -> str:
        return f"random:{self.config_digest()[:16]}:seed{self.seed}:{self.tokenizer}"

    def describe(self) -> dict:
        """The result's `model` keys that say the weights were random."""
        return {"weights": "random", "weights_seed": self.seed, "architecture": self.source,
                "model_type": getattr(self.config, "model_type", None), "tokenizer": self.tokenizer}


def count_params(config: Any) -> int:
    """Parameters of `config`'s model (tied tensors once), counted on the meta device: no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen, total = set(), 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


# A build fits when its estimate is at most this share of the memory available when it starts: the rest is
# left to the prefill's activations, a checkpoint's save and reload, and the host's other processes.
FIT_FRACTION = 0.6
RUNTIME_MARGIN = 1 << 30  # activations, the tokenizer, torch's own allocations: bytes beyond weights and cache


def footprint(config: Any, bytes_per_param: float, *, params: int | None = None, context_tokens: int = 4096) -> int:
    """Bytes a model of `config` takes running with `bytes_per_param` weights (4: fp32, 2: bf16, ~1: int8):
    its parameters, an fp32 KV cache of `context_tokens` positions and RUNTIME_MARGIN."""
    params = count_params(config) if params is None else params
    text = getattr(config, "text_config", None) or config
    layers, heads = getattr(text, "num_hidden_layers", 0) or 0, getattr(text, "num_attention_heads", 0) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (getattr(text, "hidden_size", 0) or 0) // heads
    cache = 2 * layers * kv_heads * head_dim * 4 * context_tokens  # K and V in fp32
    return int(params * bytes_per_param + cache + RUNTIME_MARGIN)


def published_dtype(config: Any) -> torch.dtype | None:
    """The 16-bit float type the architecture's config says its checkpoints ship in (`torch_dtype`, or
    `dtype` in newer configs): bfloat16 or float16; None for float32 or unstated."""
    text = getattr(config, "text_config", None) or config
    for owner in (config, text):
        for key in ("torch_dtype", "dtype"):
            value = getattr(owner, key, None)
            name = str(value).removeprefix("torch.") if value is not None else ""
            if name in ("bfloat16", "float16"):
                return getattr(torch, name)
    return None


def runs_16bit_natively(dtype: torch.dtype, flags: list[str]) -> bool:
    """Whether this CPU computes in `dtype` itself (AVX-512 BF16 / AMX for bfloat16, AVX-512 FP16 / AMX for
    float16) rather than converting to float32 around every product (`flags`: env.cpu_flags)."""
    needed = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
    return any(f in flags for f in needed.get(dtype, ()))


def fits(need: int, available: int) -> bool:
    """Whether a build estimated at `need` bytes fits in `available` (FIT_FRACTION of it)."""
    return need <= FIT_FRACTION * available


_LIBC: Any = None


def release_freed_memory() -> None:
    """Hand memory freed by dropped tensors back to the OS (glibc's malloc_trim; a no-op elsewhere).

    After a few megabyte-sized frees glibc raises its mmap threshold, so later tensors come from the
    heap and freed ones stay resident: a layer-by-layer build measured +144 MB of RSS for a 21 MB
    quantized model (143 MB in float32), and +54 MB with this call after each layer.
    """
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


# --------------------------------------------------------------------------- tokenizers
def byte_tokenizer():
    """A byte-level tokenizer of 259 ids (256 bytes, <pad>, <eos>, <bos>): fits any vocabulary of 259+."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: i for i, char in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    return fast


def vocab_size(config: Any) -> int:
    text = getattr(config, "text_config", None)
    return int(getattr(config, "vocab_size", None) or getattr(text, "vocab_size", 0) or 0)
