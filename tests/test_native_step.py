"""The native decode step (infer_tune/native/step.cpp, step.py): on Llama, Mistral, Qwen2, Qwen3 and Gemma 3
models with int4 a8 layers it computes what the eager model computes for a decode step (logits, the cache
entries it writes, the cache's length counters), and it declines every model it does not know, saying why,
so the lean path compiles the step instead."""

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


def quantized(model, group_size: int = 32, **config):
    quantize_in_memory(model, QuantizeConfig(method="int4-rtn", activations="int8", group_size=group_size, **config),
                       "torch")
    return model


def copy_cache(src, dst) -> None:
    for a, b in zip(src.layers, dst.layers):
        b.keys.copy_(a.keys), b.values.copy_(a.values), b.cumulative_length.copy_(a.cumulative_length)


def tiny_family(tokenizer, arch: str, **overrides):
    """A tiny random model of `arch` whose every part the step must get right shows in its values: norm weights
    away from their initial ones and zeros (a dropped norm weight, or Gemma's w where 1 + w belongs, moves the
    logits), random q / k / v biases where the family has them (initialized to zero, a dropped bias would not show)."""
    import transformers
    from transformers import AutoModelForCausalLM

    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                  bos_token_id=2, eos_token_id=1)
    extra = {"mistral": dict(sliding_window=24),
             "qwen2": dict(use_sliding_window=True, sliding_window=24, max_window_layers=1),  # layer 1 slides
             "qwen3": dict(head_dim=16),
             # sliding, full, sliding (own rotary frequencies), a query scale that is not 1/sqrt(head_dim), a cap
             "gemma3": dict(head_dim=16, num_hidden_layers=3, sliding_window=24, query_pre_attn_scalar=24,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            final_logit_softcapping=3.0)}.get(arch, {})
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "gemma3": transformers.Gemma3TextConfig}[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**common, **extra, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.3)
            elif name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.5)
    return model


def check_steps(model, parts, prompt: int = 9, steps: int = 70):
    """Each step from the same cache state: logits within fp32 rounding of the eager forward's, the same
    key and value written at the position, the same length counters after. int8 activations round each
    value to one of 255 levels, so an fp32 difference of one ulp can move a value across a level now and
    then: at most 2 of the steps may differ by more (still under 2% of the largest logit)."""
    from infer_tune.native.step import NativeStep, plain_cache

    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    caches = [plain_cache(model.config, 128) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True,
                           cache_position=torch.arange(prompt)).logits
        step = NativeStep(model, caches[1], parts)
        token = logits[:, -1].argmax(-1, keepdim=True)
        crossed = []
        for position in range(prompt, prompt + steps):  # past one attention chunk of 64 positions
            copy_cache(caches[0], caches[1])
            at = torch.tensor([position])
            want = model(input_ids=token, past_key_values=caches[0], use_cache=True, cache_position=at,
                         logits_to_keep=1).logits
            got = step(token, at)
            assert got.shape == want.shape
            scale = float(want.abs().max())
            assert torch.allclose(got, want, atol=2e-2 * scale, rtol=0), (position, float((got - want).abs().max()))
            if not torch.allclose(got, want, atol=1e-4 * scale, rtol=0):
                crossed.append(position)
                continue
            for eager, ours in zip(caches[0].layers, caches[1].layers):
                assert torch.allclose(eager.keys[:, :, position], ours.keys[:, :, position], atol=1e-5)
                assert torch.allclose(eager.values[:, :, position], ours.values[:, :, position], atol=1e-5)
                assert int(eager.cumulative_length) == int(ours.cumulative_length) == position + 1
            token = want[:, -1].argmax(-1, keepdim=True)
        assert len(crossed) <= 2, crossed


@pytest.mark.parametrize("variant", [
    {},  # SmolLM2's shape: tied head, int8 (w8a8)
    {"head_dim": 32, "tie_word_embeddings": False},  # q is wider than the hidden state; a head of its own
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, "num_key_value_heads": 1},
    {"head_bits": 4},  # an int4 head through w4a8
])
def test_native_step_computes_the_eager_step(tokenizer, variant):
    from infer_tune.native.step import recognize

    variant = dict(variant)
    head_bits = variant.pop("head_bits", 8)
    model = quantized(tiny_llama(tokenizer, **variant), head_bits=head_bits)
    parts, why = recognize(model)
    assert parts is not None, why
    check_steps(model, parts)


FAMILIES = ["mistral", "qwen2", "qwen3", "gemma3"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_native_step_computes_the_eager_step_of_each_family(tokenizer, arch):
    """Mistral (a window of 24 over every layer), Qwen2 (q / k / v biases, layer 1 sliding), Qwen3 (q / k norms
    per head), Gemma 3 ((1 + w) norms around attention and MLP, GELU, a query scale, sliding layers with their own
    rotary frequencies around a full one, a logit cap): 70 steps from a 9-token prompt, so the windows slide."""
    from infer_tune.native.step import recognize

    model = quantized(tiny_family(tokenizer, arch))
    parts, why = recognize(model)
    assert parts is not None, why
    expect = {"mistral": [24, 24], "qwen2": [0, 24], "qwen3": [0, 0], "gemma3": [24, 0, 24]}[arch]
    assert parts["windows"] == expect
    check_steps(model, parts)


@pytest.mark.parametrize("group,arch,head_bits", [(64, "llama", 8), (128, "llama", 4), (128, "qwen3", 8)])
def test_native_step_runs_the_larger_int4_groups(tokenizer, group, arch, head_bits):
    """Groups of 64 and 128 (4.5 and 4.25 bits a weight, against 5.0 at 32: the bytes a bandwidth-bound decode
    reads, bench/scaling.py) go through the native step as they are: every layer packed in groups of `group`,
    the step told that group (its packed sizes are checked against it: a step assuming 32 refuses the weights),
    its logits the eager int4 forward's, and the lean loop runs it with no fallback."""
    from infer_tune.native.step import recognize
    from infer_tune.tuners.lean.loop import LeanDecoder
    from infer_tune.tuners.quantize.modules import Int4A8Linear

    shape = dict(hidden_size=128, intermediate_size=256, head_dim=32)  # every input a whole number of 128-groups
    model = tiny_llama(tokenizer, **shape) if arch == "llama" else tiny_family(tokenizer, arch, **shape)
    model = quantized(model, group_size=group, head_bits=head_bits)
    layers = [m for m in model.modules() if type(m) is Int4A8Linear]
    assert len(layers) == 7 * model.config.num_hidden_layers + (head_bits == 4)
    assert {m.group_size for m in layers} == {group}
    parts, why = recognize(model)
    assert parts is not None, why
    assert parts["ints"][6] == group and parts["ints"][7] == (group if head_bits == 4 else 0)
    check_steps(model, parts)
    decoder = LeanDecoder(model, compile=False, native_step=True)
    ids = torch.randint(3, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(2))
    _, _, tokens, _ = decoder.generate(ids, 8, [model.config.eos_token_id])
    assert decoder.facts["lean_step"] == "native" and "lean_native_fallback" not in decoder.facts
    _, _, want, _ = LeanDecoder(model, compile=False).generate(ids, 8, [model.config.eos_token_id])
    assert tokens == want


@pytest.mark.parametrize("arch,broken", [
    ("qwen2", "bias"), ("qwen3", "head norms"), ("gemma3", "head norms"), ("gemma3", "1 + w"),
    ("gemma3", "post norms"), ("gemma3", "window"), ("mistral", "window"), ("gemma3", "cap"), ("gemma3", "rotary"),
    ("gemma3", "silu"),
])
def test_the_eager_comparison_sees_each_part_of_the_families(tokenizer, arch, broken):
    """The comparison above fails when the step leaves out a part the family has (the parts handed to step.cpp
    altered here, as a step that ignored them would compute)."""
    from infer_tune.native.step import PER_LAYER, recognize

    model = quantized(tiny_family(tokenizer, arch))
    parts, why = recognize(model)
    assert parts is not None, why
    tensors, ints, floats = list(parts["tensors"]), list(parts["ints"]), list(parts["floats"])
    layers = ints[0]
    for layer in range(layers):
        at = layer * PER_LAYER
        if broken == "bias":  # q, k, v biases
            tensors[at + 11:at + 14] = [torch.empty(0)] * 3
        elif broken == "head norms":
            tensors[at + 15:at + 17] = [torch.empty(0)] * 2
        elif broken == "1 + w":  # Gemma's norms taken as w
            for i in (0, 8, 9, 10):
                tensors[at + i] = tensors[at + i] - 1
        elif broken == "post norms":
            tensors[at + 9:at + 11] = [torch.empty(0)] * 2
        elif broken == "window":
            ints[10 + 2 * layer] = 0
        elif broken == "rotary":  # every layer on the first table (Gemma's sliding layers have their own)
            ints[10 + 2 * layer + 1] = 0
    if broken == "cap":
        floats[2] = 0.0
    elif broken == "silu":  # SiLU where Gemma's MLP has GELU (tanh)
        ints[8] = 0
    with pytest.raises(AssertionError):
        check_steps(model, {**parts, "tensors": tensors, "ints": ints, "floats": floats})


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_a_plain_cache_gives_what_transformers_sliding_cache_gives(tokenizer, arch):
    """The native step's cache keeps sliding layers at full length (position p at index p) where transformers'
    StaticCache rolls a window-long buffer: the eager model computes the same logits over both, past the window."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    from infer_tune.native.step import plain_cache

    model = tiny_family(tokenizer, arch)
    ids = torch.randint(3, len(tokenizer), (1, 30), generator=torch.Generator().manual_seed(5))  # past the window
    ours, theirs = plain_cache(model.config, 96), StaticCache(config=model.config, max_cache_len=96)
    assert all(type(layer) is StaticLayer for layer in ours.layers)
    assert any(type(layer) is not StaticLayer for layer in theirs.layers)
    with torch.no_grad():
        outputs = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:] for cache in (ours, theirs)]
        for position in range(30, 60):
            assert torch.allclose(outputs[0], outputs[1], atol=1e-5), position
            token = outputs[0][:, -1].argmax(-1, keepdim=True)
            at = torch.tensor([position])
            outputs = [model(input_ids=token, past_key_values=cache, use_cache=True, cache_position=at).logits
                       for cache in (ours, theirs)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_lean_decoder_runs_the_native_step_and_says_so(tokenizer, arch):
    """The lean loop runs the native step (no fallback) and decodes what its eager step on transformers' own
    static cache decodes (Gemma 3's and Qwen2's sliding windows, 24 positions, slide within the 40 tokens)."""
    from infer_tune.tuners.lean import LeanConfig
    from infer_tune.tuners.lean.loop import LeanDecoder, bucket

    model = quantized(tiny_llama(tokenizer) if arch == "llama" else tiny_family(tokenizer, arch))
    ids = torch.randint(3, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(2))
    decoder = LeanDecoder(model, compile=True, native_step=True)
    assert decoder.one_cache
    decoder.reserve(300)
    _, token_ns, tokens, _ = decoder.generate(ids, 40, [model.config.eos_token_id])
    assert len(tokens) == len(token_ns) == 40
    assert decoder.facts["lean_step"] == "native" and "lean_native_fallback" not in decoder.facts
    _, _, again, _ = decoder.generate(ids, 40, [model.config.eos_token_id])  # the cache reset, the step reused
    assert again == tokens and decoder.facts["lean_cache_buckets"] == [bucket(300)]
    eager = LeanDecoder(model, compile=False)
    _, _, want, _ = eager.generate(ids, 40, [model.config.eos_token_id])
    assert eager.facts["lean_step"] == "eager" and want == tokens
    assert LeanConfig(native_step=True).label() == "lean+native"


def test_compiled_prefill_fills_the_native_steps_plain_cache(tokenizer):
    """Gemma 3 with a 40-token prompt (past its 24-position window): the compiled prefill's bucket cache is plain
    like the native step's, so the tokens are the eager decoder's on transformers' own cache."""
    from infer_tune.tuners.lean.loop import LeanDecoder

    model = quantized(tiny_family(tokenizer, "gemma3"))
    ids = torch.randint(3, len(tokenizer), (1, 40), generator=torch.Generator().manual_seed(6))
    decoder = LeanDecoder(model, compile=True, native_step=True, compile_prefill=True)
    _, _, tokens, _ = decoder.generate(ids, 20, [model.config.eos_token_id])
    assert decoder.facts["lean_prefill"] == "compiled" and decoder.facts["lean_step"] == "native", decoder.facts
    _, _, want, _ = LeanDecoder(model, compile=False).generate(ids, 20, [model.config.eos_token_id])
    assert tokens == want


@pytest.mark.parametrize("case,fragment", [
    ("phi3", "is not a model class the native step runs"),
    ("attention-softcap", "soft-caps the scores"),
    ("bf16-activations", "not int4 a8 on w4a8"),
    ("hooked", "forward hooks"),
    ("dynamic-rope", "changes with the position"),
])
def test_models_it_does_not_know_get_the_compiled_step_and_the_reason(tokenizer, case, fragment):
    from infer_tune.native.step import recognize
    from infer_tune.tuners.lean.loop import LeanDecoder
    from tests.test_quantize_families import tiny

    if case == "phi3":
        model = quantized(tiny("phi3", tokenizer))
    elif case == "attention-softcap":
        model = quantized(tiny_family(tokenizer, "gemma3", attn_logit_softcapping=50.0))
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
    assert fragment in decoder.facts["lean_native_fallback"]
    if case in ("phi3", "dynamic-rope"):  # decoded by the compiled step: one captured, one guarded (a compile is
        # ~10 s of the suite; every fallback reason reaches the step through the same `_native_parts is None`)
        ids = torch.randint(3, len(tokenizer), (1, 8), generator=torch.Generator().manual_seed(3))
        decoder.generate(ids, 3, [model.config.eos_token_id])
        assert decoder.facts["lean_step"] == ("captured" if case == "phi3" else "guarded"), decoder.facts
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


def test_a_mixed_step_gives_each_row_what_it_gets_alone(tokenizer):
    """step_mixed (the slot engine's mixed step): 2 decode rows (slots 0, 1) and a 20-token prompt chunk of slot 2
    in one call (20 rows: the many-row matmul loop where the CPU has it) give, bit for bit, the decode rows'
    logits and cache entries of a step_rows of those 2 rows alone, and the prompt's last-row logits and cache of
    the same prompt run in two chunks of its own (a chunk's rows see the rows before them, written in this step)."""
    from infer_tune.native.step import llama_step, recognize

    model = quantized(tiny_llama(tokenizer))
    parts, why = recognize(model)
    assert parts is not None, why
    gen = torch.Generator().manual_seed(5)
    layers, kv, d, hidden = model.config.num_hidden_layers, model.config.num_key_value_heads, 16, model.config.hidden_size
    keys = [torch.randn(3, kv, 192, d, generator=gen) for _ in range(layers)]
    values = [torch.randn(3, kv, 192, d, generator=gen) for _ in range(layers)]
    decode_x = torch.randn(2, hidden, generator=gen)
    prompt_x = torch.randn(20, hidden, generator=gen)
    positions = torch.tensor([70, 9])

    k_mix, v_mix = [t.clone() for t in keys], [t.clone() for t in values]
    mixed = llama_step(parts, k_mix, v_mix).step_mixed(
        torch.cat([decode_x, prompt_x]), torch.tensor([0, 1] + [2] * 20), torch.cat([positions, torch.arange(20)]), 2,
        torch.tensor([0, 1, 21]))
    assert mixed.shape[0] == 3

    k_sep, v_sep = [t.clone() for t in keys], [t.clone() for t in values]
    step = llama_step(parts, k_sep, v_sep)
    alone = step.step_rows(decode_x, positions)
    step.step_mixed(prompt_x[:13], torch.full((13,), 2), torch.arange(13), 0, torch.tensor([12]))
    last = step.step_mixed(prompt_x[13:], torch.full((7,), 2), torch.arange(13, 20), 0, torch.tensor([6]))
    assert torch.equal(mixed[:2], alone)
    assert torch.equal(mixed[2], last[0])
    for layer in range(layers):
        assert torch.equal(k_mix[layer], k_sep[layer]) and torch.equal(v_mix[layer], v_sep[layer]), layer
    with pytest.raises(RuntimeError, match="slot"):  # a decode row must be its own slot
        llama_step(parts, k_mix, v_mix).step_mixed(decode_x, torch.tensor([1, 0]), positions, 2, torch.tensor([0]))
