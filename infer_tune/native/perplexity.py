"""Teacher-forced perplexity through the native decode step: what the lean path's `native_step` computes for
every generated token, scored on text (docs/results.md, "Gemma-3-270M: the native step on real weights").

`ppl` in a result is the eager forward's (metrics/perplexity.py): the lean technique does not change it
(`measure_ppl=False`), since its prefill and step compute the eager model's values. This is the check of
that claim on real weights: each sequence's context prefilled by the eager model into the step's plain
cache (as the lean loop prefills a prompt), then every target but the last fed to `NativeStep` one position
at a time, so every target after the first is predicted by step.cpp's logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer_tune.metrics.perplexity import Scored


@torch.inference_mode()
def native_rows_nll(model: torch.nn.Module, parts: dict, scored: Sequence[Scored], kv_dtype: str = "fp32",
                    chunk: int = 128) -> tuple[float, int]:
    """(summed NLL, targets) entirely through the native step on its own cache (`NativeCache`, fp32 or int8): each
    sequence's context and targets run as rows of `step_mixed` (`chunk` a call), every row writing its keys and
    values into the cache before the rows after it attend to them, as the prompt and the decoded tokens do when
    the step serves; each target is scored from the row before it. The `ppl` of a row decoding on the int8 cache
    (PreparedModel.scorer)."""
    from infer_tune.native.step import NativeCache, NativeCachedStep

    total_nll, total_tokens = 0.0, 0
    for context, targets in scored:
        ids = torch.tensor(context + targets[:-1], dtype=torch.long)  # row i predicts token i + 1
        step = NativeCachedStep(model, NativeCache(parts, 1, -(-len(ids) // 128) * 128, kv_dtype), parts, chunk)
        logits = step.rows(ids, 0, len(context) - 1).float()  # from the row that predicts the first target
        total_nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(targets), reduction="sum"))
        total_tokens += len(targets)
    return total_nll, total_tokens


@torch.inference_mode()
def native_sequence_nll(model: torch.nn.Module, parts: dict, scored: Sequence[Scored]) -> tuple[float, int]:
    """(summed NLL of every target, number of targets) with `recognize(model)`'s `parts`: the first target
    from the eager prefill's last logits, each later one from the native step at the position before it."""
    from infer_tune.native.step import NativeStep, plain_cache

    total_nll, total_tokens = 0.0, 0
    for context, targets in scored:
        cache = plain_cache(model.config, len(context) + len(targets))
        rows = [model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True,
                      cache_position=torch.arange(len(context)), logits_to_keep=1).logits[0, -1:].float()]
        step = NativeStep(model, cache, parts)
        for offset, token in enumerate(targets[:-1]):
            position = len(context) + offset
            rows.append(step(torch.tensor([[token]]), torch.tensor([position]))[0].float())  # [1, V]
        logits = torch.cat(rows)  # [R, V]
        total_nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(targets), reduction="sum"))
        total_tokens += len(targets)
    return total_nll, total_tokens
