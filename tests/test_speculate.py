"""speculate on tiny random models: lossless for every draft source and engine, hand-checked counters
(per position too), tokenizer checks, multi-token timing, distillation, the CLI's bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model_dir, build_tiny_tokenizer
from typer.testing import CliRunner

from infer_tune import models
from infer_tune.errors import ConfigError
from infer_tune.runners import PreparedModel, Protocol, TokenClock, measure_generation
from infer_tune.runners.generation import generate_once
from infer_tune.sweep import prepare_inputs, run_configs
from infer_tune.tuners import RunContext
from infer_tune.tuners.speculate import SpeculateConfig, drafts, lean
from infer_tune.tuners.speculate.counters import SpeculativeCounters
from infer_tune.tuners.speculate.prepare import WARNINGS_KEY, prepare
from infer_tune.workload import Workload, encode_batches

ONCE = Protocol(warmup=1, min_iterations=1, min_duration_s=0.0)
ENV = {"mem_bandwidth_gb_s": 10.0, "threads": 1, "machine": "test"}
runner = CliRunner()
FAST = ["--warmup", "0", "--min-iterations", "1", "--min-duration", "0", "--threads", "1"]
PROMPTS = ["def add(a, b):\n    return a + b\ndef add(a, b):", "The quick brown fox jumps over the lazy dog. The quick"]


def _model_dir(path: Path, arch: str, *, layers: int = 4, hidden: int = 64, seed: int = 0, tokenizer=None,
               vocab_size: int | None = None) -> Path:
    """A random checkpoint of `arch` (llama, qwen2, gpt2) with the tiny tokenizer (or `tokenizer`)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    if arch == "llama" and tokenizer is None:
        return build_tiny_model_dir(path, layers=layers, hidden=hidden, seed=seed)
    tok = tokenizer or build_tiny_tokenizer()
    common = dict(vocab_size=vocab_size or len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.bos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                             num_attention_heads=4, num_key_value_heads=2, **common))
    elif arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=1024, **common))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                             **common))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _other_tokenizer(vocab_size: int):
    """A BPE tokenizer trained on other text: another vocabulary (same special tokens)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tmodels
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tmodels.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["lorem ipsum dolor sit amet, consectetur adipiscing elit", "zyx wvu tsr qpo", "return a + b"] * 30
    tok.train_from_iterator(text, trainer=trainers.BpeTrainer(vocab_size=vocab_size,
                            special_tokens=["<pad>", "<eos>", "<bos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("speculate")
    return {
        "llama": _model_dir(root / "llama", "llama"),
        "qwen2": _model_dir(root / "qwen2", "qwen2"),
        "gpt2": _model_dir(root / "gpt2", "gpt2"),
        "draft-llama": _model_dir(root / "draft", "llama", layers=1, hidden=32, seed=1),
        "draft-qwen2": _model_dir(root / "draft-qwen2", "qwen2", layers=1, hidden=32, seed=1),
        "big": _model_dir(root / "big", "llama", layers=5, hidden=64, seed=2),
        "other-vocab": _model_dir(root / "other", "llama", layers=1, hidden=32, tokenizer=_other_tokenizer(290)),
        "same-size": _model_dir(root / "samesize", "llama", layers=1, hidden=32, tokenizer=_other_tokenizer(300),
                                vocab_size=len(build_tiny_tokenizer())),
    }


@pytest.fixture()
def suite(tmp_path) -> Path:
    path = tmp_path / "suite.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "reference": "x"}) + "\n" for p in PROMPTS))
    return path


def _sweep(loaded, suite, tmp_path, configs, tokens=20):
    workload = Workload(suite=str(suite), limit=2, max_new_tokens=tokens, chat_template=False)
    ctx = RunContext(env=ENV, out_dir=tmp_path / "runs")
    return run_configs(loaded, prepare_inputs(loaded, workload), workload, ONCE, configs, ctx, measure_ppl=False), ctx


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_draft_source_and_engine_reproduces_greedy(dirs, suite, tmp_path, arch):
    loaded = models.load(str(dirs[arch]))
    configs = [SpeculateConfig(draft=d, num_draft_tokens=3, engine=e)
               for d in ("prompt-lookup", "self-draft:2", str(dirs[f"draft-{arch}"])) for e in ("hf", "lean")]
    configs.append(SpeculateConfig(draft="early-exit:2", num_draft_tokens=3))
    (_, docs), _ = _sweep(loaded, suite, tmp_path, configs)
    for doc in docs:
        m = doc["metrics"]
        assert m["output_mismatches"] == 0 and m["lossless"], doc["label"]
        rounds = m["rounds"]["rounds"]  # counters accumulate over the interleaved rounds
        assert m["tokens_emitted"] == m["generated_tokens"] == rounds * 2 * 20, doc["label"]
        assert m["target_forward_passes"] == m["generate_steps"], doc["label"]  # one streamer step per pass
        assert m["draft_tokens_accepted"] == m["generated_tokens"] - m["target_forward_passes"], doc["label"]
        assert sum(m["proposed_by_position"]) == m["draft_tokens_proposed"]
        assert 0 < m["draft_time_share"] < 1 and 0 < m["verify_time_share"] < 1
        assert m["draft_time_share"] + m["verify_time_share"] <= 1, doc["label"]
        if doc["config"]["draft"] != "prompt-lookup":
            assert m["draft_steps"] > 0, doc["label"]  # the draft really ran
            assert m["draft_tokenizer"] == "same"
    by = {d["label"]: d["metrics"] for d in docs}
    lookup = by["lookup-k3"]
    assert lookup["target_forward_passes"] < lookup["rounds"]["rounds"] * 2 * 20  # repetitive prompts: lookup hits
    assert by["self-draft2-k3"]["acceptance_rate"] == by["early-exit2-k3"]["acceptance_rate"]  # the same draft
    assert by["self-draft2-k3-lean"]["draft_params"] < models.count_params(loaded.model)


def test_lean_counters_hand_checked(tiny_loaded):
    """A scripted draft: all right, then wrong at its 2nd token, then wrong; 9 tokens at K=3."""
    prepared = PreparedModel(tiny_loaded.model, tiny_loaded.tokenizer)
    batch = encode_batches(tiny_loaded.tokenizer, PROMPTS[:1], 1)[0]
    plain = generate_once(prepared, batch, 9)[2][0].tolist()
    width = batch["input_ids"].shape[1]
    wrong = (plain[6] + 1) % len(tiny_loaded.tokenizer)

    class Scripted:
        def reset(self, prompt=None):
            pass

        def propose(self, seq, k, processors=None):
            at = seq.shape[1] - width
            proposal = plain[at:at + k]
            if at == 5:
                proposal[1] = wrong
            if at == 7:
                proposal[0] = (plain[7] + 1) % len(tiny_loaded.tokenizer)
            return proposal

    counters = SpeculativeCounters()
    model = tiny_loaded.model
    model.generate = lean.speculative_generate(model, Scripted(), 3, counters, "cpu")
    try:
        clock = TokenClock()
        _, _, generated, _ = generate_once(PreparedModel(model, tiny_loaded.tokenizer), batch, 9, clock=clock)
    finally:
        del model.generate
    assert generated[0].tolist() == plain
    assert clock.step_tokens == [1, 4, 2, 1, 1]  # prefill; 3 drafts + bonus; 1 + bonus; 0 + bonus; no room
    m = counters.snapshot()
    assert m["target_forward_passes"] == 5 and m["verify_passes"] == 3
    assert (m["draft_tokens_proposed"], m["draft_tokens_accepted"]) == (7, 4)
    assert m["acceptance_rate"] == pytest.approx(4 / 7)
    assert m["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert m["proposed_by_position"] == [3, 2, 2] and m["accepted_by_position"] == [2, 1, 1]
    assert m["acceptance_by_position"] == pytest.approx([2 / 3, 1 / 2, 1 / 2])
    assert m["tokens_per_target_pass"] == pytest.approx(9 / 5)


def test_hf_counters_hand_checked_with_the_target_as_its_own_draft(dirs, tmp_path):
    """A draft identical to the target is always accepted: 9 tokens at K=3 -> 4 + 4 + 1 tokens in 3 passes."""
    loaded = models.load(str(dirs["llama"]))
    ctx = RunContext(env=ENV, out_dir=tmp_path)
    prepared = prepare(loaded, SpeculateConfig(draft=str(dirs["llama"]), num_draft_tokens=3), ctx)
    batch = encode_batches(loaded.tokenizer, PROMPTS[1:], 1)[0]
    try:
        clock = TokenClock()
        _, _, generated, _ = generate_once(prepared, batch, 9, clock=clock)
    finally:
        prepared.cleanup()
    assert generated[0].tolist() == generate_once(PreparedModel(loaded.model, loaded.tokenizer), batch, 9)[2][0].tolist()
    assert clock.step_tokens == [4, 4, 1]  # transformers drafts before the first token: TTFT includes a round
    m = prepared.counters.snapshot()
    assert (m["target_forward_passes"], m["verify_passes"]) == (3, 2)
    assert (m["draft_tokens_proposed"], m["draft_tokens_accepted"]) == (6, 6)
    assert m["acceptance_by_position"] == [1.0, 1.0, 1.0] and m["mean_acceptance_length"] == 4.0
    assert m["draft_steps"] == 6
    assert any("not fewer than the target" in w for w in ctx.cache[WARNINGS_KEY])
    assert "generate" not in loaded.model.__dict__ and "_get_candidate_generator" not in loaded.model.__dict__


def test_multi_token_steps_share_one_timestamp_and_tpot_counts_tokens(tiny_loaded):
    batch = encode_batches(tiny_loaded.tokenizer, PROMPTS[:1], 1)[0]
    ctx = RunContext()
    prepared = prepare(tiny_loaded, SpeculateConfig(draft="prompt-lookup", num_draft_tokens=4, engine="lean"), ctx)
    try:
        run = measure_generation(prepared, [batch], 16, Protocol(warmup=1, min_iterations=1, min_duration_s=0))
    finally:
        prepared.cleanup()
    request = run.requests[0]
    assert sum(request.step_tokens) == len(request.token_ns) == 16
    assert max(request.step_tokens) > 1, "the repetitive prompt should let several tokens through in one step"
    k = 0
    for n in request.step_tokens:  # tokens of one step carry that step's time
        assert len(set(request.token_ns[k:k + n])) == 1
        k += n
    assert len(request.itl_ms) == len(request.step_tokens) - 1
    assert request.tpot_ms == pytest.approx((request.token_ns[-1] - request.token_ns[0]) / 1e6 / 15)
    assert run.counters["target_forward_passes"] == len(request.step_tokens)  # timed pass only (warmup reset)


def test_self_draft_is_the_targets_first_layers(tiny_loaded):
    target = tiny_loaded.model
    draft = drafts.self_draft(target, 1)
    assert draft.model.layers[0] is target.model.layers[0] and len(draft.model.layers) == 1
    assert draft.lm_head is target.lm_head and drafts.unshared_bytes(draft, target) == 0
    ids = torch.tensor([[5, 6, 7, 8]])
    target.config.num_hidden_layers = 1  # what assistant_early_exit does
    try:
        expected = target(input_ids=ids).logits
    finally:
        target.config.num_hidden_layers = 2
    assert torch.allclose(draft(input_ids=ids).logits, expected)
    assert not torch.allclose(target(input_ids=ids).logits, expected)
    with pytest.raises(ConfigError, match="between 1 and 1"):
        drafts.self_draft(target, 2)


def test_early_exit_refused_where_the_model_ignores_it(dirs):
    gpt2 = models.load(str(dirs["gpt2"]))
    assert not drafts.early_exit_supported(gpt2.model, 2)
    assert drafts.early_exit_supported(models.load(str(dirs["llama"])).model, 2)
    with pytest.raises(ConfigError, match="ignores a lowered num_hidden_layers"):
        prepare(gpt2, SpeculateConfig(draft="early-exit:2"), RunContext())


def test_gpt2_self_draft_and_lookup_lean_are_lossless(dirs, suite, tmp_path):
    loaded = models.load(str(dirs["gpt2"]))
    configs = [SpeculateConfig(draft="self-draft:2", num_draft_tokens=2, engine="lean"),
               SpeculateConfig(draft="prompt-lookup", num_draft_tokens=4, engine="hf")]
    (_, docs), _ = _sweep(loaded, suite, tmp_path, configs, tokens=12)
    assert [d["metrics"]["output_mismatches"] for d in docs] == [0, 0]


def test_tokenizer_checks(dirs, monkeypatch):
    target = models.load(str(dirs["llama"]))
    ctx = RunContext()
    with pytest.raises(ConfigError, match="no universal path"):  # another vocabulary of the same size
        prepare(target, SpeculateConfig(draft=str(dirs["same-size"])), ctx)
    with pytest.raises(ConfigError, match="needs the same tokenizer"):
        prepare(target, SpeculateConfig(draft=str(dirs["other-vocab"]), engine="lean"), ctx)
    monkeypatch.setattr(drafts, "universal_path_available", lambda: False)
    with pytest.raises(ConfigError, match="no universal assisted generation"):
        prepare(target, SpeculateConfig(draft=str(dirs["other-vocab"])), ctx)


def test_universal_assisted_generation_is_lossless(dirs, suite, tmp_path):
    loaded = models.load(str(dirs["llama"]))
    (_, docs), _ = _sweep(loaded, suite, tmp_path, [SpeculateConfig(draft=str(dirs["other-vocab"]), num_draft_tokens=3)],
                          tokens=12)
    m = docs[0]["metrics"]
    assert m["draft_tokenizer"] == "universal" and m["output_mismatches"] == 0 and m["draft_steps"] > 0


def test_config_validation():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="num_draft_tokens"):
            SpeculateConfig(num_draft_tokens=bad)
    with pytest.raises(ConfigError, match="layer count"):
        SpeculateConfig(draft="self-draft:x")
    with pytest.raises(ConfigError, match="engine 'hf'"):
        SpeculateConfig(draft="early-exit:2", engine="lean")
    assert SpeculateConfig(draft="prompt-lookup", num_draft_tokens=8).label() == "lookup-k8"
