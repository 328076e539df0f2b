"""Quantization keeps each model family's own embedding, head and norm behaviour (tiny random models of five
architectures whose embeddings, norms and heads differ: Llama, Qwen3, Gemma3, Phi3, Mistral)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from infer_tune.tuners.quantize import QuantizeConfig, wrap
from infer_tune.tuners.quantize.pipeline import quantize_in_memory
from infer_tune.tuners.quantize.serialize import load_quantized, save_quantized

METHODS = ("bf16", "int8-dynamic", "int8-static", "int4-weight", "int4-rtn")
# (min top-1 agreement, max relative logit error) vs the unquantized model on a fixed input; int4 on a
# random model moves logits ~15-30%. A Gemma embedding that loses its sqrt(hidden) scale measures 0.73 /
# 0.17 at int8: far outside the int8 bounds.
BOUNDS = {"bf16": (0.9, 0.05), "int8-dynamic": (0.9, 0.08), "int8-static": (0.9, 0.08),
          "int4-weight": (0.6, 0.4), "int4-rtn": (0.6, 0.4)}


def arch_config(arch: str, vocab: int):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                  bos_token_id=2, eos_token_id=1)
    extra = {"qwen3": dict(head_dim=16), "gemma3": dict(head_dim=16, sliding_window=16)}.get(arch, {})
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
           "gemma3": transformers.Gemma3TextConfig, "phi3": transformers.Phi3Config,
           "mistral": transformers.MistralConfig}[arch]
    return cls(**common, **extra)


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import build_tiny_tokenizer

    return build_tiny_tokenizer()


def tiny(arch: str, tokenizer) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(arch_config(arch, len(tokenizer))).eval()


def ids_for(tokenizer) -> torch.Tensor:
    return torch.randint(3, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))


def agreement(model: nn.Module, ref_logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        out = model(ids).logits.float()
    top1 = float((out.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    return top1, float((out - ref_logits).norm() / ref_logits.norm())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "phi3", "mistral"])
def test_every_method_stays_close_to_its_unquantized_self(arch, tokenizer, tmp_path):
    model = tiny(arch, tokenizer)
    ids = ids_for(tokenizer)
    with torch.no_grad():
        reference = model(ids).logits.float()
    emb_cls = type(model.get_input_embeddings())
    for method in METHODS:
        config = QuantizeConfig(method=method, group_size=32)
        candidate = copy.deepcopy(model)
        summary = quantize_in_memory(candidate, config, "torch", [ids[:1], ids[1:]] if config.calibrated else None)
        save_quantized(candidate, tokenizer, tmp_path / method,
                       {"method": method, "backend": "torch", "summary": summary,
                        "config": {k: v for k, v in config.to_dict().items() if k != "kind"}})
        reloaded = load_quantized(tmp_path / method, choose_kernels=False)
        top1, error = agreement(reloaded, reference, ids)
        min_top1, max_error = BOUNDS[method]
        assert top1 >= min_top1 and error <= max_error, (arch, method, top1, error)
        if method != "bf16":  # really quantized, and still the family's own module class
            emb = reloaded.get_input_embeddings()
            assert summary["embedding"]["bits"] in (4, 8) and wrap.is_wrapped(emb) and isinstance(emb, emb_cls)
            assert summary["head"]["kind"] in ("int4", "int8-dynamic")
        if method == "int8-static":  # every norm that feeds projections was folded, none refused
            assert summary["folded_norms"] >= 2 * 2 and not summary["unfoldable_norms"], summary


def test_gemma_embedding_keeps_its_scale(tokenizer):
    model = tiny("gemma3", tokenizer)
    emb = model.get_input_embeddings()
    original = copy.deepcopy(emb)
    ids = ids_for(tokenizer)
    scale = float(emb.embed_scale)
    assert scale == pytest.approx(64 ** 0.5)
    from infer_tune.tuners.quantize.modules import int8_per_channel

    q, s = int8_per_channel(emb.weight)
    wrap.wrap_embedding(emb, {"qweight": q, "weight_scale": s}, None)
    with torch.no_grad():
        plain_lookup = q[ids].float() * s[ids][..., None]
        assert torch.allclose(emb(ids), plain_lookup * scale, rtol=1e-5)  # the family's scale still applies
    assert wrap.verify_embedding(original, emb) < 0.01


def test_a_lookup_that_drops_the_scale_is_caught(tokenizer):
    model = tiny("gemma3", tokenizer)
    original = model.get_input_embeddings()
    plain = nn.Embedding(original.num_embeddings, original.embedding_dim)
    plain.weight.data.copy_(original.weight.data)
    assert wrap.verify_embedding(original, plain) > 0.5  # sqrt(64) = 8x off: far outside MAX_EMBEDDING_REL_ERROR


class _BypassingEmbedding(nn.Embedding):
    """Does not call super().forward: a wrap of the lookup cannot reach it."""

    def forward(self, ids):
        return nn.functional.embedding(ids, self.weight) * 2.0


def test_embedding_that_bypasses_the_lookup_is_kept_float(tokenizer):
    model = tiny("llama", tokenizer)
    old = model.get_input_embeddings()
    bypass = _BypassingEmbedding(old.num_embeddings, old.embedding_dim)
    bypass.weight.data.copy_(old.weight.data)
    model.set_input_embeddings(bypass)
    ids = ids_for(tokenizer)
    with torch.no_grad():
        reference = model(ids).logits
    summary = quantize_in_memory(model, QuantizeConfig(method="int8-dynamic"), "torch")
    assert summary["embedding"]["bits"] is None and "_BypassingEmbedding" in summary["embedding"]["kept_float"]
    assert agreement(model, reference, ids)[0] >= 0.9


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_norm_fold_measures_the_parametrization(arch, tokenizer):
    """Llama multiplies by w, Gemma by (1 + w): the fold is right for both, and verified."""
    norm = tiny(arch, tokenizer).model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x = torch.randn(3, 64)
    before = norm(x).detach()
    s = torch.rand(64) + 0.5
    assert wrap.fold_scale_into_norm(norm, s)
    assert torch.allclose(norm(x), before / s, rtol=1e-4, atol=1e-5)


class _CubedNorm(nn.Module):
    """A norm whose output is not affine in its weight: no weight edit divides it by s."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        return x * self.weight ** 3


def test_unfoldable_norm_is_refused_and_restored():
    norm = _CubedNorm()
    weight = norm.weight.detach().clone()
    assert not wrap.fold_scale_into_norm(norm, torch.full((8,), 2.0))
    assert torch.equal(norm.weight.detach(), weight)


def test_wiring_is_observed_not_guessed(tokenizer):
    """Gemma3's post_attention_layernorm normalizes the attention output and feeds no projection; its
    pre_feedforward_layernorm feeds the MLP. Name-based folding got this wrong."""
    from infer_tune.tuners.quantize.apply import targeted_linears

    model = tiny("gemma3", tokenizer)
    targets = targeted_linears(model)
    wiring = wrap.NormWiring(model, targets)
    with torch.no_grad():
        model(ids_for(tokenizer)[:1])
    wiring.remove()
    fed = wiring.fed_by
    assert fed["model.layers.0.mlp.gate_proj"] == "model.layers.0.pre_feedforward_layernorm"
    assert fed["model.layers.0.self_attn.q_proj"] == "model.layers.0.input_layernorm"
    assert "model.layers.0.self_attn.o_proj" not in fed and "model.layers.0.mlp.down_proj" not in fed
    assert "model.layers.0.post_attention_layernorm" not in fed.values()
