"""transformers' assisted generation, instrumented: what is proposed, accepted and where the time goes.

`generate` builds a candidate generator once per call (`_get_candidate_generator`); each round it
asks it for candidates (`get_candidates`: the draft's work), runs one target forward pass over them,
and reports the number of matches back (`update_candidate_strategy(..., num_matches)`, after the
cut to the length budget). `instrument` wraps those two calls on the generator of each call, times
`generate` as a whole and the target's forward passes (forward hooks; those inside
`get_candidates` belong to the draft, as with `assistant_early_exit`), and counts draft forward
passes on a separate draft model. Everything is undone by the returned function.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from infer_tune.runners.base import sync
from infer_tune.tuners.speculate.counters import SpeculativeCounters


class _Phase:
    """Which side is running (the draft inside get_candidates, else the target) and when it started."""

    def __init__(self) -> None:
        self.in_draft = False
        self.proposed = 0


def _forward_hooks(module: torch.nn.Module, on_end: Callable[[int], None], device: str) -> list:
    starts: list[int] = []

    def pre(*_):
        sync(device)
        starts.append(time.perf_counter_ns())

    def post(*_):
        sync(device)
        on_end(time.perf_counter_ns() - starts.pop())

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def instrument(target: torch.nn.Module, counters: SpeculativeCounters, *, draft: torch.nn.Module | None,
               device: str) -> Callable[[], None]:
    """Count and time transformers' assisted generation on `target`; returns the undo function."""
    phase = _Phase()
    original_get_generator = target._get_candidate_generator
    original_generate = target.generate

    def get_candidate_generator(*args, **kwargs):
        generator = original_get_generator(*args, **kwargs)
        get_candidates, update = generator.get_candidates, generator.update_candidate_strategy

        def timed_get_candidates(input_ids, *a, **kw):
            sync(device)
            start = time.perf_counter_ns()
            phase.in_draft = True
            try:
                candidates, logits = get_candidates(input_ids, *a, **kw)
            finally:
                phase.in_draft = False
                sync(device)
                counters.time_ns("draft_ns", start)
            phase.proposed = int(candidates.shape[1] - input_ids.shape[1])
            return candidates, logits

        def counted_update(input_ids, scores, num_matches, *a, **kw):
            counters.round(phase.proposed, int(num_matches))
            return update(input_ids, scores, num_matches, *a, **kw)

        generator.get_candidates = timed_get_candidates
        generator.update_candidate_strategy = counted_update
        return generator

    def timed_generate(*args, **kwargs):
        if phase.in_draft:  # the target drafting for itself calls its own generate: part of the draft's time
            return original_generate(*args, **kwargs)
        sync(device)
        start = time.perf_counter_ns()
        try:
            return original_generate(*args, **kwargs)
        finally:
            sync(device)
            counters.time_ns("generate_ns", start)

    def target_forward_done(elapsed: int) -> None:
        if phase.in_draft:  # the target drafting for itself (assistant_early_exit)
            counters.add("draft_forward_ns", elapsed)
            counters.add("draft_steps")
        else:
            counters.add("verify_ns", elapsed)

    def draft_forward_done(elapsed: int) -> None:
        counters.add("draft_forward_ns", elapsed)
        counters.add("draft_steps")

    handles = _forward_hooks(target, target_forward_done, device)
    if draft is not None and draft is not target:
        handles += _forward_hooks(draft, draft_forward_done, device)
    target._get_candidate_generator = get_candidate_generator
    target.generate = timed_generate

    def undo() -> None:
        for handle in handles:
            handle.remove()
        for name in ("_get_candidate_generator", "generate"):
            target.__dict__.pop(name, None)

    return undo


def configure_assistant(model: torch.nn.Module, num_tokens: int) -> Callable[[], None]:
    """Make `model` (an assistant, or the target drafting for itself) draft exactly `num_tokens` per round.

    transformers' defaults adapt the draft length (`num_assistant_tokens_schedule`) and stop drafting
    below a confidence of 0.4 (`assistant_confidence_threshold`); a sweep over K needs K fixed.
    Returns a function restoring the previous settings.
    """
    config = model.generation_config
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    before = {k: getattr(config, k, None) for k in keys}
    config.num_assistant_tokens = num_tokens
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0

    def restore() -> None:
        for key, value in before.items():
            setattr(config, key, value)

    return restore
