"""Draft models: loaded once per run, checked against the target's tokenizer, or cut from the target itself.

- `load_draft`: a draft model by reference through the run context (same device and dtype), cached
  in `ctx.cache` so a sweep over K loads it once.
- `tokenizer_relation`: `same` (identical vocabularies: token ids are interchangeable), `universal`
  (another tokenizer that transformers' universal assisted generation can bridge) or a refusal.
- `self_draft`: the target's first N decoder layers with its embeddings, final norm and head, as a
  model of the same class whose modules ARE the target's (no copy).
- `early_exit_supported`: whether the model honours a lowered `num_hidden_layers` at run time (what
  transformers' `assistant_early_exit` relies on), checked by counting the decoder layers that run.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from infer_tune import jsonsafe, models
from infer_tune.errors import ConfigError
from infer_tune.tuners.base import RunContext
from infer_tune.tuners.speculate.config import HF_ENGINE

DISTILL_MANIFEST = "infer_tune_distill.json"
LAYER_LISTS = ("layers", "h", "blocks")


def load_draft(ctx: RunContext, ref: str) -> models.LoadedModel:
    """The draft model `ref` on the run's device and dtype, loaded once per run."""
    cache = ctx.cache.setdefault("speculate.drafts", {})
    if ref not in cache:
        cache[ref] = ctx.load_model(ref)
    return cache[ref]


def universal_path_available() -> bool:
    """Whether this transformers has universal assisted generation (drafts with another tokenizer)."""
    try:
        from transformers.generation import candidate_generator
    except ImportError:
        return False
    return hasattr(candidate_generator, "AssistedCandidateGeneratorDifferentTokenizers")


def _vocab_size(model: torch.nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.vocab_size)


def tokenizer_relation(target: models.LoadedModel, draft: models.LoadedModel, *, engine: str = HF_ENGINE) -> str:
    """`same` or `universal`; raises ConfigError when the draft's tokens cannot be checked by the target.

    transformers decides the path by the models' vocabulary sizes: equal sizes mean "same tokenizer"
    (token ids are fed across as they are), different sizes go through universal assisted generation
    (text re-tokenized each round). Two different tokenizers of equal vocabulary size have no path.
    """
    same_vocab = target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    same_size = _vocab_size(target.model) == _vocab_size(draft.model)
    if same_vocab and same_size:
        return "same"
    why = (f"draft '{draft.ref}' uses another tokenizer than the target '{target.ref}' "
           f"({len(draft.tokenizer)} vs {len(target.tokenizer)} tokens)" if not same_vocab else
           f"draft '{draft.ref}' has the target's tokenizer but another vocabulary size "
           f"({_vocab_size(draft.model)} vs {_vocab_size(target.model)})")
    if engine != HF_ENGINE:
        raise ConfigError(f"{why}; the lean engine feeds token ids across and needs the same tokenizer "
                          "(use engine 'hf' for universal assisted generation)")
    if not universal_path_available():
        raise ConfigError(f"{why}, and this transformers has no universal assisted generation "
                          "(AssistedCandidateGeneratorDifferentTokenizers); use a draft with the target's tokenizer")
    if same_size:
        raise ConfigError(f"{why}, with the same vocabulary size ({_vocab_size(draft.model)}): transformers "
                          "tells tokenizers apart by vocabulary size, so it would feed the draft's ids to the "
                          "target unchecked; there is no universal path for this pair")
    return "universal"


def decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.ModuleList]:
    """(base model, attribute name, list) of a decoder-only model's layer stack."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    for name in LAYER_LISTS:
        layers = getattr(base, name, None) if base is not None else None
        if isinstance(layers, torch.nn.ModuleList):
            return base, name, layers
    raise ConfigError(f"cannot find the decoder layer stack of {type(model).__name__} "
                      f"(looked for {', '.join(LAYER_LISTS)} on its base model); self-draft needs one")


def num_layers(model: torch.nn.Module) -> int:
    return len(decoder_layers(model)[2])


def truncated_config(config, layers: int):
    """A copy of `config` with `layers` decoder layers (per-layer lists such as `layer_types` cut too)."""
    data = config.to_dict()
    for key, value in list(data.items()):
        if isinstance(value, list) and len(value) == config.num_hidden_layers and key.endswith("layer_types"):
            data[key] = value[:layers]
    data["num_hidden_layers"] = layers
    for alias in ("n_layer", "num_layers"):
        if alias in data:
            data[alias] = layers
    return type(config).from_dict(data)


def self_draft(target: torch.nn.Module, layers: int, *, share: bool = True) -> torch.nn.Module:
    """The target's first `layers` decoder layers + its embeddings, final norm and head, as a model.

    `share=True` reuses the target's modules (no memory; for measuring an untrained self-draft);
    `share=False` deep-copies them (a trainable draft for distillation).
    """
    total = num_layers(target)
    if not 1 <= layers < total:
        raise ConfigError(f"self-draft layers must be between 1 and {total - 1} (the target has {total} "
                          f"decoder layers), got {layers}")
    config = truncated_config(target.config, layers)
    with torch.device("meta"):
        draft = type(target)(config)
    source = target if share else copy.deepcopy(target)
    _, name, _ = decoder_layers(source)
    src_base = getattr(source, source.base_model_prefix)
    dst_base = getattr(draft, draft.base_model_prefix)
    for child_name, child in src_base.named_children():
        setattr(dst_base, child_name, torch.nn.ModuleList(list(child)[:layers]) if child_name == name else child)
    for child_name, child in source.named_children():
        if child_name != source.base_model_prefix:
            setattr(draft, child_name, child)
    leftovers = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if leftovers:
        raise ConfigError(f"cannot build a self-draft of {type(target).__name__}: {leftovers[0]} has no counterpart "
                          "in the target")
    draft.generation_config = copy.deepcopy(target.generation_config)
    draft.eval()
    return draft


def early_exit_supported(model: torch.nn.Module, layers: int) -> bool:
    """True when setting `num_hidden_layers` to `layers` really runs only that many decoder layers."""
    base, _, stack = decoder_layers(model)
    calls: list[int] = []
    handles = [layer.register_forward_hook(lambda *_: calls.append(1)) for layer in stack]
    original = base.config.num_hidden_layers
    try:
        base.config.num_hidden_layers = layers
        with torch.inference_mode():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device),
                  use_cache=False)
    except Exception:  # a model whose code reads the layer count elsewhere breaks instead: not supported either
        return False
    finally:
        base.config.num_hidden_layers = original
        for handle in handles:
            handle.remove()
    return len(calls) == layers


def unshared_bytes(draft: torch.nn.Module, target: torch.nn.Module) -> int:
    """Bytes of the draft's tensors that are not the target's own (a sharing self-draft: 0)."""
    target_storages = {t.untyped_storage().data_ptr() for t in target.state_dict().values()}
    seen: set[int] = set()
    total = 0
    for value in draft.state_dict().values():
        ptr = value.untyped_storage().data_ptr()
        if ptr in target_storages or ptr in seen:
            continue
        seen.add(ptr)
        total += models.tensor_bytes(value)
    return total


def draft_digest(ref: str) -> str | None:
    """A short digest of a local draft directory's files (names, sizes, modification times), so a result
    and `--resume` tell a re-trained draft in the same folder from the old one (None: not a local dir)."""
    import hashlib

    folder = Path(models.resolve(ref))
    if not folder.is_dir():
        return None
    listing = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir() if f.is_file())
    return hashlib.sha256(repr(listing).encode()).hexdigest()[:12]


def distill_manifest(ref: str) -> dict | None:
    """What `speculate distill` recorded about a draft directory (None for any other draft)."""
    path = Path(ref).expanduser() / DISTILL_MANIFEST
    if not path.is_file():
        return None
    try:
        return jsonsafe.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
