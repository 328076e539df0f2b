"""`serve`'s prefix cache (infer_tune/tuners/batch/prefix.py): a prompt that begins like one served before skips the
prefill of what they share, from its slot's own rows or from the store, and still gets the tokens it gets alone."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.test_native_step import quantized, tiny_llama
from tests.test_native_step import tokenizer as tokenizer  # noqa: F401 (a fixture)


def _engine(tokenizer, **kwargs):
    from infer_tune.tuners.batch.serving import LiveSlots

    model = quantized(tiny_llama(tokenizer))
    engine = LiveSlots(model, [model.config.eos_token_id], max_context=224, compile=False, native_step=True,
                       prefill_chunk=8, **kwargs)
    assert engine.engine.native
    return engine


def _serve_in_turn(engine, requests: list[tuple[list[int], int]]) -> list:
    """Each request after the previous one ended; the LiveRequests, with their tokens and cached counts."""
    from infer_tune.tuners.batch.serving import LiveRequest

    done, out = threading.Event(), []
    engine.start()
    try:
        for ids, n in requests:
            done.clear()
            live = LiveRequest(ids=ids, max_tokens=n, ignore_eos=True,
                               emit=lambda token, finish: done.set() if finish is not None else None)
            engine.submit(live)
            assert done.wait(120)
            out.append(live)
    finally:
        engine.stop()
    assert engine.failure is None, engine.failure
    return out


def _ids(gen, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


@pytest.mark.usefixtures("native_kernels", "one_thread")
def test_a_chats_next_turn_reuses_its_slot_and_decodes_what_it_decodes_alone(tokenizer):
    engine = _engine(tokenizer, slots=2)
    gen = torch.Generator().manual_seed(3)
    vocab = len(tokenizer)
    first = _ids(gen, 21, vocab)
    engine.warm(first)
    # turn 1, then turn 2 = turn 1 + its answer + a new message, turn 3 likewise; a stranger between them
    answer1 = engine.alone(first, 12, ignore_eos=True)
    second = first + answer1 + _ids(gen, 9, vocab)
    answer2 = engine.alone(second, 12, ignore_eos=True)
    third = second + answer2 + _ids(gen, 7, vocab)
    stranger = _ids(gen, 17, vocab)
    expected = [answer1, engine.alone(stranger, 12, ignore_eos=True), answer2, engine.alone(third, 12, ignore_eos=True)]
    served = _serve_in_turn(engine, [(first, 12), (stranger, 12), (second, 12), (third, 12)])
    assert [r.tokens for r in served] == expected
    # the rows of every id fed through the slot: the prompt and the answer but its last token (never fed back)
    assert [r.cached for r in served] == [0, 0, len(first) + 11, len(second) + 11]
    stats = engine.stats()["prefix_cache"]
    assert stats["slot_hits"] == 2 and stats["cached_tokens"] == len(first) + len(second) + 22
    assert stats["hit_rate"] == pytest.approx(stats["cached_tokens"] / sum(len(p) for p in (first, stranger,
                                                                                             second, third)))


@pytest.mark.usefixtures("native_kernels", "one_thread")
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_a_prefix_evicted_from_its_slot_comes_back_from_the_store(tokenizer, kv_dtype):
    """Also on the int8 cache, whose per-vector scales must travel with the rows (else the copied rows decode
    something else than `alone`)."""
    engine = _engine(tokenizer, slots=1, kv_dtype=kv_dtype)
    gen = torch.Generator().manual_seed(5)
    vocab = len(tokenizer)
    system = _ids(gen, 40, vocab)  # a shared system prompt: over the store's 32-token minimum
    a, b, c = system + _ids(gen, 6, vocab), _ids(gen, 35, vocab), system + _ids(gen, 8, vocab)
    engine.warm(a)
    expected = [engine.alone(p, 6, ignore_eos=True) for p in (a, b, c)]
    served = _serve_in_turn(engine, [(a, 6), (b, 6), (c, 6)])
    assert [r.tokens for r in served] == expected
    assert [r.cached for r in served] == [0, 0, len(system)]
    stats = engine.stats()["prefix_cache"]
    assert stats["store_hits"] == 1 and stats["stored"] >= 1 and stats["store_entries"] >= 1


@pytest.mark.usefixtures("native_kernels", "one_thread")
def test_without_the_cache_nothing_is_reused_and_the_tokens_are_the_same(tokenizer):
    engine = _engine(tokenizer, slots=1, prefix_cache=False)
    gen = torch.Generator().manual_seed(3)
    first = _ids(gen, 21, len(tokenizer))
    engine.warm(first)
    answer = engine.alone(first, 8, ignore_eos=True)
    second = first + answer + [5, 6, 7]
    expected = engine.alone(second, 8, ignore_eos=True)
    served = _serve_in_turn(engine, [(first, 8), (second, 8)])
    assert [r.tokens for r in served] == [answer, expected] and [r.cached for r in served] == [0, 0]
    assert engine.stats()["prefix_cache"] is None


def _cache(slots=2, layers=2, heads=1, context=64, dim=4, budget=10**9, min_tokens=4):
    from infer_tune.tuners.batch.prefix import PrefixCache

    keys = [torch.randn(slots, heads, context, dim) for _ in range(layers)]
    values = [torch.randn(slots, heads, context, dim) for _ in range(layers)]
    return PrefixCache([*keys, *values], max_context=context, budget_bytes=budget, min_tokens=min_tokens), keys, values


def test_the_store_keeps_one_copy_of_nested_prefixes_and_evicts_the_oldest_under_its_budget():
    per = 2 * 2 * 4 * 4  # bytes a token: 2 layers x (K, V) x 4 floats of 4 bytes
    cache, keys, values = _cache(slots=1, budget=20 * per)
    cache.release(0, list(range(10, 18)))  # 8 ids
    slot, reused = cache.place(list(range(50, 60)), [0])  # a stranger: the 8 go to the store
    assert (slot, reused) == (0, 0) and len(cache.store) == 1 and cache.bytes == 8 * per
    stored = next(iter(cache.store.values()))
    assert torch.equal(stored.rows[1], keys[1][0, :, :8])
    cache.release(0, list(range(10, 22)))  # 12 ids, holding the stored 8: they are replaced by these 12
    cache.place(list(range(70, 80)), [0])
    assert [len(e.ids) for e in cache.store.values()] == [12] and cache.bytes == 12 * per
    cache.release(0, list(range(100, 112)))
    cache.place(list(range(200, 205)), [0])  # 24 tokens would be over the 20 of the budget: the oldest goes
    assert [int(e.ids[0]) for e in cache.store.values()] == [100] and cache.counters["evicted"] == 1
    assert cache.bytes <= cache.budget_bytes


def test_a_store_hit_copies_the_rows_into_the_slot_matching_least_and_leaves_the_last_token_to_run():
    cache, keys, values = _cache(slots=2)
    cache.release(0, list(range(10, 30)))
    cache.place(list(range(90, 99)), [0])  # slot 0's 20 ids go to the store
    want = [k[0, :, :20].clone() for k in keys]
    cache.release(0, [1, 2, 3])
    cache.release(1, [10, 11, 12, 13, 99])  # shares 4 with the stored prefix
    slot, reused = cache.place(list(range(10, 30)), [0, 1])  # all 20 stored: 19 reused, the last one runs
    assert (slot, reused) == (0, 19)
    assert all(torch.equal(k[0, :, :19], w[:, :19]) for k, w in zip(keys, want))
    assert cache.counters["store_hits"] == 1


def test_a_prompt_sharing_nothing_takes_the_slot_that_keeps_the_step_narrowest():
    cache, _, _ = _cache(slots=4)
    for slot, n in ((0, 12), (1, 9), (2, 6), (3, 5)):  # residents sharing nothing with the prompts below
        cache.release(slot, list(range(100 * (slot + 1), 100 * (slot + 1) + n)))
    # every slot free: slot 0 (a step of one row), not slot 3 with the shortest resident (a step of four rows)
    assert cache.place(list(range(10, 20)), [0, 1, 2, 3]) == (0, 0)
    # slot 2 busy: slots 0 and 1 keep the step at three rows, and of those slot 1 holds less
    assert cache.place(list(range(20, 30)), [1, 3]) == (1, 0)
    # a match still wins over the width
    cache.release(3, list(range(40, 50)))
    assert cache.place(list(range(40, 45)) + [7], [0, 3]) == (3, 5)


def test_a_free_row_parks_past_its_slots_prefix_and_a_full_slot_gives_up_one_position():
    cache, _, _ = _cache(slots=1, context=8)
    cache.release(0, [1, 2, 3])
    assert cache.park(0) == 3
    cache.release(0, list(range(8)))
    assert cache.park(0) == 7 and len(cache.resident[0]) == 7


@pytest.mark.usefixtures("native_kernels", "one_thread")
def test_usage_counts_the_cached_tokens_and_metrics_reports_the_hit_rate(tokenizer):
    from tests.test_serve_hardening import call, serving

    engine = _engine(tokenizer, slots=1)
    gen = torch.Generator().manual_seed(9)
    first = _ids(gen, 24, 100)  # ids the stand-in tokenizer of the HTTP side knows
    engine.warm(first)
    engine.start()
    with serving(engine) as (_, port):
        status, _, one = call(port, "/v1/completions", {"prompt": first, "max_tokens": 5, "ignore_eos": True})
        assert status == 200 and one["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}, one
        again = first + [9, 10, 11]
        status, _, two = call(port, "/v1/completions", {"prompt": again, "max_tokens": 5, "ignore_eos": True})
        assert status == 200 and two["usage"]["prompt_tokens_details"] == {"cached_tokens": len(first)}, two
        status, headers, text = call(port, "/metrics")
        status_h, _, health = call(port, "/health")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    metrics = {line.split()[0]: float(line.split()[1]) for line in text.decode().splitlines()
               if line and not line.startswith("#")}
    assert metrics["infer_tune_up"] == 1 and metrics["infer_tune_slots"] == 1
    assert metrics["infer_tune_requests_served_total"] == 2 and metrics["infer_tune_generation_tokens_total"] == 10
    assert metrics["infer_tune_prompt_tokens_total"] == len(first) + len(again)
    assert metrics["infer_tune_prefix_cache_hit_tokens_total"] == len(first)
    assert metrics["infer_tune_prefix_cache_hit_rate"] == pytest.approx(len(first) / (len(first) + len(again)),
                                                                        rel=1e-4)
    assert "# TYPE infer_tune_requests_waiting gauge" in text.decode()
    assert status_h == 200 and health["prefix_cache_hit_rate"] == pytest.approx(metrics[
        "infer_tune_prefix_cache_hit_rate"], abs=1e-4)


def test_keeping_a_slots_prefix_never_evicts_the_entry_being_copied_in():
    """The store at its budget, its oldest entry the best match of a new prompt, the free slot holding a prefix
    worth keeping: keeping that prefix evicts under the budget, and the entry being copied in is not the one
    evicted (it was the oldest: a KeyError stopped the engine in a 32-session multi-turn run)."""
    per = 2 * 2 * 4 * 4
    cache, keys, _ = _cache(slots=1, budget=16 * per)
    cache.release(0, list(range(10, 18)))  # 8 ids
    cache.place(list(range(50, 58)), [0])  # the 8 go to the store (entry A, the oldest)
    cache.release(0, list(range(60, 68)))  # 8 more ids resident
    cache.place(list(range(70, 78)), [0])  # they go to the store too (entry B): the store is full
    cache.release(0, list(range(80, 88)))  # another prefix resident, worth keeping
    slot, reused = cache.place(list(range(10, 18)) + [99], [0])  # A is the best match
    assert (slot, reused) == (0, 8) and torch.equal(cache.resident[0], torch.arange(10, 18))
    assert cache.bytes <= cache.budget_bytes and cache.counters["evicted"] >= 1
