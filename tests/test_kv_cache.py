"""kv-cache on the tiny random Llama: lossless variants, measured vs analytic bytes, FLOP hand count, CLI errors."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infer_tune.cli import app
from infer_tune.errors import ConfigError
from infer_tune.metrics import kv
from infer_tune.runners import Protocol
from infer_tune.runners.generation import generate_once
from infer_tune.scenarios.kv_cache import KVSweepSpec, run_kv_sweep, suite_token_ids
from infer_tune.tuners import RunContext, apply
from infer_tune.tuners.kv_cache import KVCacheConfig, probe_cache

runner = CliRunner()
FAST = Protocol(warmup=0, min_iterations=1, min_duration_s=0.0)
ENV = {"mem_bandwidth_gb_s": 10.0, "threads": 1, "machine": "test"}


def _batch(loaded, tokens: int) -> dict[str, torch.Tensor]:
    ids = torch.tensor([suite_token_ids(loaded.tokenizer, "code", 0, tokens)[:tokens]])  # [1, tokens]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_none_dynamic_static_identical_greedy(tiny_loaded):
    batch = _batch(tiny_loaded, 48)
    generated = {}
    for impl in ("none", "dynamic", "static"):
        prepared = apply(tiny_loaded, KVCacheConfig(impl=impl, context_tokens=48))
        _, token_ns, ids, _ = generate_once(prepared, batch, 24)  # length pinned: 24 tokens each
        assert len(token_ns) == 24
        generated[impl] = ids[0].tolist()
    assert generated["none"] == generated["dynamic"] == generated["static"]


def test_sweep_writes_results_with_kv_keys(tiny_loaded, tmp_path):
    spec = KVSweepSpec(impls=["none", "dynamic", "static", "offloaded"], context_lengths=[32], max_new_tokens=12,
                       suite="code")
    sweep = run_kv_sweep(tiny_loaded, spec, FAST, RunContext(env=ENV, out_dir=tmp_path))
    by_impl = {d["config"]["impl"]: d for d in sweep.docs}
    assert set(by_impl) == {"none", "dynamic", "static"}
    assert [r["impl"] for r in sweep.not_applicable] == ["offloaded"]  # CPU: reported, not pretended
    for impl, doc in by_impl.items():
        m = doc["metrics"]
        assert doc["technique"] == "kv-cache" and doc["config"]["impl"] == impl
        assert len(m["per_position_ms"]) == 11
        assert m["identical_to_dynamic"] is True
        assert m["flops_without_cache"] > m["flops_with_cache"] > 0
        assert (tmp_path / doc["run_id"] / "latency.png").read_bytes()[:4] == b"\x89PNG"
    assert by_impl["none"]["metrics"]["kv_cache_bytes"] == 0
    assert by_impl["dynamic"]["metrics"]["logits_last_token_only"] is True
    assert {c["claim"] for c in sweep.claims} == {"compute_saved_at_500_tokens", "kv_bytes_at_long_context"}


@pytest.mark.parametrize("impl", ["dynamic", "static"])
def test_measured_kv_bytes_match_analytic(tiny_loaded, impl):
    prompt, new = 50, 10
    prepared = apply(tiny_loaded, KVCacheConfig(impl=impl, context_tokens=prompt))
    probe = probe_cache(prepared, _batch(tiny_loaded, prompt), new)
    shape = kv.ModelShape.from_config(tiny_loaded.model.config)
    analytic = kv.kv_bytes(shape, prompt + new - 1, 32)  # float32 model
    assert probe["kv_cache_bytes"] == pytest.approx(analytic, rel=0.05)


@pytest.fixture
def quanto_unpack_in_torch(monkeypatch):
    """optimum-quanto's CPU unpack is a C++ extension (`quanto_cpp`) that quanto compiles into its own package folder
    the first time a process in a fresh environment dequantizes (35.6 s on this host's 2 cores, as on CI): the same four
    ATen ops (masks, shifts, one cat) called here from Python. The test checks the cache's stored bytes, which the
    unpack kernel does not touch; the product keeps quanto's own kernel."""
    from types import SimpleNamespace

    from optimum.quanto.library.extensions import get_extension

    def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:  # optimum/quanto/library/extensions/cpp/unpack.cpp
        assert packed.dtype == torch.uint8 and bits in (2, 4)
        if bits == 4:
            return torch.cat([packed & 0x0F, (packed & 0xF0) >> 4], 0)
        return torch.cat([packed & 0x03, (packed & 0x0C) >> 2, (packed & 0x30) >> 4, (packed & 0xC0) >> 6], 0)

    extension = get_extension("quanto_cpp")
    if extension._lib is None:  # not built and loaded by this process already
        monkeypatch.setattr(extension, "_lib", SimpleNamespace(unpack=unpack))


def test_quantized_4bit_cache_is_under_35pct_of_16bit(tiny_loaded, quanto_unpack_in_torch):
    prompt, residual = 128, 8
    new = residual + 1  # the residual full-precision window is flushed into the quantized states at the end
    config = KVCacheConfig(impl="quantized", context_tokens=prompt, kv_bits=4, kv_residual_tokens=residual)
    probe = probe_cache(apply(tiny_loaded, config), _batch(tiny_loaded, prompt), new)
    shape = kv.ModelShape.from_config(tiny_loaded.model.config)
    sixteen_bit = kv.kv_bytes(shape, prompt + new - 1, 16)
    assert probe["kv_cache_class"] == "QuantizedCache"
    assert 0 < probe["kv_cache_bytes"] <= 0.35 * sixteen_bit


def test_flop_counter_matches_hand_count():
    shape = kv.ModelShape(layers=2, heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=128, vocab=100,
                          max_positions=1024)
    # per token, linear: 2 FLOPs x 2 layers x (q 64*64 + k,v 2*64*32 + o 64*64 + MLP 3*64*128)
    linear = 2 * 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)
    assert linear == 147_456
    attn_per_key = 4 * 2 * 4 * 16  # QK^T and AV: 4 FLOPs x layers x heads x head_dim per attended key = 512
    lm_head = 2 * 64 * 100  # 12_800, last position only
    # prompt 3, 2 new tokens. With cache: prefill (3 tokens, keys 1+2+3) then one token at position 4.
    prefill = 3 * linear + attn_per_key * (1 + 2 + 3) + lm_head
    assert prefill == 458_240
    decode = linear + attn_per_key * 4 + lm_head
    assert decode == 162_304
    assert kv.flops_with_cache(shape, 3, 2) == prefill + decode == 620_544
    # Without cache: step 0 = prefill; step 1 recomputes 4 tokens (keys 1+2+3+4).
    step1 = 4 * linear + attn_per_key * (1 + 2 + 3 + 4) + lm_head
    assert kv.flops_without_cache(shape, 3, 2) == prefill + step1 == 1_065_984
    assert kv.ModelShape.from_config({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "hidden_size": 64, "intermediate_size": 128, "vocab_size": 100,
                                      "max_position_embeddings": 1024}) == shape


def test_compute_claim_and_per_position():
    shape = kv.ModelShape(layers=30, heads=9, kv_heads=3, head_dim=64, hidden=576, intermediate=1536,
                          vocab=49152, max_positions=8192)
    claim = kv.compute_claim(shape, 128)
    assert claim["held"] and claim["flops_saved_fraction"] > 0.8
    assert kv.kv_bytes(shape, 131072, 16) == 2 * 30 * 3 * 64 * 131072 * 2


@pytest.mark.parametrize("kwargs", [{"impl": "paged"}, {"impl": "quantized", "kv_bits": 3},
                                    {"impl": "quantized", "kv_bits": 4, "kv_backend": "fp8"},
                                    {"impl": "dynamic", "compile": True}])
def test_config_rejects_bad_fields(kwargs):
    with pytest.raises(ConfigError):
        KVCacheConfig(**kwargs)


def _cli(*args: str):
    return runner.invoke(app, ["kv-cache", *args])


@pytest.mark.parametrize("args, message", [
    (["--impl", "none,paged"], "unknown 'paged'"),
    (["--kv-bits", "3"], "no 3-bit path"),
    (["--context-lengths", "128,abc"], "comma-separated integers"),
])
def test_cli_bad_inputs_exit_2(args, message, tiny_model_dir):
    result = _cli("--model", str(tiny_model_dir), *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_cli_context_beyond_model_maximum(tiny_model_dir):
    result = _cli("--model", str(tiny_model_dir), "--context-lengths", "1000", "--max-new-tokens", "100")
    assert result.exit_code == 2
    assert "exceeds" in result.output and "1024" in result.output


def test_cli_model_config_not_a_config(tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text(json.dumps({"name": "not a model"}))
    assert _cli("--model-config", str(notes)).exit_code == 2
    text = tmp_path / "readme.txt"
    text.write_text("hello")
    result = _cli("--model-config", str(text))
    assert result.exit_code == 2 and "not a JSON model config" in result.output
    assert _cli("--model-config", str(tmp_path / "missing")).exit_code == 2


def test_cli_model_config_kv_bytes(tiny_model_dir):
    result = _cli("--model-config", str(tiny_model_dir), "--context", "131072", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kv_bytes_by_dtype"]["bf16/fp16"] == 2 * 2 * 2 * 16 * 131072 * 2  # layers, kv heads, head dim
    assert doc["kv_bytes_by_dtype"]["int4"] == doc["kv_bytes_by_dtype"]["bf16/fp16"] // 4


def test_kv_sweep_resume_reads_back_finished_context_lengths(tiny_loaded, tmp_path):
    from infer_tune import env as envinfo
    from infer_tune.results import find_results
    from infer_tune.runners import Protocol
    spec = KVSweepSpec(impls=["dynamic", "static"], context_lengths=[16], max_new_tokens=4, suite="code")
    once = Protocol(warmup=0, min_iterations=1, min_duration_s=0)
    env = envinfo.collect_env(1)
    first = run_kv_sweep(tiny_loaded, spec, once, RunContext(env=env, out_dir=tmp_path))
    again = run_kv_sweep(tiny_loaded, spec, once, RunContext(env=env, out_dir=tmp_path), resume=True)
    assert [d["run_id"] for d in again.docs] == [d["run_id"] for d in first.docs]
    # the two variants and the baseline they were measured against in rounds, nothing measured twice
    assert sorted(d["technique"] for d in find_results(tmp_path)) == ["baseline", "kv-cache", "kv-cache"]
