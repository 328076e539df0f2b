"""The speculate config: one (draft source, draft length K, engine) pair measured against the target alone.

`draft` names the source in one string, the result's `config.draft`:

- `prompt-lookup`: n-gram lookup in the prompt and the text so far (no model);
- `self-draft:N`: the target's own first N layers with its embeddings, final norm and head;
- `early-exit:N`: transformers' `assistant_early_exit` (the target exits after N layers to draft);
- anything else: a draft model reference (alias, Hugging Face id, checkpoint dir or .gguf file).

`engine` chooses who runs the speculative loop: `hf` is transformers' assisted generation
(`generate(assistant_model=...)`, `prompt_lookup_num_tokens`, `assistant_early_exit`, universal
assisted generation for another tokenizer); `lean` is infer-tune's own loop (infer_tune.tuners.speculate.lean):
one prefill, then rounds of K draft steps and one verify pass, with KV-cache rollback and no
per-round `generate` call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from infer_tune.engines.base import LEAN, TORCH, config_engine, spelled
from infer_tune.errors import ConfigError
from infer_tune.tuners.base import TechniqueConfig

# the in-process engines as this config's `engine` field and its results name them (engines/inprocess.py)
HF_ENGINE, LEAN_ENGINE = spelled(TORCH, "speculate"), spelled(LEAN, "speculate")
PROMPT_LOOKUP = "prompt-lookup"
SELF_DRAFT = "self-draft"
EARLY_EXIT = "early-exit"


@dataclass(frozen=True)
class DraftSource:
    """A parsed `draft` string: its kind (model, self-draft, early-exit, prompt-lookup) and value."""

    kind: str
    layers: int | None = None
    ref: str | None = None

    @property
    def uses_model(self) -> bool:
        return self.kind in ("model", SELF_DRAFT, EARLY_EXIT)


def parse_draft(text: str) -> DraftSource:
    """`prompt-lookup`, `self-draft:N`, `early-exit:N` or a model reference -> DraftSource."""
    text = (text or "").strip()
    if not text:
        raise ConfigError("speculate draft must name a source: prompt-lookup, self-draft:N, early-exit:N or a model")
    if text == PROMPT_LOOKUP:
        return DraftSource(PROMPT_LOOKUP)
    for kind in (SELF_DRAFT, EARLY_EXIT):
        if text.startswith(kind + ":") or text == kind:
            value = text.partition(":")[2]
            try:
                layers = int(value)
            except ValueError:
                raise ConfigError(f"speculate draft '{text}': {kind} needs a layer count, e.g. {kind}:4") from None
            if layers < 1:
                raise ConfigError(f"speculate draft '{text}': the layer count must be >= 1, got {layers}")
            return DraftSource(kind, layers=layers)
    return DraftSource("model", ref=text)


@dataclass
class SpeculateConfig(TechniqueConfig):
    """One draft source at one draft length K (`num_draft_tokens`), run by one engine.

    `max_matching_ngram_size` applies to prompt lookup (the longest suffix n-gram searched for);
    `draft_vocab` (lean engine, a draft made by `speculate distill`) cuts the draft's output head to
    the tokens the target emitted most in the distillation data, plus each prompt's own tokens.
    `native_step` (lean engine) runs the target's prefill and verify passes in the native decode step
    (int4 / int8 layers with int8 activations: infer_tune/native/step.py); a model it does not run keeps the
    target's own forward, the reason in `speculate_native_fallback`.
    """

    technique: ClassVar[str] = "speculate"
    max_batch_size: ClassVar[int] = 1  # one sequence at a time

    draft: str = PROMPT_LOOKUP
    num_draft_tokens: int = 4
    engine: str = HF_ENGINE
    max_matching_ngram_size: int | None = None
    draft_vocab: int | None = None
    draft_digest: str | None = None  # set by the registry's resolve: which weights a draft directory held
    native_step: bool = False  # lean engine: the target's passes run in the native decode step (step.cpp)

    def __post_init__(self) -> None:
        source = parse_draft(self.draft)
        if isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int) \
                or self.num_draft_tokens < 1:
            raise ConfigError(f"speculate num_draft_tokens must be an integer >= 1 (tokens proposed per verify "
                              f"pass), got {self.num_draft_tokens!r}")
        self.engine = config_engine(self.engine, technique="speculate", where="speculate engine")
        if source.kind == PROMPT_LOOKUP:
            self.max_matching_ngram_size = 2 if self.max_matching_ngram_size is None else self.max_matching_ngram_size
            if self.max_matching_ngram_size < 1:
                raise ConfigError(f"speculate max_matching_ngram_size must be >= 1, got {self.max_matching_ngram_size}")
        elif self.max_matching_ngram_size is not None:
            raise ConfigError("speculate max_matching_ngram_size applies to draft 'prompt-lookup' only, "
                              f"got draft '{self.draft}'")
        if self.draft_vocab is not None:
            if self.draft_vocab < 1:
                raise ConfigError(f"speculate draft_vocab must be >= 1, got {self.draft_vocab}")
            if self.engine != LEAN_ENGINE or source.kind != "model":
                raise ConfigError("speculate draft_vocab cuts the head of a draft model in the lean engine; got "
                                  f"draft '{self.draft}' with engine '{self.engine}'")
        if self.native_step and self.engine != LEAN_ENGINE:
            raise ConfigError(f"speculate native_step verifies in the lean engine's loop; got engine '{self.engine}'")
        if source.kind == EARLY_EXIT and self.engine != HF_ENGINE:
            raise ConfigError("speculate draft early-exit is transformers' own loop (engine 'hf'); the lean "
                              "engine's equivalent is self-draft:N")

    @property
    def source(self) -> DraftSource:
        return parse_draft(self.draft)

    def runs_on(self) -> str | None:
        return LEAN if self.engine == LEAN_ENGINE else None  # hf: the torch engine's assisted generation

    def label(self) -> str:
        source = self.source
        name = {"model": _short(source.ref or ""), PROMPT_LOOKUP: "lookup"}.get(
            source.kind, f"{source.kind}{source.layers}")
        if source.kind == PROMPT_LOOKUP and self.max_matching_ngram_size != 2:
            name += f"-ngram{self.max_matching_ngram_size}"
        if self.draft_vocab is not None:
            name += f"-v{self.draft_vocab}"
        return f"{name}-k{self.num_draft_tokens}" + ("-lean" if self.engine == LEAN_ENGINE else "") \
            + ("-native" if self.native_step else "")


def _short(ref: str) -> str:
    """The last path component of a model reference (a label, not an identity)."""
    return ref.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf") or ref


def parse_draft_lengths(text: str) -> list[int]:
    """`2,4,8` -> [2, 4, 8]; each must be an integer >= 1."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"num_draft_tokens must be comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise ConfigError(f"num_draft_tokens must be integers >= 1 (tokens proposed per verify pass), got '{text}'")
    return list(dict.fromkeys(values))
