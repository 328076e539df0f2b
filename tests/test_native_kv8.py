"""The native step's int8 KV cache (native/attention.cpp `decode_attention_q8`, step.cpp's `kv8`, step.py
`NativeCache`): each key and value vector of a head stored as int8 with one fp32 scale. Its attention is exactly
the fp32 attention over the dequantized cache; the step really writes int8 (a quarter of the bytes); its logits
stay near the fp32 cache's on two families; rows stay independent; the lean loop, the slot engine, a stack and
`serve` run it, and a kv-cache part with the native backend is refused where no native step reads it."""

from __future__ import annotations

import pytest
import torch

from tests.test_native_step import quantized, tiny_family, tiny_llama

pytestmark = pytest.mark.usefixtures("native_kernels")


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(-1) / 127
    q = torch.where(scale[..., None] > 0, x / scale[..., None], torch.zeros_like(x)).round().clamp(-127, 127)
    return q.to(torch.int8), scale


@pytest.mark.parametrize("dim", [16, 64])
def test_int8_attention_is_the_fp32_attention_of_the_dequantized_cache(dim):
    """Grouped-query heads (4 query heads on 2 kv heads), 3 rows, a bool mask hiding different tails, 150
    positions (three chunks): the int8 kernel gives the fp32 kernel's values on int8 * scale, bit for bit."""
    from infer_tune.native.attention import register

    assert register() is not None
    op = torch.ops.infer_tune_native
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, dim, generator=gen)
    k, v = torch.randn(3, 2, 150, dim, generator=gen), torch.randn(3, 2, 150, dim, generator=gen)
    (k8, ks), (v8, vs) = _int8(k), _int8(v)
    mask = torch.zeros(3, 1, 1, 150, dtype=torch.bool)
    for b, last in enumerate((20, 100, 149)):
        mask[b, ..., :last + 1] = True
    got = op.decode_attention_q8(q, k8, ks, v8, vs, mask, 0.25)
    want = op.decode_attention(q, k8.float() * ks[..., None], v8.float() * vs[..., None], mask, 0.25)
    assert torch.equal(got, want)
    assert not torch.allclose(got, op.decode_attention(q, k, v, mask, 0.25), atol=0, rtol=0)  # the grid is real


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_step_writes_int8_and_its_logits_stay_near_the_fp32_caches(tokenizer, arch):
    """The same 24-token prompt and 24 greedy steps through the native step on an fp32 and on an int8 cache: the
    int8 cache holds int8 values with their scales (a quarter of fp32's bytes plus 4 bytes a vector), the written
    vectors are the fp32 cache's rounded to their grid, and each step's logits are within a small distance."""
    from infer_tune.native.step import NativeCache, NativeCachedStep, recognize

    model = quantized(tiny_llama(tokenizer) if arch == "llama" else tiny_family(tokenizer, arch))
    parts, why = recognize(model)
    assert parts is not None, why
    ids = torch.randint(3, len(tokenizer), (1, 24), generator=torch.Generator().manual_seed(1))
    caches = {d: NativeCache(parts, 1, 128, d) for d in ("fp32", "int8")}
    steps = {d: NativeCachedStep(model, c, parts) for d, c in caches.items()}
    with torch.inference_mode():
        logits = {d: s.prefill(ids) for d, s in steps.items()}
        worst, agree = 0.0, 0
        for position in range(24, 48):
            token = logits["fp32"][0, -1].argmax().view(1, 1)  # both follow the fp32 path
            logits = {d: s(token, torch.tensor([position])) for d, s in steps.items()}
            a, b = logits["fp32"][0, -1], logits["int8"][0, -1]
            worst = max(worst, float((a - b).abs().max() / a.abs().max()))
            agree += int(a.argmax() == b.argmax())
    c8, c32 = caches["int8"], caches["fp32"]
    assert c8.keys[0].dtype == torch.int8 and c8.key_scales[0].dtype == torch.float32
    assert c8.keys[0][0, :, :48].abs().amax() == 127  # every written vector spans its grid
    assert c8.nbytes < c32.nbytes / 3
    # layer 0's inputs are the same on both paths: its vectors are the fp32 ones rounded to their grid (half a step)
    dequant = c8.keys[0][0, :, :48].float() * c8.key_scales[0][0, :, :48, None]
    reference = c32.keys[0][0, :, :48]
    assert ((dequant - reference).abs() <= reference.abs().amax(-1, keepdim=True) / 254 * 1.001 + 1e-7).all()
    assert 0 < worst < 0.05 and agree >= 22, (worst, agree)


def test_int8_rows_of_a_slot_step_do_not_depend_on_each_other(tokenizer):
    """A prompt prefilled in slot 1 beside another in slot 0 (one mixed step) gives, bit for bit, the logits and
    int8 cache rows it gets prefilled alone: the int8 cache keeps the slot engine's row independence."""
    from infer_tune.native.step import NativeCache, recognize

    model = quantized(tiny_llama(tokenizer))
    parts, _ = recognize(model)
    gen = torch.Generator().manual_seed(3)
    hidden = model.config.hidden_size
    a, b = torch.randn(10, hidden, generator=gen), torch.randn(14, hidden, generator=gen)
    both = NativeCache(parts, 2, 128, "int8")
    together = both.step(parts).step_mixed(torch.cat([a, b]), torch.tensor([0] * 10 + [1] * 14),
                                           torch.cat([torch.arange(10), torch.arange(14)]), 0, torch.tensor([9, 23]))
    alone = NativeCache(parts, 2, 128, "int8")
    one = alone.step(parts).step_mixed(b, torch.ones(14, dtype=torch.long), torch.arange(14), 0, torch.tensor([13]))
    assert torch.equal(together[1], one[0])
    for x, y in zip(both.tensors(), alone.tensors()):
        assert torch.equal(x[1], y[1])


def test_lean_loop_and_slot_engine_decode_on_the_int8_cache(tokenizer):
    """The lean loop (its own native prefill) and the slot engine (serve's) with kv_dtype int8 decode the same
    greedy tokens for a prompt, say so in their facts, and their caches are int8."""
    from infer_tune.tuners.batch.serving import LiveSlots
    from infer_tune.tuners.lean.loop import LeanDecoder

    model = quantized(tiny_llama(tokenizer))
    ids = torch.randint(3, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(2))
    decoder = LeanDecoder(model, compile=False, native_step=True, kv_dtype="int8")
    _, _, lean_tokens, _ = decoder.generate(ids, 20, [model.config.eos_token_id])
    assert decoder.facts["lean_step"] == "native" and decoder.facts["kv_dtype"] == "int8"
    assert decoder.cache.keys[0].dtype == torch.int8
    live = LiveSlots(model, [model.config.eos_token_id], slots=2, max_context=128, compile=False, native_step=True,
                     kv_dtype="int8")
    served = live.engine
    assert live.alone(ids[0].tolist(), 20, ignore_eos=True) == lean_tokens
    assert served.facts["kv_dtype"] == "int8" and served.cache.keys[0].dtype == torch.int8
    with pytest.raises(ValueError, match="native step"):
        LiveSlots(model, [1], slots=1, max_context=64, compile=False, native_step=False, kv_dtype="int8")


def test_a_native_kv_part_stacks_only_with_a_native_step(tokenizer):
    """kv-cache `quantized` + `kv_backend: native` stacks with lean (native_step), which otherwise conflicts with
    kv-cache, and is refused alone (no native step reads it); serve maps it to kv_dtype int8."""
    from infer_tune.engines.slots import SLOTS
    from infer_tune.errors import ConfigError
    from infer_tune.models import LoadedModel
    from infer_tune.tuners.base import RunContext
    from infer_tune.tuners.kv_cache import KVCacheConfig, apply_kv_cache
    from infer_tune.tuners.stack import StackConfig

    native = {"technique": "kv-cache", "impl": "quantized", "kv_backend": "native", "kv_bits": 8}
    stack = StackConfig(configs=[{"technique": "quantize", "method": "int4-rtn", "activations": "int8"}, native,
                                 {"technique": "lean", "native_step": True}])
    assert [p.technique for p in stack.configs] == ["quantize", "kv-cache", "lean"]
    StackConfig(configs=[{"technique": "kv-cache", "impl": "static"}, {"technique": "lean", "native_step": True}])
    with pytest.raises(ConfigError, match="cannot stack"):  # the compiled lean loop has a static cache of its own
        StackConfig(configs=[{"technique": "kv-cache", "impl": "static"}, {"technique": "lean"}])
    with pytest.raises(ConfigError, match="cannot stack"):
        StackConfig(configs=[{"technique": "kv-cache", "impl": "dynamic"}, {"technique": "lean", "native_step": True}])
    with pytest.raises(ConfigError, match="no 4-bit path"):
        KVCacheConfig(impl="quantized", kv_backend="native", kv_bits=4)
    loaded = LoadedModel(model=tiny_llama(tokenizer), tokenizer=tokenizer, ref="tiny", path=None)
    with pytest.raises(ConfigError, match="native step's int8 cache"):
        apply_kv_cache(loaded, KVCacheConfig(impl="quantized", kv_backend="native", kv_bits=8), RunContext())
    assert SLOTS.supports(stack) is None and SLOTS.settings(stack)["kv_dtype"] == "int8"
    # inside a native stack the part chooses the step's cache: static (fp32) or native int8, nothing for generate
    lean = StackConfig(configs=[{"technique": "lean", "native_step": True}]).configs[0]
    in_stack = RunContext(stack_parts=(lean,))
    prepared = apply_kv_cache(loaded, KVCacheConfig(impl="static"), in_stack)
    assert prepared.generate_kwargs == {} and prepared.metrics["kv_cache_owner"] == "native step"
    with pytest.raises(ConfigError, match="cannot run this one"):
        apply_kv_cache(loaded, KVCacheConfig(impl="dynamic"), in_stack)


def test_the_rows_perplexity_is_scored_on_the_cache_it_decodes_with(tokenizer):
    """Teacher-forced NLL through the native step's rows: on the fp32 cache it is the eager forward's (up to fp32
    rounding), on the int8 cache it differs, and a stack decoding on the int8 cache carries that scorer (its `ppl`
    is scored on the int8 cache, not by the eager forward)."""
    from infer_tune.metrics.perplexity import sequence_nll
    from infer_tune.models import LoadedModel
    from infer_tune.native.perplexity import native_rows_nll
    from infer_tune.native.step import recognize
    from infer_tune.tuners import apply
    from infer_tune.tuners.base import RunContext
    from infer_tune.tuners.stack import StackConfig

    model = quantized(tiny_llama(tokenizer))
    parts, _ = recognize(model)
    gen = torch.Generator().manual_seed(6)
    scored = [(torch.randint(3, len(tokenizer), (150,), generator=gen).tolist(),
               torch.randint(3, len(tokenizer), (30,), generator=gen).tolist())]  # rows cross a 128-row chunk
    eager, n = sequence_nll(model, scored)
    fp32, n32 = native_rows_nll(model, parts, scored, "fp32")
    int8, _ = native_rows_nll(model, parts, scored, "int8")
    assert n == n32 == 30 and abs(fp32 - eager) < 1e-3 * abs(eager)
    assert int8 != fp32 and abs(int8 - fp32) < 0.02 * abs(fp32)
    loaded = LoadedModel(model=model, tokenizer=tokenizer, ref="tiny", path=None)
    stack = StackConfig(configs=[{"technique": "kv-cache", "impl": "quantized", "kv_backend": "native", "kv_bits": 8},
                                 {"technique": "speculate", "draft": "prompt-lookup", "num_draft_tokens": 4,
                                  "engine": "lean", "native_step": True}])
    prepared = apply(loaded, stack, RunContext())
    try:
        assert prepared.scorer is not None and prepared.metrics["kv_dtype"] == "int8"
        assert prepared.scorer(scored)[0] == int8
    finally:
        prepared.cleanup and prepared.cleanup()
