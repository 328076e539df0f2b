"""Teacher-forced perplexity of a model on the suite references, given the prompts."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# (context ids, target ids): the targets scored, each given the context and the targets before it
Scored = tuple[list[int], list[int]]


def reference_sequences(tokenizer, prompts: Sequence[str], references: Sequence[str | None], *,
                        max_reference_tokens: int = 128) -> list[Scored]:
    """What `reference_perplexity` scores: each rendered prompt's ids (no special tokens added) as the context,
    the first `max_reference_tokens` ids of its reference as the targets (prompts without a reference left out)."""
    scored = []
    for prompt, reference in zip(prompts, references):
        if not reference:
            continue
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ref_ids = tokenizer(reference, add_special_tokens=False)["input_ids"][:max_reference_tokens]
        if ref_ids:
            scored.append((prompt_ids, ref_ids))
    return scored


@torch.inference_mode()
def sequence_nll(model: torch.nn.Module, scored: Sequence[Scored], *, device: str = "cpu") -> tuple[float, int]:
    """(summed NLL of every target, number of targets): one teacher-forced forward per sequence, no cache."""
    total_nll, total_tokens = 0.0, 0
    for context, targets in scored:
        ids = torch.tensor([context + targets], device=device)  # [1, P+R]
        logits = model(input_ids=ids, use_cache=False).logits[0, len(context) - 1:-1].float()  # [R, V]
        total_nll += float(torch.nn.functional.cross_entropy(logits, ids[0, len(context):], reduction="sum"))
        total_tokens += len(targets)
    return total_nll, total_tokens


def perplexity(nll: float, tokens: int) -> float | None:
    return math.exp(nll / tokens) if tokens else None


def reference_perplexity(
    model: torch.nn.Module, tokenizer, prompts: Sequence[str], references: Sequence[str | None],
    *, max_reference_tokens: int = 128, device: str = "cpu", scorer=None,
) -> float | None:
    """exp(mean NLL of the reference tokens), each reference conditioned on its rendered prompt.

    Stays sensitive to small weight changes when BLEU against references is near its floor.
    """
    scored = reference_sequences(tokenizer, prompts, references, max_reference_tokens=max_reference_tokens)
    if scorer is not None:  # the row decodes with something the eager forward does not compute (PreparedModel)
        return perplexity(*scorer(scored))
    return perplexity(*sequence_nll(model, scored, device=device))
