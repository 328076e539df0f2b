"""Teacher-forced perplexity of a model on the suite references, given the prompts."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


@torch.inference_mode()
def reference_perplexity(
    model: torch.nn.Module, tokenizer, prompts: Sequence[str], references: Sequence[str | None],
    *, max_reference_tokens: int = 128, device: str = "cpu",
) -> float | None:
    """exp(mean NLL of the reference tokens), each reference conditioned on its rendered prompt.

    Stays sensitive to small weight changes when BLEU against references is near its floor.
    """
    total_nll = 0.0
    total_tokens = 0
    for prompt, reference in zip(prompts, references):
        if not reference:
            continue
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ref_ids = tokenizer(reference, add_special_tokens=False)["input_ids"][:max_reference_tokens]
        if not ref_ids:
            continue
        ids = torch.tensor([prompt_ids + ref_ids], device=device)  # [1, P+R]
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1:-1].float()  # [R, V]
        nll = torch.nn.functional.cross_entropy(logits, ids[0, len(prompt_ids):], reduction="sum")
        total_nll += float(nll)
        total_tokens += len(ref_ids)
    return math.exp(total_nll / total_tokens) if total_tokens else None
