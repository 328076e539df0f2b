import pytest
import torch

from infer_tune import models
from infer_tune.errors import ModelError


@pytest.mark.parametrize("ref, message", [
    ("no-such-model", "unknown model"),
    ("./missing/dir", "not found"),
    ("/definitely/missing.gguf", "GGUF file not found"),
])
def test_resolve_errors(ref, message):
    with pytest.raises(ModelError, match=message):
        models.resolve(ref)


def test_resolve_rejects_text_renamed_gguf(tmp_path):
    fake = tmp_path / "x.gguf"
    fake.write_text("not gguf")
    with pytest.raises(ModelError, match="not a GGUF file"):
        models.resolve(str(fake))


def test_resolve_dir_without_config(tmp_path):
    with pytest.raises(ModelError, match="without config.json"):
        models.resolve(str(tmp_path))


def test_hf_id_passes_through_online_and_fails_at_once_offline(monkeypatch):
    import pytest

    from infer_tune import hub
    from infer_tune.errors import ModelError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "_reachable", True)
    assert models.resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="offline .*built-in alias .*smollm2-135m"):
        models.resolve("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_load_local_checkpoint(tiny_model_dir):
    loaded = models.load(str(tiny_model_dir))
    assert loaded.tokenizer.padding_side == "left"
    assert loaded.dtype == "float32"
    assert loaded.params == sum(p.numel() for p in loaded.model.parameters())


def test_a_loaded_model_runs_its_own_modules_not_hub_kernels(tiny_model_dir, monkeypatch):
    """transformers >= 5.25 swaps layers for kernels fetched from the hub unless told not to: every load asks for
    the architecture's own modules (a baseline with downloaded code in it is not what a technique is measured
    against)."""
    from transformers import AutoModelForCausalLM

    seen = []
    original = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_kernels"))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    models.load(str(tiny_model_dir))
    assert seen == [False]


def test_model_bytes_counts_tied_weights_once():
    lin = torch.nn.Linear(8, 8, bias=False)
    module = torch.nn.Sequential(lin, torch.nn.Linear(8, 8, bias=False))
    module[1].weight = lin.weight
    assert models.model_bytes(module) == 8 * 8 * 4


def test_model_bytes_of_a_meta_skeleton_counts_every_matrix():
    """A skeleton built on the meta device (a random-weight model built layer by layer) has the bytes its
    materialised model has: every meta tensor's storage address is 0, so an address key counted one of them."""
    def build():
        module = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16, bias=False))
        module[2].weight = module[0].weight  # tied, as a head on its embedding
        return module

    with torch.device("meta"):
        skeleton = build()
    assert models.model_bytes(skeleton) == models.model_bytes(build()) == (16 * 8 + 8 * 8 + 8) * 4
    assert models.model_bytes(skeleton, float_bytes=2) == (16 * 8 + 8 * 8 + 8) * 2


def test_model_bytes_of_bf16_is_half(tiny_loaded):
    fp32 = models.model_bytes(tiny_loaded.model)
    assert models.model_bytes(tiny_loaded.model.to(torch.bfloat16)) == fp32 // 2
