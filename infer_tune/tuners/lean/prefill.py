"""The lean path's compiled prefill: prompt-length buckets, each compiled once and warmed before timing.

Eager prefill runs the model's Python module by module: on SmolLM2 (30 layers, int4 weights) a
20-token prompt costs far more than its arithmetic (docs/tune.md has the measured numbers). Here a
prompt of P tokens is right-padded to its bucket B (16, 32, 64, 128, then multiples of 128 up to
`MAX_BUCKET`) and run by a graph compiled for B, into a static cache of exactly B positions that
belongs to the bucket (so one graph per bucket, whatever the decode cache's size). Then:

- The logits are those of position P - 1 (`logits_to_keep` as an index tensor): a padding token
  never influences a real position, since attention is causal and padding comes after the prompt.
- The first P positions of the bucket's cache are copied into the decode cache, whose write
  position (`cumulative_length` of every layer) is set to P: the padding's keys and values are never
  read (the decode step at position p attends to positions <= p and overwrites position p first).

Only caches made of plain full-attention static layers take this route; a sliding-window layer
keeps a rolling window that padding would shift, so such models (and prompts longer than
`MAX_BUCKET`, where prefill is GEMM-bound and compiling buys little) prefill eagerly, as
`facts["lean_prefill"]` records. Greedy outputs are checked equal to the eager prefill's on tiny
models of several architectures (tests/test_lean_prefill.py).
"""

from __future__ import annotations

import itertools
import types

import torch

MIN_BUCKET = 16
MAX_BUCKET = 1024
_IDS = itertools.count()


def prefill_bucket(length: int, max_bucket: int = MAX_BUCKET) -> int | None:
    """The padded length a prompt of `length` tokens prefills at (None: longer than `max_bucket`)."""
    if length > max_bucket:
        return None
    size = MIN_BUCKET
    while size < length and size < 128:
        size *= 2
    return size if size >= length else -(-length // 128) * 128


def plain_static(cache) -> bool:
    """Every layer of `cache` is a plain (full-attention) static layer."""
    from transformers.cache_utils import StaticLayer

    return bool(getattr(cache, "layers", None)) and all(type(layer) is StaticLayer for layer in cache.layers)


class CompiledPrefill:
    """Per bucket: a static cache of the bucket's size and a compiled forward over it."""

    def __init__(self, model: torch.nn.Module, *, logits_to_keep: bool, facts: dict,
                 max_bucket: int = MAX_BUCKET) -> None:
        self.model, self.keep, self.facts, self.max_bucket = model, logits_to_keep, facts, max_bucket
        self._buckets: dict[int, tuple] = {}  # size -> (cache, eager forward, compiled forward)
        self._routes: set[str] = set()

    def _route(self, name: str) -> None:
        self._routes.add(name)
        self.facts["lean_prefill"] = "+".join(sorted(self._routes))

    def _entry(self, size: int):
        from transformers import StaticCache

        entry = self._buckets.get(size)
        if entry is not None:
            return entry, False
        cache = StaticCache(config=self.model.config, max_cache_len=size)
        if not plain_static(cache):  # a decode cache of plain layers for a sliding-window model (the native
            from infer_tune.native.step import plain_cache  # step's): the bucket's layers are plain as well

            cache = plain_cache(self.model.config, size)
        model, keep = self.model, self.keep

        def forward(input_ids: torch.Tensor, cache_position: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
            extra = {"logits_to_keep": last} if keep else {}
            logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                           cache_position=cache_position, **extra).logits
            return logits if keep else logits.index_select(1, last)
        # dynamo keeps compiled entries per code object (8 at most): each bucket gets its own
        code = forward.__code__.replace(co_name=f"lean_prefill_{next(_IDS)}")
        forward = types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)
        entry = self._buckets[size] = (cache, forward, torch.compile(forward, fullgraph=True, dynamic=False))
        self.facts["lean_prefill_buckets"] = sorted(self._buckets)
        return entry, True

    def __call__(self, input_ids: torch.Tensor, decode_cache) -> torch.Tensor | None:
        """Prefill `input_ids` [1, P] into `decode_cache`; the logits of position P - 1 ([1, 1, V]), or None
        when this prompt or cache takes the eager route (the caller prefills eagerly then)."""
        length = input_ids.shape[1]
        size = prefill_bucket(length, self.max_bucket)
        if size is None or not plain_static(decode_cache):
            self._route("eager")
            return None
        (cache, eager, compiled), new = self._entry(size)
        device = input_ids.device
        ids = torch.zeros((1, size), dtype=input_ids.dtype, device=device)
        ids[:, :length] = input_ids
        positions = torch.arange(size, device=device)
        last = torch.tensor([length - 1], device=device)
        for layer in cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.zero_()
        if new:  # the first call initializes the bucket's cache outside the graph (lazily, eagerly)
            eager(ids, positions, last)
            for layer in cache.layers:
                layer.cumulative_length.zero_()
        try:
            logits = compiled(ids, positions, last)
        except Exception as exc:  # a graph break or a compile failure: eager prefill from now on
            self._route("eager")
            self.facts["lean_prefill_fallback"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            self.max_bucket = 0
            return None
        self._transfer(cache, decode_cache, length)
        self._route("compiled")
        return logits

    @staticmethod
    def _transfer(src, dst, length: int) -> None:
        """The first `length` positions of `src` into `dst`, and `dst` writes next at `length`."""
        for s, d in zip(src.layers, dst.layers):
            if not d.is_initialized:
                d.lazy_initialization(s.keys, s.values)
            d.keys[:, :, :length].copy_(s.keys[:, :, :length])
            d.values[:, :, :length].copy_(s.values[:, :, :length])
            d.cumulative_length.fill_(length)
