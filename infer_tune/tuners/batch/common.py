"""What both batchers share: single-request greedy references, left-padded batches built from token
ids, per-request outputs cut at end-of-sequence, the output check, and out-of-memory detection."""

from __future__ import annotations

import torch

from infer_tune.metrics.memory import is_out_of_memory  # noqa: F401 (the batch sweep's name for it)
from infer_tune.runners.base import Output, Progress
from infer_tune.runners.generation import eos_ids, generate_once
from infer_tune.runners.prepared import PreparedModel


def cut_at_eos(ids: list[int], eos: set[int], limit: int) -> list[int]:
    """The first `limit` ids, ended just after the first end-of-sequence id (kept: it is a generated token)."""
    out: list[int] = []
    for token in ids[:limit]:
        out.append(token)
        if token in eos:
            break
    return out


def weights_key(prepared: PreparedModel) -> tuple:
    """What the references depend on besides the prompt: the stacked parts that change the weights or
    kernels (a quantized stack's references are its own, not the fp32 model's), and the rows the
    decode kernel runs on (tuners/batch/slots.py)."""
    parts = prepared.metrics.get("stack") or []
    return tuple(p["label"] for p in parts if p["technique"] != "batch") + (
        prepared.metrics.get("slot_decode_kernel_rows", 1),)


def reference_tokens(prepared: PreparedModel, encoded: list[dict], indices: list[int], max_new_tokens: int,
                     cache: dict | None = None, progress: Progress | None = None) -> dict[int, list[int]]:
    """Prompt index -> its single-request greedy tokens (natural length: up to and including the first
    end-of-sequence token, at most `max_new_tokens`). Untimed; memoized in `cache` across configs."""
    cache = {} if cache is None else cache
    eos = set(eos_ids(prepared.model, prepared.tokenizer))
    unique = sorted(set(indices))
    out: dict[int, list[int]] = {}
    for k, i in enumerate(unique):
        key = ("batch-greedy", weights_key(prepared), tuple(encoded[i]["input_ids"][0].tolist()), max_new_tokens)
        if key not in cache:
            _, _, generated, _ = generate_once(prepared, encoded[i], max_new_tokens, pin_length=False)
            cache[key] = cut_at_eos(generated[0].tolist(), eos, max_new_tokens)
        out[i] = list(cache[key])
        if progress:
            progress("single-request greedy references", k + 1, len(unique))
    return out


def left_pad(rows: list[torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """A left-padded batch of 1-D token-id tensors, with its attention mask (pad ids may occur inside prompts,
    so the mask is built from the lengths, never inferred from the ids)."""
    width = max(int(r.numel()) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, S]
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, S]
    for b, row in enumerate(rows):
        input_ids[b, width - row.numel():] = row
        mask[b, width - row.numel():] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def pad_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return int(tokenizer.eos_token_id) if tokenizer.eos_token_id is not None else 0


def make_output(tokenizer, eos: set[int], prompt_index: int, prompt_tokens: int, tokens: list[int]) -> Output:
    """The natural output of one request: its tokens without the end-of-sequence token, and whether it hit it."""
    hit = bool(tokens) and tokens[-1] in eos
    keep = tokens[:-1] if hit else tokens
    return Output(prompt_index=prompt_index, text=tokenizer.decode(keep, skip_special_tokens=True), token_ids=keep,
                  prompt_tokens=prompt_tokens, hit_eos=hit)


def count_mismatches(outputs: list[Output], references: dict[int, list[int]], eos: set[int]) -> int | None:
    """Requests whose tokens differ from their prompt's single-request greedy tokens (None: no references)."""
    if not references:
        return None
    bad = 0
    for o in outputs:
        ref = references.get(o.prompt_index)
        ref_hit = bool(ref) and ref[-1] in eos
        if ref is None or o.token_ids != (ref[:-1] if ref_hit else ref) or o.hit_eos != ref_hit:
            bad += 1
    return bad
