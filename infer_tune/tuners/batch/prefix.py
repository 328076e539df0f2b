"""The slot engine's prefix cache: a prompt that begins like one served before skips the prefill of what they share
(docs/endpoint.md, "Prefix cache").

Two tiers, both keyed by token ids (never by text):
- **resident**: what each slot's cache rows hold after its last request (its prompt and the tokens fed back while it
  decoded). A chat's next turn resends the conversation so far; placed in the slot that served the previous turn,
  its prefill starts where they differ, and nothing is copied.
- **store**: a host-memory LRU of prefixes evicted from slots, bounded by `budget_bytes` (`serve --cache-mib`). A
  slot about to be overwritten first gives its rows to the store (when they hold at least `min_tokens`); a request
  whose best match is there gets the rows copied into a free slot (a memory copy of its K and V, not a prefill).

The rows reused are those computed for the same ids at the same positions by the same step, so the tokens a request
gets are the ones it gets without the cache (checked in tests/test_prefix_cache.py). At least the prompt's last
token is always run: its logits are the first output token's.

A free row of a step bucket writes a throwaway K/V at its slot's position: `park(slot)` gives the position just
past the slot's resident prefix, so the write spoils nothing kept.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    """One stored prefix: its ids and its rows of each cache tensor ([kv_heads, n, ...] each: per layer K and V,
    and an int8 cache's scales)."""

    ids: torch.Tensor
    rows: list[torch.Tensor]
    nbytes: int


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    """The resident prefixes of a `SlotEngine`'s slots and the store behind them (module docstring)."""

    def __init__(self, tensors: list[torch.Tensor], *, max_context: int, budget_bytes: int,
                 min_tokens: int = 32) -> None:
        """`tensors`: every tensor of the slot cache, each [slots, kv heads, positions, ...] (per layer K and V,
        fp32 or int8, and an int8 cache's scales: `NativeCache.tensors()`)."""
        self.tensors, self.max_context = list(tensors), max_context
        self.budget_bytes, self.min_tokens = budget_bytes, min_tokens
        slots = self.tensors[0].shape[0] if self.tensors else 0
        self.resident: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long) for _ in range(slots)]
        self.kept: list[bool] = [False] * slots  # whether the resident prefix is also in the store
        self.store: OrderedDict[int, Entry] = OrderedDict()
        self.bytes = 0
        self._next = 0
        self.counters = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "slot_hits": 0, "store_hits": 0,
                         "stored": 0, "evicted": 0}

    def forget_slots(self) -> None:
        """The slots' rows were written outside serving (`warm`, `alone`): nothing resident is trusted."""
        self.resident = [torch.zeros(0, dtype=torch.long) for _ in self.resident]
        self.kept = [False] * len(self.resident)

    def _token_bytes(self) -> int:
        return sum(t[0, :, 0].numel() * t.element_size() for t in self.tensors)

    # ------------------------------------------------------------------ admission
    def place(self, ids: list[int], free: list[int]) -> tuple[int, int]:
        """Pick the free slot for a prompt and ready its rows: (slot, positions reused). The slot whose resident
        prefix shares most with `ids` is taken, unless the store holds a longer match: then the free slot
        matching least is taken, its rows kept in the store first, and the stored rows copied in. Between slots
        that share as much: an empty one (nothing to keep), then the one that widens the step least (a step runs
        rows 0 up to its highest busy slot: a lone request placed in the last slot would decode every slot's row
        each step), then the shortest resident."""
        prompt = torch.tensor(ids, dtype=torch.long)
        most = max(len(ids) - 1, 0)
        shared = {slot: min(common_prefix(self.resident[slot], prompt), most) for slot in free}
        high = max(set(range(len(self.resident))) - set(free), default=-1)  # the highest busy slot

        def prefer(s: int) -> tuple:  # among slots sharing as much: empty, then narrowest step, then shortest
            return len(self.resident[s]) == 0, -max(s, high), -len(self.resident[s])

        slot = max(free, key=lambda s: (shared[s], prefer(s)))
        best_key, best = None, 0
        for key, entry in self.store.items():
            n = min(common_prefix(entry.ids, prompt), most)
            if n > best:
                best_key, best = key, n
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(ids)
        if best > shared[slot]:
            least = min(shared.values())
            slot = max((s for s in free if shared[s] == least), key=prefer)
            # taken (and made the most recent) before the slot's own prefix is kept: keeping it may evict the
            # oldest entries under the budget, which could be this one
            entry = self.store[best_key]
            self.store.move_to_end(best_key)
            self._keep(slot)
            for tensor, rows in zip(self.tensors, entry.rows):
                tensor[slot, :, :best].copy_(rows[:, :best])
            self.resident[slot], self.kept[slot] = entry.ids[:best].clone(), True
            self.counters["store_hits"] += 1
            reused = best
        else:
            reused = shared[slot]
            if reused < len(self.resident[slot]):  # the rows past the match are about to be overwritten
                self._keep(slot)
                self.resident[slot], self.kept[slot] = self.resident[slot][:reused], False
            if reused:
                self.counters["slot_hits"] += 1
        self.counters["cached_tokens"] += reused
        return slot, reused

    def _keep(self, slot: int) -> None:
        """Copy the slot's resident prefix into the store (unless it is there, or too short to be worth it)."""
        ids = self.resident[slot]
        if self.kept[slot] or len(ids) < self.min_tokens or self.budget_bytes <= 0:
            return
        n = len(ids)
        for key, entry in list(self.store.items()):
            if len(entry.ids) >= n and common_prefix(entry.ids, ids) == n:
                self.store.move_to_end(key)  # already held inside a longer one
                self.kept[slot] = True
                return
            if common_prefix(entry.ids, ids) == len(entry.ids):  # a shorter one this one holds
                self._drop(key)
        nbytes = n * self._token_bytes()
        if nbytes > self.budget_bytes:
            return
        while self.store and self.bytes + nbytes > self.budget_bytes:
            self._drop(next(iter(self.store)))
            self.counters["evicted"] += 1
        entry = Entry(ids.clone(), [t[slot, :, :n].clone() for t in self.tensors], nbytes)
        self.store[self._next] = entry
        self._next += 1
        self.bytes += nbytes
        self.kept[slot] = True
        self.counters["stored"] += 1

    def _drop(self, key: int) -> None:
        self.bytes -= self.store.pop(key).nbytes

    # ------------------------------------------------------------------ after a request
    def release(self, slot: int, fed: list[int]) -> None:
        """A request left `slot` with `fed` ids in its rows (its prompt and the tokens fed back, in order)."""
        self.resident[slot] = torch.tensor(fed[:self.max_context], dtype=torch.long)
        self.kept[slot] = False

    def park(self, slot: int) -> int:
        """Where a free row of a step may write its throwaway K/V: just past the slot's resident prefix (one
        resident token is given up when the prefix fills the slot)."""
        n = len(self.resident[slot])
        if n >= self.max_context:
            self.resident[slot] = self.resident[slot][:self.max_context - 1]
            n = self.max_context - 1
        return n

    def stats(self) -> dict:
        """Counters, the hit rate (prompt tokens reused / prompt tokens) and the store's size."""
        c = self.counters
        return {**c, "hit_rate": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
                "store_entries": len(self.store), "store_bytes": self.bytes, "store_mib": self.bytes / 2**20,
                "budget_mib": self.budget_bytes / 2**20}
