"""bench/scaling.py's random checkpoints: written shard by shard (never the whole model in memory), with the
tensors, names and files `RandomWeights.build` + `save_pretrained` give (docs/results.md, the scaling table)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch


def scaling_module():
    import infer_tune

    path = Path(infer_tune.__file__).resolve().parent.parent / "bench" / "scaling.py"
    spec = importlib.util.spec_from_file_location("scaling_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config(folder: Path, tied: bool) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "initializer_range": 0.02,
              "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2}
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_the_checkpoint_is_written_shard_by_shard_with_the_built_models_tensors(tmp_path, monkeypatch, tied):
    from transformers import AutoModelForCausalLM

    from infer_tune import hub, models, weights

    scaling = scaling_module()
    config_path = tiny_config(tmp_path, tied)
    shard_bytes = 40_000  # a layer's matrices are 8 KiB-32 KiB in bf16: several shards
    drawn = []
    real_values = weights.random_values

    def counting(seed, std):  # every tensor drawn, in order, with its bytes
        values = real_values(seed, std)

        def draw(name, shape, dtype):
            out = values(name, shape, dtype)
            drawn.append((name, out.numel() * out.element_size()))
            return out
        return draw

    monkeypatch.setattr(weights, "random_values", counting)
    monkeypatch.setattr(scaling, "checkpoint_dir", lambda preset, seed: tmp_path / f"random-tiny-seed{seed}")
    folder = scaling.make_checkpoint(str(config_path), 3, shard_bytes=shard_bytes)
    monkeypatch.setattr(weights, "random_values", real_values)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards == sorted(p.name for p in folder.glob("*.safetensors"))
    from safetensors.torch import load_file

    for file in shards:  # no shard holds more than its share (a single larger tensor would stand alone)
        held = load_file(str(folder / file))
        assert sum(t.numel() * t.element_size() for t in held.values()) <= shard_bytes or len(held) == 1
    assert len(drawn) == len({n for n, _ in drawn})  # each tensor drawn once

    # the same tensors, names and values as the whole model built in memory and saved by transformers
    config, source = weights.architecture_config(str(config_path))
    tokenizer, name = models.random_tokenizer(weights.vocab_size(config))
    spec = weights.RandomWeights(config=config, seed=3, dtype=torch.bfloat16, source=source, tokenizer=name)
    reference = tmp_path / "reference"
    spec.build().save_pretrained(reference)
    ours, theirs = tensors_of(folder), tensors_of(reference)
    assert sorted(ours) == sorted(theirs)
    assert ("lm_head.weight" in ours) is not tied
    assert all(ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], theirs[k]) for k in ours)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.values())
    saved = json.loads((folder / "config.json").read_text())
    assert saved == json.loads((reference / "config.json").read_text())

    # and transformers loads it as the model it was drawn as
    loaded = AutoModelForCausalLM.from_pretrained(folder, **hub.PLAIN_MODULES)  # as every load in the project
    built = spec.build()
    ids = torch.tensor([[5, 9, 200, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, built(ids).logits)
    assert json.loads((folder / "infer_tune_source.json").read_text())["shards"] == len(shards)


def test_each_metric_is_compared_with_the_served_format_at_its_best_and_judged_by_its_interval():
    """The scaling table's verdicts: the reference for decode is the format with the highest median, for TTFT
    the lowest; a target is met or missed only when the per-round interval lies on one side of its line."""
    scaling = scaling_module()
    theirs = {"q4_0": {"decode": [10.0, 11.0, 12.0], "ttft_long": [900.0, 950.0, 1000.0]},
              "q4_k_m": {"decode": [11.0, 12.0, 13.0], "ttft_long": [1000.0, 1100.0, 1200.0]}}
    assert scaling.best_served(theirs, "decode") == "q4_k_m"
    assert scaling.best_served(theirs, "ttft_long") == "q4_0"
    steady = scaling.ratio([15.0, 16.5, 18.0], [11.0, 12.0, 13.0], "decode", "q4_k_m")
    assert steady["verdict"] == "met" and steady["ci95"][0] >= 1.1 and len(steady["per_round"]) == 3
    noisy = scaling.ratio([15.0, 11.0, 19.0], [11.0, 12.0, 13.0], "decode", "q4_k_m")
    assert noisy["verdict"] == "inconclusive" and noisy["ci95"][0] < 1.1 < noisy["ci95"][1]
    behind = scaling.ratio([10.0, 11.0, 12.0], [11.0, 12.0, 13.0], "decode", "q4_k_m")
    assert behind["verdict"] == "missed"
    assert scaling.ratio([600.0, 640.0, 660.0], [900.0, 950.0, 1000.0], "ttft_long", "q4_0")["verdict"] == "met"
    assert scaling.ratio([1200.0, 1250.0, 1300.0], [900.0, 950.0, 1000.0], "ttft_long", "q4_0")["verdict"] == "missed"
    assert scaling.ratio([15.0], [11.0], "decode", "q4_k_m")["verdict"].startswith("inconclusive")


def test_a_verdict_holds_against_every_served_format_not_only_the_median_pick():
    """The format shown is the best by median, but a target is met only when it is met against every served
    format: a slower median with a wider spread can still leave the verdict inconclusive."""
    scaling = scaling_module()
    theirs = {"q4_0": {"decode": [10.0, 10.5, 11.0]}, "q4_k_m": {"decode": [9.0, 13.0, 8.0]}}
    ours = [13.0, 13.6, 14.3]
    assert scaling.best_served(theirs, "decode") == "q4_0"
    alone = scaling.ratio(ours, theirs["q4_0"]["decode"], "decode", "q4_0")
    both = scaling.judged(ours, theirs, "decode", "q4_0")
    assert alone["verdict"] == "met" and both["point"] == alone["point"]
    assert both["by_format"]["q4_k_m"]["verdict"] == "inconclusive"
    assert both["verdict"] == "inconclusive (against Q4_K_M)"
    steady = {"q4_0": {"decode": [10.0, 10.5, 11.0]}, "q4_k_m": {"decode": [9.0, 9.4, 9.9]}}
    assert scaling.judged(ours, steady, "decode", "q4_0")["verdict"] == "met"


def test_a_decode_faster_than_its_rounds_reads_is_refused_in_the_table():
    """The read-fraction column divides each round's decode by the read right after it; a mean above 1 prints as
    refused, never as a number (it was printed as 1.02 [1.01, 1.03] at 1B before the native read probe)."""
    from infer_tune.metrics import roofline

    scaling = scaling_module()
    step = 800 * 2**20
    fast = roofline.by_round([25.0, 25.2, 24.9], [1000 / 31.3, 1000 / 31.1, 1000 / 31.4], step)
    slow = roofline.by_round([30.0, 30.4, 29.9], [1000 / 31.3, 1000 / 31.1, 1000 / 31.4], step)
    assert fast["roofline_refused"] and scaling.read_cell(fast).startswith("refused")
    assert not slow["roofline_refused"] and scaling.read_cell(slow).startswith("0.")
    assert scaling.fraction_cell({"roofline_fraction": None, "roofline_refused": "x"}) == "refused (>1)"


def test_a_refused_fraction_prints_as_refused_in_the_roofline_line():
    """A 135M decode from L3 ran above the host's cached read: the line says refused instead of failing the run."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    lean_prefill = importlib.import_module("bench.lean_prefill")
    assert lean_prefill.fraction_text({"roofline_fraction": None, "roofline_refused": "decode at 1.10x"}) == \
        "refused (decode at 1.10x)"
    assert lean_prefill.fraction_text({"roofline_fraction": 0.5}) == "0.50"
