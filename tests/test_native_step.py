"""The native decode step (infer_tune/native/step.cpp, step.py): on Llama-family models with int4 a8 layers it
computes what the eager model computes for a decode step (logits, the cache entries it writes, the cache's
length counters), and it declines every model it does not know, saying why, so the lean path compiles the
step instead."""

from __future__ import annotations

import copy

import pytest
import torch

from infer_tune.tuners.quantize import QuantizeConfig
from infer_tune.tuners.quantize.pipeline import quantize_in_memory

pytestmark = pytest.mark.usefixtures("native_kernels")  # built once, in the fixture: a failed build fails


def tiny_llama(tokenizer, **overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                  bos_token_id=2, eos_token_id=1)
    config.update(overrides)
    return AutoModelForCausalLM.from_config(LlamaConfig(**config)).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import build_tiny_tokenizer

    return build_tiny_tokenizer()


def quantized(model, **config):
    quantize_in_memory(model, QuantizeConfig(method="int4-rtn", activations="int8", group_size=32, **config), "torch")
    return model


def copy_cache(src, dst) -> None:
    for a, b in zip(src.layers, dst.layers):
        b.keys.copy_(a.keys), b.values.copy_(a.values), b.cumulative_length.copy_(a.cumulative_length)


@pytest.mark.parametrize("variant", [
    {},  # SmolLM2's shape: tied head, int8 (w8a8)
    {"head_dim": 32, "tie_word_embeddings": False},  # q is wider than the hidden state; a head of its own
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, "num_key_value_heads": 1},
    {"head_bits": 4},  # an int4 head through w4a8
])
def test_native_step_computes_the_eager_step(tokenizer, variant):
    """Each step from the same cache state: logits within fp32 rounding of the eager forward's, the same
    key and value written at the position, the same length counters after. int8 activations round each
    value to one of 255 levels, so an fp32 difference of one ulp can move a value across a level now and
    then: at most 2 of the 70 steps may differ by more (still under 2% of the largest logit)."""
    from transformers import StaticCache

    from infer_tune.native.step import NativeStep, recognize

    variant = dict(variant)
    head_bits = variant.pop("head_bits", 8)
    model = quantized(tiny_llama(tokenizer, **variant), head_bits=head_bits)
    parts, why = recognize(model)
    assert parts is not None, why
    ids = torch.randint(3, len(tokenizer), (1, 9), generator=torch.Generator().manual_seed(1))
    caches = [StaticCache(config=model.config, max_cache_len=128) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(9)).logits
        step = NativeStep(model, caches[1], parts)
        token = logits[:, -1].argmax(-1, keepdim=True)
        crossed = []
        for position in range(9, 9 + 70):  # past one attention chunk of 64 positions
            copy_cache(caches[0], caches[1])
            at = torch.tensor([position])
            want = model(input_ids=token, past_key_values=caches[0], use_cache=True, cache_position=at,
                         logits_to_keep=1).logits
            got = step(token, at)
            assert got.shape == want.shape
            scale = float(want.abs().max())
            assert torch.allclose(got, want, atol=2e-2 * scale, rtol=0), position
            if not torch.allclose(got, want, atol=1e-4 * scale, rtol=0):
                crossed.append(position)
                continue
            for eager, ours in zip(caches[0].layers, caches[1].layers):
                assert torch.allclose(eager.keys[:, :, position], ours.keys[:, :, position], atol=1e-5)
                assert torch.allclose(eager.values[:, :, position], ours.values[:, :, position], atol=1e-5)
                assert int(eager.cumulative_length) == int(ours.cumulative_length) == position + 1
            token = want[:, -1].argmax(-1, keepdim=True)
        assert len(crossed) <= 2, crossed


def test_lean_decoder_runs_the_native_step_and_says_so(tokenizer):
    from infer_tune.tuners.lean import LeanConfig
    from infer_tune.tuners.lean.loop import LeanDecoder, bucket

    model = quantized(tiny_llama(tokenizer))
    ids = torch.randint(3, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(2))
    decoder = LeanDecoder(model, compile=True, native_step=True)
    assert decoder.one_cache
    decoder.reserve(300)
    _, token_ns, tokens, _ = decoder.generate(ids, 10, [model.config.eos_token_id])
    assert len(tokens) == len(token_ns) == 10
    assert decoder.facts["lean_step"] == "native" and "lean_native_fallback" not in decoder.facts
    _, _, again, _ = decoder.generate(ids, 10, [model.config.eos_token_id])  # the cache reset, the step reused
    assert again == tokens and decoder.facts["lean_cache_buckets"] == [bucket(300)]
    assert LeanConfig(native_step=True).label() == "lean+native"


@pytest.mark.parametrize("case,fragment", [
    ("qwen3", "is not LlamaForCausalLM"),
    ("bf16-activations", "not int4 a8 on w4a8"),
    ("hooked", "forward hooks"),
    ("dynamic-rope", "changes with the position"),
])
def test_models_it_does_not_know_get_the_compiled_step_and_the_reason(tokenizer, case, fragment):
    from infer_tune.native.step import recognize
    from infer_tune.tuners.lean.loop import LeanDecoder
    from tests.test_quantize_families import tiny

    if case == "qwen3":
        model = quantized(tiny("qwen3", tokenizer))
    elif case == "bf16-activations":
        model = tiny_llama(tokenizer)
        quantize_in_memory(model, QuantizeConfig(method="int4-rtn", group_size=32), "torch")
    elif case == "dynamic-rope":
        model = quantized(tiny_llama(tokenizer, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    else:
        model = quantized(tiny_llama(tokenizer))
        model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 2)
    parts, why = recognize(model)
    assert parts is None and fragment in why, why
    decoder = LeanDecoder(copy.deepcopy(model), compile=True, native_step=True)
    ids = torch.randint(3, len(tokenizer), (1, 8), generator=torch.Generator().manual_seed(3))
    decoder.generate(ids, 3, [model.config.eos_token_id])
    assert decoder.facts["lean_step"] in ("captured", "guarded")
    assert fragment in decoder.facts["lean_native_fallback"]


def test_rows_of_a_slot_step_do_not_depend_on_each_other(tokenizer):
    """step_rows (the slot engine's step): each row of a 3-row step, bit for bit, what a one-row step on that
    row's own cache gives, at its own position (one past a 64-position chunk, so chunks are skipped unevenly)."""
    from infer_tune.native.step import llama_step, recognize

    model = quantized(tiny_llama(tokenizer))
    parts, why = recognize(model)
    assert parts is not None, why
    gen = torch.Generator().manual_seed(4)
    layers, kv, d = model.config.num_hidden_layers, model.config.num_key_value_heads, 16
    keys = [torch.randn(3, kv, 192, d, generator=gen) for _ in range(layers)]
    values = [torch.randn(3, kv, 192, d, generator=gen) for _ in range(layers)]
    x = torch.randn(3, model.config.hidden_size, generator=gen)
    positions = torch.tensor([5, 70, 130])
    p = parts

    def native(k, v):
        return llama_step(p, k, v)
    k3, v3 = [t.clone() for t in keys], [t.clone() for t in values]
    together = native(k3, v3).step_rows(x, positions)
    for b in range(3):
        k1, v1 = [t[b:b + 1].clone() for t in keys], [t[b:b + 1].clone() for t in values]
        alone = native(k1, v1).step_rows(x[b:b + 1], positions[b:b + 1])
        assert torch.equal(together[b], alone[0]), b
        for layer in range(layers):
            assert torch.equal(k3[layer][b], k1[layer][0]) and torch.equal(v3[layer][b], v1[layer][0])
