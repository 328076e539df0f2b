"""The runner: per-token timestamps, pinned length, and natural outputs equal to plain greedy."""

import torch

from infer_tune.runners import Protocol, measure_generation
from infer_tune.runners.generation import generate_once
from infer_tune.runners.prepared import PreparedModel
from infer_tune.workload import encode_batches

PROMPTS = ["Explain how a cache works.", "def add(a, b):", "Hello, how are you?"]


def _prepared(loaded):
    return PreparedModel(loaded.model, loaded.tokenizer)


def test_one_timestamp_per_generated_token(tiny_loaded):
    batch = encode_batches(tiny_loaded.tokenizer, PROMPTS[:1], 1)[0]
    submit_ns, token_ns, generated, _ = generate_once(_prepared(tiny_loaded), batch, 7)
    assert generated.shape == (1, 7)
    assert len(token_ns) == 7
    assert token_ns[0] > submit_ns
    assert token_ns == sorted(token_ns)


def test_pinned_run_keeps_natural_output_identical_to_plain_greedy(tiny_loaded):
    """The pinned (EOS-suppressed) pass cut at the would-be EOS equals an unpinned greedy generate."""
    model, tok = tiny_loaded.model, tiny_loaded.tokenizer
    eos = tok.eos_token_id
    # Scale the EOS row of the head so that greedy picks EOS somewhere mid-sequence for some prompts.
    with torch.no_grad():
        model.lm_head.weight[eos] *= 2.2
    batches = encode_batches(tok, PROMPTS, 1)
    run = measure_generation(_prepared(tiny_loaded), batches, 12, Protocol(warmup=0, min_iterations=1,
                                                                           min_duration_s=0))
    for out, batch in zip(run.outputs, batches):
        plain = model.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id,
                               eos_token_id=eos)
        ids = plain[0, batch["input_ids"].shape[1]:].tolist()
        natural = ids[: ids.index(eos)] if eos in ids else ids
        assert out.token_ids == natural
        assert out.hit_eos == (eos in ids)
    assert any(o.hit_eos and 0 < len(o.token_ids) for o in run.outputs), "test needs an early EOS"
    # pinned timing always decodes the full length
    assert all(len(r.token_ns) == 12 for r in run.requests)


def test_protocol_repeats_until_min_iterations(tiny_loaded):
    batches = encode_batches(tiny_loaded.tokenizer, PROMPTS, 2)
    run = measure_generation(_prepared(tiny_loaded), batches, 4, Protocol(warmup=1, min_iterations=3,
                                                                          min_duration_s=0))
    assert run.iterations == 3
    assert len(run.requests) == 3 * len(PROMPTS)
    assert run.generated_tokens == 3 * len(PROMPTS) * 4
    assert run.first_call_ms is not None and run.first_call_ms > 0
    assert len(run.outputs) == len(PROMPTS)


def test_batched_left_padding_matches_single_requests(tiny_loaded):
    """With an attention mask, a padded batch gives each prompt the same greedy tokens as alone."""
    tok = tiny_loaded.tokenizer
    prepared = _prepared(tiny_loaded)
    batch = encode_batches(tok, PROMPTS, 3)[0]
    assert (batch["attention_mask"] == 0).any()  # prompts differ in length: padding present
    _, _, together, _ = generate_once(prepared, batch, 6)
    for i, prompt in enumerate(PROMPTS):
        single = encode_batches(tok, [prompt], 1)[0]
        _, _, alone, _ = generate_once(prepared, single, 6)
        assert together[i].tolist() == alone[0].tolist()


def test_per_position_is_the_mean_gap_at_each_step():
    from infer_tune.runners.generation import GenerationRun, RequestTiming

    def request(i, gaps_ms):
        ns = [1_000_000]
        for gap in gaps_ms:
            ns.append(ns[-1] + int(gap * 1e6))
        return RequestTiming(prompt_index=i, iteration=0, prompt_tokens=4, submit_ns=0, token_ns=ns)

    run = GenerationRun(requests=[request(0, [1.0, 2.0, 3.0]), request(1, [3.0, 4.0, 5.0])], outputs=[],
                        measured_wall_s=1.0, iterations=1, first_call_ms=None, warmup_s=0.0, peak_rss_bytes=0,
                        rss_before_bytes=0, generated_tokens=8, batch_size=1)
    assert run.per_position_ms() == [2.0, 3.0, 4.0]


def test_compiled_generate_warms_every_prompt_shape(tiny_loaded):
    """A compiled step specializes on the cache length: its warmup runs every prompt once, so no compile
    lands in a timed request; an uncompiled one warms the first prompt only."""
    batches = encode_batches(tiny_loaded.tokenizer, PROMPTS, 1)
    cases = (({}, False, 1), ({"compile_config": object()}, False, len(PROMPTS)), ({}, True, len(PROMPTS)))
    for kwargs, every, warm_calls in cases:  # plain; compiled generate(); a runner that asks (lean compiled)
        seen = []

        def decode(batch, clock, seen=seen):
            seen.append(batch["input_ids"].shape[1])
            clock.step_ns, clock.step_tokens = [1, 2], [1, 1]
            return 0, torch.zeros(1, 2, dtype=torch.long), [None]

        prepared = PreparedModel(tiny_loaded.model, tiny_loaded.tokenizer, generate_kwargs=kwargs)
        run = measure_generation(prepared, batches, 2, Protocol(warmup=1, min_iterations=1, min_duration_s=0),
                                 decode=decode, warm_every_batch=every)
        assert len(seen) == warm_calls + len(PROMPTS) and run.iterations == 1, kwargs
