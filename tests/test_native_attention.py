"""The native decode attention (infer_tune/native/attention.cpp, attention.py): what SDPA computes for one
query per row, with grouped-query caches read as they are, per-row bool masks and additive float masks;
and, switched on for a compiled lean step, the same greedy tokens as the eager step on several families."""

from __future__ import annotations

import copy

import pytest
import torch

from infer_tune.native.attention import NAME, attending, decode_attention

pytestmark = pytest.mark.usefixtures("native_kernels")  # built once, in the fixture: a failed build fails


def sdpa(q, k, v, mask, scale):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)  # [B, 1, H, D]


class _Module:
    num_key_value_groups = 3
    is_causal = True



@pytest.mark.parametrize("dim", [64, 128, 16])
@pytest.mark.parametrize("cache", ["fp32", "int8"])
def test_a_prompts_rows_together_give_each_rows_values_alone(dim, cache):
    """A prompt chunk's rows over their slot's one cache (k / v expanded along the rows: the native step's prefill)
    are attended in blocks of rows that share each chunk of keys read; every row's output equals, bit for bit, what
    it gets alone (a decode step's path) -- rows that see part of a chunk (the causal edge, a sliding window), a
    row count that is no multiple of the block, and the head dimensions the tiles take (64, 128) or leave (16)."""
    ops = torch.ops.infer_tune_native
    gen = torch.Generator().manual_seed(dim)
    heads, kv_heads, length, rows, start = 9, 3, 400, 37, 300
    if cache == "fp32":
        k, v = torch.randn(1, kv_heads, length, dim, generator=gen), torch.randn(1, kv_heads, length, dim, generator=gen)
        scales = ()
    else:
        k = torch.randint(-127, 128, (1, kv_heads, length, dim), dtype=torch.int8, generator=gen)
        v = torch.randint(-127, 128, (1, kv_heads, length, dim), dtype=torch.int8, generator=gen)
        scales = (torch.rand(1, kv_heads, length, generator=gen), torch.rand(1, kv_heads, length, generator=gen))
    q = torch.randn(rows, heads, 1, dim, generator=gen)
    position = start + torch.arange(rows).view(-1, 1)
    for window in (0, 250):
        seen = torch.arange(length).view(1, -1) <= position
        if window:
            seen &= torch.arange(length).view(1, -1) > position - window
        mask = seen.view(rows, 1, 1, length)

        def attend(i, n):
            e = lambda t: t.expand(n, *t.shape[1:])  # noqa: E731
            if cache == "fp32":
                return ops.decode_attention(q[i:i + n], e(k), e(v), mask[i:i + n], 0.125)
            return ops.decode_attention_q8(q[i:i + n], e(k), e(scales[0]), e(v), e(scales[1]), mask[i:i + n], 0.125)

        together = attend(0, rows)
        for i in range(rows):
            assert torch.equal(together[i], attend(i, 1)[0]), (window, i)
        if cache == "fp32":
            reference = sdpa(q, k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), mask, 0.125)
            torch.testing.assert_close(together, reference, rtol=1e-4, atol=1e-5)

@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_decode_attention_equals_sdpa(mask_kind):
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, length, d = 3, 6, 2, 40, 16
    q = torch.randn(b, h, 1, d, generator=gen)
    cache_k = torch.randn(b, hkv, 64, d, generator=gen)  # a static cache, read up to `length` (a strided view)
    cache_v = torch.randn(b, hkv, 64, d, generator=gen)
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]
    positions = torch.tensor([5, 39, 17])
    if mask_kind == "bool":  # each row sees its own positions, as the slot engine's step does
        mask = torch.arange(length).view(1, 1, 1, -1) <= positions.view(-1, 1, 1, 1)
    elif mask_kind == "float":
        mask = torch.randn(b, 1, 1, length, generator=gen)
    else:
        mask = None
    got = torch.ops.infer_tune_native.decode_attention(q, k, v, mask, 0.25)
    assert got.shape == (b, 1, h, d)
    assert torch.allclose(got, sdpa(q, k, v, mask, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [64, 128, 12])  # the two register paths and the generic loop
@pytest.mark.parametrize("mask_kind", ["per-row", "per-head", "float"])
def test_long_caches_split_in_chunks_equal_sdpa(mask_kind, d):
    """Several chunks per (row, kv head), merged: a long context read in pieces gives SDPA's values, for
    per-row and per-head bool masks (a chunk one head sees and another does not) and additive masks."""
    gen = torch.Generator().manual_seed(2)
    b, h, hkv, length = 2, 8, 2, 300
    q = torch.randn(b, h, 1, d, generator=gen)
    k, v = torch.randn(b, hkv, length, d, generator=gen), torch.randn(b, hkv, length, d, generator=gen)
    if mask_kind == "per-row":
        mask = torch.arange(length).view(1, 1, 1, -1) <= torch.tensor([70, 299]).view(-1, 1, 1, 1)
    elif mask_kind == "per-head":  # head h sees positions < 40 * (h + 1)
        mask = (torch.arange(length).view(1, 1, 1, -1) < 40 * (torch.arange(h) + 1).view(1, -1, 1, 1)).expand(b, h, 1, length)
    else:
        mask = torch.randn(b, 1, 1, length, generator=gen) * 4
    got = torch.ops.infer_tune_native.decode_attention(q, k, v, mask, d ** -0.5)
    assert torch.allclose(got, sdpa(q, k, v, mask, d ** -0.5), atol=1e-5, rtol=1e-4)


def test_a_row_gives_the_same_values_in_any_cache_length():
    """Positions past a row's last visible one change nothing, bit for bit: the slot engine's step attends
    over a length bucket chosen by the busiest row, and a request must decode as it would alone."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 9, 1, 64, generator=gen)
    k, v = torch.randn(1, 3, 512, 64, generator=gen), torch.randn(1, 3, 512, 64, generator=gen)
    outs = []
    for length in (130, 256, 512):
        mask = torch.arange(length).view(1, 1, 1, -1) <= 129
        outs.append(torch.ops.infer_tune_native.decode_attention(q, k[:, :, :length], v[:, :, :length], mask, 0.125))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_calls_it_cannot_do_go_to_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 6, 4, 8, generator=gen), torch.randn(1, 2, 4, 8, generator=gen), torch.randn(1, 2, 4, 8, generator=gen)
    module = _Module()
    prefill, _ = decode_attention(module, q, k, v, None, scaling=0.3)  # four queries: SDPA's own path
    assert torch.equal(prefill, sdpa_attention_forward(module, q, k, v, None, scaling=0.3)[0])
    one = q[:, :, :1]
    native_out, _ = decode_attention(module, one, k, v, None, scaling=0.3)
    reference, _ = sdpa_attention_forward(module, one, k, v, None, scaling=0.3)
    assert torch.allclose(native_out, reference, atol=1e-6) and not torch.equal(native_out, prefill[:, :1])


def test_attending_switches_sdpa_models_only_inside_the_block(tiny_loaded):
    model = tiny_loaded.model
    assert model.config._attn_implementation == "sdpa"
    with attending(model) as used:
        assert used == NAME and model.config._attn_implementation == NAME
    assert model.config._attn_implementation == "sdpa"
    with attending(model, enabled=False) as used:
        assert used == "sdpa"
    model.config._attn_implementation = "eager"
    try:
        with attending(model) as used:  # a model that asked for eager attention keeps it
            assert used == "eager"
    finally:
        model.config._attn_implementation = "sdpa"


@pytest.mark.parametrize("arch,step", [("llama", "captured"), ("qwen3", "captured"), ("phi3", "captured"),
                                       ("gemma3", "guarded")])
def test_compiled_lean_step_with_native_attention_decodes_as_eager(arch, step):
    """Greedy tokens of the captured step (native attention traced in) against the eager step (SDPA) on
    the same weights. Gemma3's sliding-window cache keeps per-step state: its step is guarded
    torch.compile, which attends with the model's own SDPA (and says so). The compiled decoder decodes in
    one cache sized for the run's longest request (reserved: 384 positions), the eager one in the prompt's
    own 128-position bucket: masked positions change nothing."""
    from infer_tune.tuners.lean.loop import LeanDecoder, bucket
    from tests.conftest import build_tiny_tokenizer
    from tests.test_quantize_families import tiny

    tok = build_tiny_tokenizer()
    model = tiny(arch, tok)
    ids = torch.randint(3, len(tok), (1, 12), generator=torch.Generator().manual_seed(2))
    eos = [model.config.eos_token_id]
    _, _, eager, _ = LeanDecoder(model, compile=False).generate(ids, 10, eos)
    compiled = LeanDecoder(copy.deepcopy(model), compile=True)
    assert compiled.one_cache and not LeanDecoder(model, compile=True, native_attention=False).one_cache
    compiled.reserve(300)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _, _, tokens, _ = compiled.generate(ids, 10, eos)
    # the guarded step compiles a few graphs, not one per position up to dynamo's recompile limit (8) and then
    # eager (11 graphs): Gemma 3's capture records 2 (they differ: it falls back), its guarded step 3 (the third
    # where its window fills); the others' capture records 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= (5 if step == "guarded" else 1)
    assert compiled.facts["lean_step"] == step, compiled.facts
    assert compiled.facts["lean_attention"] == (NAME if step == "captured" else "sdpa")
    assert tokens == eager
    _, _, again, _ = compiled.generate(ids, 4, eos)  # a shorter request: the same cache, no second compile
    assert again == eager[:4] and compiled.facts["lean_cache_buckets"] == [bucket(300)] == [384]
    assert model.config._attn_implementation == "sdpa"
