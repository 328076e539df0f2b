"""Speculative-decoding counters with the serving engines' definitions (vLLM's spec-decode metrics,
which llama.cpp adopted), plus where the time of a verify round goes.

Per round (one target forward pass): `proposed` draft tokens were verified and the first `accepted`
of them matched the target's greedy choice; the target's own token after them (the bonus token) is
emitted too, so a round emits accepted + 1 tokens. Derived in `snapshot`:

- acceptance_rate = accepted / proposed draft tokens
- mean_acceptance_length = 1 + accepted / verify passes (passes that proposed >= 1 token)
- acceptance_by_position[i] = rounds whose position i was accepted / rounds that proposed position i
- target_forward_passes = rounds (the prefill included); tokens_per_target_pass = emitted / rounds
- draft / verify / overhead time shares of the timed `generate` calls, and per-round milliseconds
"""

from __future__ import annotations

import time
from typing import Any

from infer_tune.runners.prepared import RunCounters


class SpeculativeCounters(RunCounters):
    """Counts rounds, proposed / accepted draft tokens (also per position) and timed phases (ns)."""

    def round(self, proposed: int, accepted: int) -> None:
        """Record one target forward pass that verified `proposed` draft tokens and accepted `accepted`."""
        if accepted > proposed:
            raise ValueError(f"accepted {accepted} > proposed {proposed}")
        self.add("rounds")
        self.add("draft_tokens_proposed", proposed)
        self.add("draft_tokens_accepted", accepted)
        self.add("tokens_emitted", accepted + 1)
        if proposed:
            self.add("verify_passes")
        for i in range(proposed):
            self.add_at("proposed_by_position", i)
        for i in range(accepted):
            self.add_at("accepted_by_position", i)

    def time_ns(self, name: str, start_ns: int) -> None:
        self.add(name, time.perf_counter_ns() - start_ns)

    def snapshot(self) -> dict[str, Any]:
        return derive(super().snapshot())


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def derive(raw: dict[str, Any]) -> dict[str, Any]:
    """The result keys from raw counts (docs/speculate.md, "Metric definitions")."""
    proposed = raw.get("draft_tokens_proposed", 0)
    accepted = raw.get("draft_tokens_accepted", 0)
    rounds = raw.get("rounds", 0)
    verify_passes = raw.get("verify_passes", 0)
    by_pos_proposed = list(raw.get("proposed_by_position", []))
    by_pos_accepted = list(raw.get("accepted_by_position", []))
    by_pos_accepted += [0] * (len(by_pos_proposed) - len(by_pos_accepted))
    generate_ns = raw.get("generate_ns", 0)
    draft_ns = raw.get("draft_ns", 0)
    verify_ns = raw.get("verify_ns", 0)
    draft_forward_ns = raw.get("draft_forward_ns", 0)
    overhead_ns = max(generate_ns - draft_ns - verify_ns, 0) if generate_ns else None
    out = {
        "target_forward_passes": rounds,
        "verify_passes": verify_passes,
        "draft_tokens_proposed": proposed,
        "draft_tokens_accepted": accepted,
        "tokens_emitted": raw.get("tokens_emitted", 0),
        "acceptance_rate": _ratio(accepted, proposed),
        "mean_acceptance_length": 1 + accepted / verify_passes if verify_passes else None,
        "acceptance_by_position": [a / p for a, p in zip(by_pos_accepted, by_pos_proposed)],
        "proposed_by_position": by_pos_proposed,
        "accepted_by_position": by_pos_accepted,
        "tokens_per_target_pass": _ratio(raw.get("tokens_emitted", 0), rounds),
        "draft_steps": raw.get("draft_steps", 0),
        "draft_time_share": _ratio(draft_ns, generate_ns),
        "verify_time_share": _ratio(verify_ns, generate_ns),
        "overhead_time_share": _ratio(overhead_ns, generate_ns),
        "draft_forward_time_share": _ratio(draft_forward_ns, generate_ns),
        "draft_ms_per_round": _ratio(draft_ns / 1e6, rounds),
        "draft_forward_ms_per_round": _ratio(draft_forward_ns / 1e6, rounds),
        "verify_ms_per_round": _ratio(verify_ns / 1e6, rounds),
        "overhead_ms_per_round": _ratio(overhead_ns / 1e6, rounds) if overhead_ns is not None else None,
        "draft_step_ms": _ratio(draft_forward_ns / 1e6, raw.get("draft_steps", 0)),
    }
    return out
