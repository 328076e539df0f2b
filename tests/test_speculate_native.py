"""Prompt-lookup speculation verified by the native decode step (tuners/speculate/lean.py `NativeVerifier`):
on int4 a8 models of each family the step runs, the speculative output is the native greedy decode's token for
token, drafts are accepted (so multi-row verify passes really ran), and `speculate prepare` wires the verifier
in only where the step runs the model."""

from __future__ import annotations

import pytest
import torch

from infer_tune.runners import PreparedModel
from infer_tune.runners.generation import generate_once
from infer_tune.tuners import RunContext
from infer_tune.tuners.speculate import SpeculateConfig, lean
from infer_tune.tuners.speculate.counters import SpeculativeCounters
from infer_tune.tuners.speculate.prepare import prepare
from tests.test_native_step import quantized, tiny_family

pytestmark = pytest.mark.usefixtures("native_kernels")


@pytest.fixture(scope="module")
def tokenizer():
    from tests.conftest import build_tiny_tokenizer

    return build_tiny_tokenizer()


class NoDraft:
    def reset(self, prompt=None):
        pass

    def propose(self, seq, k, processors=None):
        return []


def decode(model, tokenizer, drafter, prompt, new: int, k: int = 4) -> tuple[list[int], dict]:
    from infer_tune.native.step import recognize

    parts, why = recognize(model)
    assert parts is not None, why
    counters = SpeculativeCounters()
    model.generate = lean.speculative_generate(model, drafter, k, counters, "cpu",
                                               verifier=lean.NativeVerifier(model, parts))
    try:
        batch = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
        out = generate_once(PreparedModel(model, tokenizer), batch, new)[2][0].tolist()
    finally:
        del model.generate
    return out, counters.snapshot()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_lookup_verified_natively_gives_the_native_greedy_decode(tokenizer, arch):
    model = quantized(tiny_family(tokenizer, arch))
    torch.manual_seed(1)
    motif = torch.randint(3, len(tokenizer), (7,))
    prompt = torch.cat([motif, motif, motif[:4]]).view(1, -1)  # repeats: lookup has something to propose
    plain, plain_counts = decode(model, tokenizer, NoDraft(), prompt, 40)
    spec, counts = decode(model, tokenizer, lean.LookupDrafter(2, [1]), prompt, 40)
    assert spec == plain
    assert plain_counts["draft_tokens_proposed"] == 0
    assert counts["draft_tokens_proposed"] > 0 and counts["verify_passes"] > 0
    # eager torch on the same weights: the native rows agree with it (to fp32 rounding: the same greedy tokens here)
    eager = generate_once(PreparedModel(model, tokenizer), {"input_ids": prompt,
                                                            "attention_mask": torch.ones_like(prompt)}, 40)
    assert eager[2][0].tolist()[:16] == plain[:16]


def test_prepare_runs_the_verify_natively_only_where_the_step_runs(tokenizer, tmp_path):
    from infer_tune.models import LoadedModel

    native = quantized(tiny_family(tokenizer, "llama"))
    plain = tiny_family(tokenizer, "llama")  # fp32 layers: the step declines it
    config = SpeculateConfig(draft="prompt-lookup", num_draft_tokens=4, engine="lean", native_step=True)
    assert config.label() == "lookup-k4-lean-native"
    for model, verify in ((native, "native"), (plain, "torch")):
        loaded = LoadedModel(model=model, tokenizer=tokenizer, ref="tiny", path="")
        prepared = prepare(loaded, config, RunContext(out_dir=tmp_path))
        try:
            assert prepared.metrics["speculate_verify"] == verify
            assert ("speculate_native_fallback" in prepared.metrics) == (verify == "torch")
        finally:
            prepared.cleanup()
    with pytest.raises(Exception, match="native_step"):
        SpeculateConfig(draft="prompt-lookup", engine="hf", native_step=True)
