"""Speculative decoding in `serve`'s slots (infer_tune/tuners/batch/serving.py, `_drafts` / `_accept`): each
decoding slot's prompt-lookup drafts are verified in the same native step as the other slots' rows, and every
request still gets the tokens the engine decodes for its prompt alone, in fewer steps."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.test_native_step import quantized, tiny_llama
from tests.test_native_step import tokenizer as tokenizer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("native_kernels", "one_thread")


def _run(engine, prompts, limits):
    from infer_tune.tuners.batch.serving import LiveRequest

    outputs = [[] for _ in prompts]
    finished = [threading.Event() for _ in prompts]

    def emitter(i):
        def emit(token, finish):
            if token is not None:
                outputs[i].append(token)
            if finish is not None:
                finished[i].set()
        return emit

    engine.start()
    try:
        for i, (p, n) in enumerate(zip(prompts, limits)):
            engine.submit(LiveRequest(ids=p, max_tokens=n, emit=emitter(i), ignore_eos=True))
        for event in finished:
            assert event.wait(120)
    finally:
        engine.stop()
    assert engine.failure is None, engine.failure
    return outputs


def test_drafts_verified_beside_other_slots_give_the_tokens_decoded_alone_in_fewer_steps(tokenizer):
    from infer_tune.tuners.batch.serving import LiveSlots

    model = quantized(tiny_llama(tokenizer))
    gen = torch.Generator().manual_seed(11)
    # prompts that repeat themselves: prompt lookup finds what follows (a random model also loops on its own)
    prompts = [(torch.randint(3, len(tokenizer), (n,), generator=gen).tolist() * 3)[:3 * n] for n in (6, 9, 5)]
    limits = [40, 33, 47]  # odd lengths: the last verify pass of a request has less room than K
    made = {}
    for k in (0, 4):
        engine = LiveSlots(model, [model.config.eos_token_id], slots=2, max_context=160, compile=False,
                           native_step=True, prefill_chunk=8, prefix_cache=False, speculate=k)
        engine.warm(prompts[0])
        alone = [engine.alone(p, n, ignore_eos=True) for p, n in zip(prompts, limits)]
        made[k] = (engine, _run(engine, prompts, limits), alone)
    plain, drafted = made[0], made[4]
    assert drafted[1] == drafted[2] == plain[2]  # served with drafts == decoded alone == served without
    assert [len(o) for o in drafted[1]] == limits
    stats = drafted[0].stats()["speculative"]
    assert stats["accepted"] > 0 and stats["verify_passes"] > 0, stats
    assert 0 < stats["acceptance"] <= 1 and len(stats["acceptance_by_position"]) == 4
    assert drafted[0].steps < plain[0].steps  # more than one token a step where drafts were accepted
    assert plain[0].stats()["speculative"] is None


def test_speculation_needs_the_native_step(tokenizer):
    from infer_tune.errors import ConfigError
    from infer_tune.tuners.batch.serving import LiveSlots

    model = tiny_llama(tokenizer)  # not quantized: the native step does not run it
    with pytest.raises(ConfigError, match="verifies in the native step"):
        LiveSlots(model, [1], slots=1, max_context=64, compile=False, native_step=True, speculate=4)


def test_a_seeded_sampled_request_is_the_same_alone_and_beside_drafting_slots(tokenizer):
    from infer_tune.tuners.batch.serving import LiveRequest, LiveSlots, Sampling

    model = quantized(tiny_llama(tokenizer))
    gen = torch.Generator().manual_seed(4)
    prompts = [(torch.randint(3, len(tokenizer), (n,), generator=gen).tolist() * 2) for n in (7, 10, 6)]
    engine = LiveSlots(model, [model.config.eos_token_id], slots=3, max_context=128, compile=False,
                       native_step=True, prefill_chunk=8, speculate=4)
    engine.warm(prompts[0])
    greedy = engine.alone(prompts[0], 20, ignore_eos=True)
    runs = []
    engine.start()
    try:
        for company in ([], prompts[1:]):  # alone, then beside two greedy requests whose slots draft
            done = threading.Event()
            got: list[int] = []
            requests = [LiveRequest(ids=prompts[0], max_tokens=20, ignore_eos=True, sampling=Sampling(1.3, seed=5),
                                    emit=lambda t, f, got=got, done=done: (got.append(t) if t is not None else None,
                                                                           done.set() if f is not None else None)),
                        *[LiveRequest(ids=p, max_tokens=30, ignore_eos=True, emit=lambda t, f: None) for p in company]]
            for request in requests:
                engine.submit(request)
            assert done.wait(60)
            runs.append(got)
        done, top1 = threading.Event(), []
        engine.submit(LiveRequest(ids=prompts[0], max_tokens=20, ignore_eos=True, sampling=Sampling(1.0, top_k=1),
                                  emit=lambda t, f: (top1.append(t) if t is not None else None,
                                                     done.set() if f is not None else None)))
        assert done.wait(60)
    finally:
        engine.stop()
    assert engine.failure is None, engine.failure
    assert runs[0] == runs[1] != greedy and len(runs[0]) == 20
    assert top1 == greedy
    assert engine.stats()["speculative"]["verify_passes"] > 0  # the greedy company drafted meanwhile
