"""A workload (suite + sample size + seed + generation settings), the measurement protocol, and the
workload's inputs (selected prompts, rendered and tokenized into batches).

Light on purpose: reading a recipe imports this module, not torch or transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from infer_tune.errors import ConfigError
from infer_tune.suites import Prompt, SuiteSpec, iter_suite

if TYPE_CHECKING:
    import torch


TARGET_ON = ("all", "objective")  # Protocol.target_on


@dataclass
class Protocol:
    """Warmup and repetition rules for a timed measurement (docs/architecture.md, "Measurement protocol")."""

    warmup: int = 1
    min_iterations: int = 2
    min_duration_s: float = 5.0
    pin_length: bool = True
    # interleaved rounds (docs/architecture.md, "The sweep engine"): stop when the 95% interval
    # half-width of every ratio the target is on is within the target, or after max_rounds, or when
    # max_duration_s has passed. `target_on`: "all" (decode, TTFT and throughput ratios) or "objective"
    # (the one ratio each row is ranked on; its other ratios keep the interval those rounds gave)
    target_half_width_pct: float = 2.0
    max_rounds: int = 20
    max_duration_s: float = 300.0
    target_on: str = "all"

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.min_iterations < 1:
            raise ConfigError(f"min_iterations must be >= 1, got {self.min_iterations}")
        if not 0 <= self.min_duration_s < float("inf"):
            raise ConfigError(f"min_duration_s must be a finite number >= 0 seconds, got {self.min_duration_s}")
        if not 0 < self.target_half_width_pct < 100:
            raise ConfigError(f"target_half_width_pct must be in (0, 100), got {self.target_half_width_pct}")
        if self.max_rounds < 2:
            raise ConfigError(f"max_rounds must be >= 2 (an interval needs two rounds), got {self.max_rounds}")
        if not 0 <= self.max_duration_s < float("inf"):
            raise ConfigError(f"max_duration_s must be a finite number >= 0 seconds, got {self.max_duration_s}")
        if self.target_on not in TARGET_ON:
            raise ConfigError(f"target_on must be one of {', '.join(TARGET_ON)}, got {self.target_on!r}")


@dataclass
class Workload:
    """What to generate: validated on construction so bad input fails before any model loads."""

    suite: str = "chat"
    limit: int | None = 8
    seed: int = 0
    max_new_tokens: int = 64
    batch_size: int = 1
    chat_template: bool = True
    max_prompt_tokens: int = 512
    lang: str = "en"
    prompt_field: str = "prompt"
    reference_field: str | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be >= 1, got {self.limit}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")

    def suite_spec(self) -> SuiteSpec:
        return SuiteSpec(name=self.suite, limit=None, seed=self.seed, lang=self.lang,
                         prompt_field=self.prompt_field, reference_field=self.reference_field,
                         max_prompt_chars=self.max_prompt_tokens * 8)

    def to_dict(self) -> dict:
        return asdict(self)


def render_prompt(tokenizer, text: str, chat_template: bool) -> str:
    """The prompt as the model sees it: wrapped in the chat template when asked and available."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text


def load_prompts(workload: Workload) -> list[Prompt]:
    """All the suite's prompts in deterministic order (call before loading a model: bad suites fail fast).
    `iter_prompts` builds only those that are used."""
    return list(iter_suite(workload.suite_spec()))


def iter_prompts(workload: Workload) -> Iterator[Prompt]:
    """The suite's prompts in deterministic order, built lazily: selection stops at `limit`, so a large
    suite costs only what is used (call before loading a model: bad suites fail here, fast)."""
    return iter_suite(workload.suite_spec())


def select_prompts(workload: Workload, tokenizer, prompts: Iterable[Prompt] | None = None) -> tuple[list[Prompt], list[str]]:
    """Keep, in the suite's deterministic order, the first `limit` prompts that fit in the token cap."""
    chosen: list[Prompt] = []
    rendered: list[str] = []
    for prompt in prompts if prompts is not None else iter_prompts(workload):
        text = render_prompt(tokenizer, prompt.text, workload.chat_template)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) > workload.max_prompt_tokens:
            continue
        chosen.append(prompt)
        rendered.append(text)
        if workload.limit and len(chosen) >= workload.limit:
            break
    if not chosen:
        raise ConfigError(f"no prompt of suite '{workload.suite}' fits in max_prompt_tokens={workload.max_prompt_tokens}")
    return chosen, rendered


def uses_template(tokenizer, workload: Workload) -> bool:
    return bool(workload.chat_template and getattr(tokenizer, "chat_template", None))


def encode_batches(
    tokenizer, texts: list[str], batch_size: int, *, add_special_tokens: bool = False
) -> list[dict[str, torch.Tensor]]:
    """Left-padded batches, always with an attention mask (pad ids can occur inside chat prompts).

    A chat-templated prompt already holds its special tokens; raw text gets the tokenizer's own (BOS).
    """
    tokenizer.padding_side = "left"
    batches = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                        add_special_tokens=add_special_tokens)
        batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return batches


@dataclass
class Inputs:
    """The workload's prompts as a runner sees them: chosen, rendered (chat template) and tokenized."""

    prompts: list[Prompt]
    rendered: list[str]
    batches: list
    templated: bool


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def max_positions(config) -> int | None:
    """The model's context length from its config (the first of the usual names), if it states one."""
    for obj in (config, getattr(config, "text_config", None)):
        for key in CONTEXT_KEYS:
            value = getattr(obj, key, None) if obj is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def check_context(config, prompt_tokens: int, max_new_tokens: int, model: str, *, prompt: str | None = None) -> None:
    """Prompt (padded batch width) + generated tokens must fit the model's positions: refuse up front
    instead of running far past what the model can attend to."""
    limit = max_positions(config)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        room = limit - prompt_tokens
        hint = f"use max_new_tokens <= {room}" if room >= 1 else "use shorter prompts (max_prompt_tokens)"
        prompt = prompt or f"the longest prompt ({prompt_tokens} tokens)"
        raise ConfigError(f"{prompt} + max_new_tokens {max_new_tokens} = "
                          f"{prompt_tokens + max_new_tokens} tokens exceeds {model}'s context of {limit} positions; "
                          f"{hint}")


def prepare_inputs(loaded, workload: Workload, prompts: list[Prompt] | None = None) -> Inputs:
    """Select the prompts that fit, render them (chat template) and tokenize them into batches."""
    prompts, rendered = select_prompts(workload, loaded.tokenizer, prompts)
    templated = uses_template(loaded.tokenizer, workload)
    batches = encode_batches(loaded.tokenizer, rendered, workload.batch_size, add_special_tokens=not templated)
    check_context(getattr(loaded.model, "config", None), max(b["input_ids"].shape[1] for b in batches),
                  workload.max_new_tokens, loaded.ref)
    return Inputs(prompts=prompts, rendered=rendered, batches=batches, templated=templated)


def rebatched(inputs: Inputs, tokenizer, batch_size: int) -> Inputs:
    """The same prompts encoded into left-padded batches of `batch_size` (a per-config workload's batch size)."""
    return Inputs(prompts=inputs.prompts, rendered=inputs.rendered, templated=inputs.templated,
                  batches=encode_batches(tokenizer, inputs.rendered, batch_size, add_special_tokens=not inputs.templated))


def workload_block(workload: Workload, inputs: Inputs) -> dict:
    """The result's `workload` section: the settings plus what was really run."""
    block = workload.to_dict()
    block.update({"prompts": len(inputs.prompts), "chat_template_applied": inputs.templated})
    return block
