"""infer-tune's own speculative loop (engine `lean`): greedy, batch size 1, the same output as `generate`.

One target prefill delivers the first token (so TTFT is the target's alone), then rounds of:
K draft proposals, one target forward pass over [last token, d1..dK] on the target's KV cache, the
longest prefix of drafts equal to the target's greedy choices accepted plus the target's own next
token (the bonus token), and the target's cache cropped back to what was accepted. No per-round
`generate` call, no re-preparation of inputs: what transformers' assisted generation spends around
each round (about 20 ms on a 2-core CPU for SmolLM2-135M) is what this loop saves.

Drafters: `ModelDrafter` (a draft model with its own KV cache, rolled back to the accepted tokens)
and `LookupDrafter` (prompt lookup: the continuation of the leftmost earlier occurrence of the
last n-gram, as transformers does). The target's logits processors (the runner's length pinning)
run on every verified position, exactly as in `generate`, and on the draft's logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from infer_tune.errors import ConfigError
from infer_tune.runners.base import sync
from infer_tune.tuners.speculate.counters import SpeculativeCounters


class LookupDrafter:
    """Prompt lookup: find the last n-gram (n = max_ngram .. 1) earlier in the text, propose what followed."""

    def __init__(self, max_ngram: int, eos_ids: list[int]) -> None:
        self.max_ngram = max_ngram
        self.eos = set(eos_ids)

    def reset(self, prompt: torch.Tensor | None = None) -> None:
        pass

    def propose(self, seq: torch.Tensor, k: int, processors=None) -> list[int]:
        ids = seq[0]
        length = ids.shape[0]
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            windows = ids.unfold(0, n, 1)  # [length - n + 1, n]
            hits = (windows == ids[-n:]).all(dim=1).nonzero().flatten().tolist()
            for start in hits:
                begin, end = start + n, min(start + n + k, length)
                if begin < end:
                    proposal = ids[begin:end].tolist()
                    cut = next((i for i, t in enumerate(proposal) if t in self.eos), None)
                    return proposal if cut is None else proposal[:cut]
        return []


class ModelDrafter:
    """A draft model proposing greedily, with its own KV cache kept in step with the accepted text.

    With `vocab` (token ids), the draft's output head is cut to those tokens plus the prompt's own
    (end-of-sequence excluded): a head of 49152 x 576 is most of a 4-layer draft's step on a CPU.
    A token outside the cut head cannot be proposed, only rejected or not offered: still lossless.
    """

    def __init__(self, model: torch.nn.Module, counters: SpeculativeCounters, device: str,
                 vocab: list[int] | None = None, eos_ids: list[int] | None = None) -> None:
        self.model = model
        self.counters = counters
        self.device = device
        self.vocab = None if vocab is None else torch.tensor(sorted(set(vocab) - set(eos_ids or [])))
        self.eos = torch.tensor(sorted(set(eos_ids or [])), dtype=torch.long)
        self.head_ids: torch.Tensor | None = None
        self.head_weight: torch.Tensor | None = None
        self.reset()

    def reset(self, prompt: torch.Tensor | None = None) -> None:
        self.cache = new_cache(self.model)
        self.cached: list[int] = []  # the tokens whose keys and values are in `cache`
        if self.vocab is not None and prompt is not None:
            ids = torch.unique(torch.cat([self.vocab, prompt[0].cpu()]))
            self.head_ids = ids[~torch.isin(ids, self.eos)]
            head = self.model.get_output_embeddings()
            self.head_weight = head.weight[self.head_ids.to(head.weight.device)]  # [kept, H]
            self.head_bias = None if getattr(head, "bias", None) is None else head.bias[self.head_ids]

    def _forward(self, ids: list[int]) -> torch.Tensor:
        sync(self.device)
        start = time.perf_counter_ns()
        inputs = torch.tensor([ids], device=self.device)
        if self.head_weight is None:
            logits = self.model(input_ids=inputs, past_key_values=self.cache, use_cache=True,
                                logits_to_keep=1).logits[:, -1, :].float()
        else:
            base = getattr(self.model, self.model.base_model_prefix)
            hidden = base(input_ids=inputs, past_key_values=self.cache, use_cache=True).last_hidden_state[:, -1]
            logits = torch.nn.functional.linear(hidden, self.head_weight, self.head_bias).float()  # [1, kept]
        sync(self.device)
        self.counters.time_ns("draft_forward_ns", start)
        self.counters.add("draft_steps")
        self.cached.extend(ids)
        return logits

    def propose(self, seq: torch.Tensor, k: int, processors=None) -> list[int]:
        text = seq[0].tolist()
        keep = 0
        limit = min(len(self.cached), len(text) - 1)  # the newest token is fed, never assumed cached
        while keep < limit and self.cached[keep] == text[keep]:
            keep += 1
        if keep < len(self.cached):
            crop_to(self.cache, keep)
            del self.cached[keep:]
        proposal: list[int] = []
        feed = text[keep:]
        prefix = seq
        for _ in range(k):
            logits = self._forward(feed)
            if self.head_ids is not None:  # a cut head: no processor can read its columns; EOS is not in it
                token = int(self.head_ids[int(logits.argmax(dim=-1))])
            else:
                if processors is not None:
                    logits = processors(prefix, logits)
                token = int(logits.argmax(dim=-1))
            proposal.append(token)
            feed = [token]
            prefix = torch.cat([prefix, prefix.new_tensor([[token]])], dim=1)
        return proposal


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """A dynamic KV cache for `model` that can be cropped back (sliding-window layers keep their past)."""
    cache = DynamicCache(config=model.config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of `cache` (transformers' `crop` takes the count to remove, negated)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def leading_matches(proposal: list[int], chosen: list[int]) -> int:
    """How many proposed tokens equal the target's choices before the first difference."""
    n = 0
    while n < len(proposal) and proposal[n] == chosen[n]:
        n += 1
    return n


class TorchVerifier:
    """The target's own forward on a dynamic cache: `forward(ids [1, n], keep)` -> fp32 logits of the last
    `keep` positions [keep, V], the cache grown by n; `crop(length)` drops positions from `length` on."""

    def __init__(self, target: torch.nn.Module) -> None:
        self.target = target

    def reset(self, needed: int) -> None:
        self.cache = new_cache(self.target)

    def forward(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        out = self.target(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=keep)
        return out.logits[0].float()

    def crop(self, length: int) -> None:
        crop_to(self.cache, length)


class NativeVerifier:
    """Verify passes through the native decode step (infer_tune/native/step.py, step.cpp's `step_mixed`): the
    prompt and each [last token, d1..dK] run as consecutive rows of one slot at consecutive positions, every
    matmul reading the weights once for all rows, each row's values those of a step of its own (so the
    accepted tokens are the native greedy decode's). Rejected drafts are dropped by moving the length back:
    a row attends to positions up to its own, so what lies beyond is never read and is overwritten next."""

    def __init__(self, target: torch.nn.Module, parts: dict, kv_dtype: str = "fp32", facts: dict | None = None) -> None:
        self.target, self.parts, self.kv_dtype = target, parts, kv_dtype
        self.facts = facts if facts is not None else {}
        self.step = None  # a NativeCachedStep over a NativeCache of one row (fp32 or int8)
        self.length = 0

    def reset(self, needed: int) -> None:
        from infer_tune.native.step import NativeCache, NativeCachedStep

        if self.step is None or self.step.cache.length < needed:
            cache = NativeCache(self.parts, 1, -(-needed // 128) * 128, self.kv_dtype)
            self.step = NativeCachedStep(self.target, cache, self.parts, chunk=None)  # a pass is one native call
            self.facts["kv_dtype"], self.facts["kv_cache_bytes"] = self.kv_dtype, cache.nbytes
        self.length = 0

    def forward(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        rows = ids.shape[1]
        logits = self.step.rows(ids, self.length, rows - keep)
        self.length += rows
        return logits.float()

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


def speculative_generate(target: torch.nn.Module, drafter, num_draft_tokens: int, counters: SpeculativeCounters,
                         device: str, verifier=None) -> Callable:
    """A `generate` replacement for `target` running the lean loop (installed on the instance); `verifier` runs
    the target's passes (default: its own forward on a dynamic cache; `NativeVerifier`: the native step)."""
    verifier = verifier or TorchVerifier(target)

    def generate(input_ids=None, attention_mask=None, generation_config=None, logits_processor=None, streamer=None,
                 **kwargs):
        if kwargs:
            raise ConfigError(f"the lean speculative loop takes no other generate options, got {', '.join(kwargs)}")
        if input_ids.shape[0] != 1:
            raise ConfigError("the lean speculative loop runs one request at a time (batch size 1)")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ConfigError("the lean speculative loop runs unpadded prompts (an attention mask of ones)")
        if generation_config.do_sample:
            raise ConfigError("the lean speculative loop is greedy (do_sample=False)")
        max_new = generation_config.max_new_tokens
        eos = generation_config.eos_token_id
        eos = set([eos] if isinstance(eos, int) else (eos or []))
        processors = logits_processor or (lambda _ids, scores: scores)
        sync(device)
        start = time.perf_counter_ns()
        verifier.reset(input_ids.shape[1] + max_new + num_draft_tokens + 1)
        drafter.reset(input_ids)
        if streamer is not None:
            streamer.put(input_ids.cpu())

        def verify(ids: torch.Tensor, keep: int) -> torch.Tensor:
            sync(device)
            begin = time.perf_counter_ns()
            logits = verifier.forward(ids, keep)  # [keep, V]
            sync(device)
            counters.time_ns("verify_ns", begin)
            return logits

        seq = input_ids
        logits = processors(seq, verify(seq, 1)[-1:])
        new = [int(logits.argmax(dim=-1))]
        counters.round(0, 0)
        produced = 0
        while True:
            seq = torch.cat([seq, seq.new_tensor([new])], dim=1)
            produced += len(new)
            if streamer is not None:
                streamer.put(torch.tensor([new]))
            if produced >= max_new or eos.intersection(new):
                break
            begin = time.perf_counter_ns()
            proposal = drafter.propose(seq, min(num_draft_tokens, max_new - produced - 1), processors)
            sync(device)
            counters.time_ns("draft_ns", begin)
            logits = verify(torch.cat([seq[:, -1:], seq.new_tensor([proposal])], dim=1) if proposal
                            else seq[:, -1:], len(proposal) + 1)
            chosen = []
            for i in range(len(proposal) + 1):
                prefix = torch.cat([seq, seq.new_tensor([proposal[:i]])], dim=1) if i else seq
                chosen.append(int(processors(prefix, logits[i:i + 1]).argmax(dim=-1)))
                if i < len(proposal) and chosen[i] != proposal[i]:
                    break
            accepted = leading_matches(proposal, chosen)
            new = proposal[:accepted] + [chosen[accepted]]
            stop = next((i for i, t in enumerate(new) if t in eos), None)
            if stop is not None:
                new = new[:stop + 1]
            verifier.crop(seq.shape[1] + accepted)  # drop the rejected drafts' keys and values
            counters.round(len(proposal), accepted)
        sync(device)
        counters.time_ns("generate_ns", start)
        if streamer is not None:
            streamer.end()
        return seq

    return generate
