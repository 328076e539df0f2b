"""`--weights random`: presets that match their published architectures (counted on the meta device),
seeded per-tensor weights, tiny configs of five families through the CLI (the result says random,
quality is n/a, the recommender ranks on speed only), and the layer-by-layer quantized build (same
outputs as the eager path, peak memory below one float copy of the model)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from infer_tune import weights
from infer_tune.cli import app

runner = CliRunner()
FAST = ["--warmup", "0", "--min-iterations", "1", "--min-duration", "0", "--threads", "1", "--max-rounds", "2"]

# published totals (tied embeddings once) and shapes of each preset's checkpoint
PUBLISHED = {
    "llama-3.2-1b": (1.24e9, dict(num_hidden_layers=16, hidden_size=2048, num_key_value_heads=8, vocab_size=128256)),
    "llama-3.2-3b": (3.21e9, dict(num_hidden_layers=28, hidden_size=3072, num_key_value_heads=8)),
    "llama-3.1-8b": (8.03e9, dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336)),
    "qwen2.5-1.5b": (1.54e9, dict(num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2)),
    "qwen3-1.7b": (1.72e9, dict(num_hidden_layers=28, head_dim=128, vocab_size=151936)),
    "qwen3-4b": (4.02e9, dict(num_hidden_layers=36, hidden_size=2560)),
    "gemma-3-1b": (1.00e9, dict(num_hidden_layers=26, head_dim=256, sliding_window=512, vocab_size=262144)),
    "mistral-7b": (7.24e9, dict(num_hidden_layers=32, sliding_window=4096, vocab_size=32000)),
}

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=1024)
FAMILIES = {
    "llama": {"model_type": "llama"},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},
    "gemma3": {"model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "sliding_window": 8},
}


def tiny_config(tmp_path: Path, family: str, **extra) -> Path:
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps({**TINY, **FAMILIES[family], **extra}))
    return path


def test_every_preset_ships_and_matches_its_published_architecture():
    assert set(weights.presets()) == set(PUBLISHED)
    for name, (params, shape) in PUBLISHED.items():
        config, source = weights.architecture_config(name)
        assert source == f"preset:{name}"
        for key, value in shape.items():
            assert getattr(config, key) == value, (name, key)
        counted = weights.count_params(config)  # meta device: no memory
        assert abs(counted - params) / params < 0.01, (name, counted)


def test_weights_choice_parses_and_refuses():
    assert weights.parse("pretrained") == weights.WeightsChoice()
    assert weights.parse("random") == weights.WeightsChoice("random", 0)
    assert weights.parse("random:7").seed == 7
    for bad in ("randomly", "random:-1", "random:x", "zeros"):
        with pytest.raises(weights.ConfigError):
            weights.parse(bad)


def test_seeded_weights_depend_on_seed_and_name_only(tmp_path):
    config, _ = weights.architecture_config(str(tiny_config(tmp_path, "qwen3")))
    one = weights.RandomWeights(config, 5, torch.float32, "t", "b").build()
    again = weights.RandomWeights(config, 5, torch.float32, "t", "b").build()
    other = weights.RandomWeights(config, 6, torch.float32, "t", "b").build()
    for (name, a), b, c in zip(one.state_dict().items(), again.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b), name
        if a.dim() > 1:
            assert not torch.equal(a, c), name
    assert one.lm_head.weight is one.model.embed_tokens.weight  # tied stays one tensor
    # filled in reverse order, one module at a time: the same tensors
    spec = weights.RandomWeights(config, 5, torch.float32, "t", "b")
    model = spec.skeleton()
    fill = weights.Filler(model, spec.values())
    for module in reversed(list(model.modules())):
        fill(module)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), one.state_dict().values()))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_preset_needs_random_weights_and_bad_values_exit_2():
    result = runner.invoke(app, ["bench", "--model", "llama-3.2-1b", *FAST])
    assert result.exit_code == 2 and "--weights random" in result.output
    result = runner.invoke(app, ["bench", "--model", "llama-3.2-1b", "--weights", "randomly", *FAST])
    assert result.exit_code == 2 and "--weights" in result.output
    result = runner.invoke(app, ["bench", "--model", "no-such-arch", "--weights", "random", *FAST])
    assert result.exit_code == 2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bench_of_each_family_with_random_weights(family, tmp_path, prompts_file):
    config = tiny_config(tmp_path, family)
    result = runner.invoke(app, ["bench", "--model", str(config), "--weights", "random:3", "--suite", str(prompts_file),
                                 "--limit", "2", "--max-new-tokens", "4", "--out", str(tmp_path / "runs"), "--json",
                                 *FAST])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    model = doc["model"]
    assert model["weights"] == "random" and model["weights_seed"] == 3 and model["tokenizer"].startswith("byte-level")
    assert model["model_type"] == FAMILIES[family]["model_type"]
    assert model["content_id"].startswith("random:")
    m = doc["metrics"]
    assert m["quality"] == "n/a (random weights)"
    for key in ("bleu", "chrf", "ppl"):
        assert m[key] is None, key
    assert m["tpot_ms"]["p50"] > 0 and m["generated_tokens"] > 0
    # every generated id is a real id of the model's vocabulary
    outputs = [json.loads(line) for line in (tmp_path / "runs" / doc["run_id"] / "outputs.jsonl").read_text().splitlines()]
    assert all(0 <= t < TINY["vocab_size"] for o in outputs for t in o["token_ids"])


def test_a_recipe_on_random_weights_shows_na_quality_and_ranks_on_speed_only(tmp_path, prompts_file):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("configs:\n  - technique: quantize\n    method: int8-dynamic\n")
    result = runner.invoke(app, ["bench", "--model", str(tiny_config(tmp_path, "llama")), "--weights", "random",
                                 "--recipe", str(recipe), "--suite", str(prompts_file), "--limit", "2",
                                 "--max-new-tokens", "4", "--out", str(tmp_path / "runs"), *FAST])
    assert result.exit_code == 0, result.output
    assert "n/a (random weights)" in result.output
    assert "ranked on speed only" in result.output
    docs = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/result.json")]
    quantized = next(d for d in docs if d["technique"] == "quantize")
    assert quantized["metrics"]["built"] == "layer by layer"
    assert quantized["metrics"]["ppl_delta_pct"] is None and quantized["metrics"]["broken"] is False


def test_recommender_says_speed_only_for_random_rows():
    from infer_tune.report.recommend import Budget, recommend

    def row(run_id, speedup, random):
        return {"run_id": run_id, "technique": "quantize", "label": run_id, "baseline_run_id": "b",
                "metrics": {"speedup_vs_baseline": speedup, "ppl_delta_pct": None, "bleu_drift": None},
                "config": {}, "workload": {}, "model": {"ref": "m", "weights": "random" if random else "pretrained"}}

    rec = recommend([row("a", 2.0, True), row("b", 1.5, True)], Budget())
    assert rec.doc["run_id"] == "a" and rec.speed_only and "speed only" in rec.decision()
    assert rec.to_dict()["speed_only"] is True
    real = recommend([row("a", 2.0, False)], Budget())
    assert not real.speed_only and "speed only" not in real.decision()


@pytest.mark.parametrize("family,method", [("llama", "int4-rtn"), ("qwen3", "int8-dynamic"), ("gemma3", "int4-rtn")])
def test_layerwise_quantized_build_equals_the_eager_one(family, method, tmp_path):
    import copy

    from infer_tune.tuners.quantize import apply
    from infer_tune.tuners.quantize.config import QuantizeConfig

    config, _ = weights.architecture_config(str(tiny_config(tmp_path, family)))
    spec = weights.RandomWeights(config, 11, torch.float32, "t", "b")
    qconfig = QuantizeConfig(method=method, group_size=32)
    eager = copy.deepcopy(spec.build())
    eager_summary = apply.quantize_model(eager, qconfig)
    lazy = spec.skeleton()
    lazy_summary = apply.quantize_layerwise(lazy, weights.Filler(lazy, spec.values()), qconfig)
    assert not any(p.is_meta for p in lazy.parameters())
    assert lazy_summary["layers"] == eager_summary["layers"] and lazy_summary["layers"]
    ids = torch.tensor([[3, 17, 42, 7, 99, 5]])
    with torch.no_grad():
        assert torch.equal(eager(ids).logits, lazy(ids).logits)
    float_model = spec.build()
    with torch.no_grad():
        assert not torch.equal(float_model(ids).logits, lazy(ids).logits)  # it was quantized


PEAK_SCRIPT = textwrap.dedent("""
    import json, re, sys, torch
    from infer_tune import weights
    from infer_tune.tuners.quantize import apply
    from infer_tune.tuners.quantize.config import QuantizeConfig
    config = weights.config_from_dict(json.loads(sys.argv[2]), "t")
    spec = weights.RandomWeights(config, 0, torch.float32, "t", "b")
    qconfig = QuantizeConfig(method="int4-rtn", group_size=64)
    # one build of a one-layer model first: the imports and lazy initialisations it triggers (code pages, kernel
    # tables) are resident before the peak is reset, so the peak measures the build, not the first call (without
    # it the layerwise growth varied 119-162 MB from run to run; with it 107 MB every run)
    tiny = dict(json.loads(sys.argv[2]), num_hidden_layers=1, hidden_size=128, intermediate_size=256, vocab_size=256)
    warm = weights.RandomWeights(weights.config_from_dict(tiny, "t"), 0, torch.float32, "t", "b")
    if sys.argv[1] == "layerwise":
        warm_skeleton = warm.skeleton()
        apply.quantize_layerwise(warm_skeleton, weights.Filler(warm_skeleton, warm.values()), qconfig)
    else:
        apply.quantize_model(warm.build(), qconfig)
    del warm
    skeleton = spec.skeleton()
    float_bytes = weights.meta_bytes(skeleton)
    def hwm():  # peak RSS so far (bytes)
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from what is resident now
    before = hwm()
    if sys.argv[1] == "layerwise":
        apply.quantize_layerwise(skeleton, weights.Filler(skeleton, spec.values()), qconfig)
    else:
        model = spec.build()
        apply.quantize_model(model, qconfig)
    peak = hwm()
    print(json.dumps({"float_bytes": float_bytes, "growth": peak - before}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset needs Linux /proc")
def test_layerwise_build_peaks_below_one_float_copy():
    config = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 16,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096, "max_position_embeddings": 512}

    # both builds at once, one process each: a process's peak RSS is its own, whatever runs beside it
    procs = [subprocess.Popen([sys.executable, "-c", PEAK_SCRIPT, mode, json.dumps(config)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for mode in ("layerwise", "eager")]
    try:
        done = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (_, stderr) in zip(procs, done, strict=True):
        assert proc.returncode == 0, stderr[-2000:]
    layerwise, eager = (json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in done)
    assert eager["growth"] >= eager["float_bytes"] * 0.9  # the eager path holds the whole float model
    assert layerwise["growth"] < 0.6 * layerwise["float_bytes"], layerwise  # 277 MB float; int4 + one Linear + the float table


def test_bf16_built_layer_by_layer_equals_the_converted_float_model(tmp_path):
    import copy

    from infer_tune.tuners.quantize import apply
    from infer_tune.tuners.quantize.config import QuantizeConfig

    config, _ = weights.architecture_config(str(tiny_config(tmp_path, "qwen3")))  # tied head
    spec = weights.RandomWeights(config, 4, torch.float32, "t", "b")
    eager = copy.deepcopy(spec.build())
    apply.quantize_model(eager, QuantizeConfig(method="bf16"))
    lazy = spec.skeleton()
    assert apply.quantize_layerwise(lazy, weights.Filler(lazy, spec.values()), QuantizeConfig(method="bf16")) == \
        {"dtype": "bfloat16"}
    assert lazy.lm_head.weight is lazy.model.embed_tokens.weight
    for (name, a), b in zip(eager.state_dict().items(), lazy.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert all(p.dtype == torch.bfloat16 for p in lazy.parameters())


def test_a_model_too_large_to_build_whole_skips_the_baseline_for_a_reference_that_fits(tmp_path, prompts_file,
                                                                                    monkeypatch):
    from infer_tune import models

    path = tiny_config(tmp_path, "llama")
    config, _ = weights.architecture_config(str(path))
    monkeypatch.setattr(weights, "RUNTIME_MARGIN", 0)
    monkeypatch.setattr(weights, "FIT_FRACTION", 1.0)
    fp32, bf16 = weights.footprint(config, 4), weights.footprint(config, 2)
    monkeypatch.setattr(models, "_available_bytes", lambda: (fp32 + bf16) // 2)  # bf16 fits, fp32 does not
    recipe = tmp_path / "r.yaml"
    recipe.write_text("configs:\n  - {technique: stack, configs: [{technique: quantize, method: int4-rtn}, "
                      "{technique: lean, compile: false}]}\n")
    def args(out: str) -> list[str]:
        return ["bench", "--model", str(path), "--weights", "random", "--recipe", str(recipe), "--suite",
                str(prompts_file), "--limit", "2", "--max-new-tokens", "4", "--out", str(tmp_path / out), *FAST]

    result = runner.invoke(app, args("runs"))
    assert result.exit_code == 0, result.output
    assert "the baseline is skipped" in result.output
    docs = {d["technique"]: d for d in (json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/result.json"))}
    assert set(docs) == {"quantize", "stack"}  # no plain (float32) baseline row
    reference, row = docs["quantize"], docs["stack"]
    assert reference["config"]["method"] == "bf16" and reference["metrics"]["built"] == "layer by layer"
    assert row["baseline_run_id"] == reference["run_id"]
    assert "bf16" in row["metrics"]["compared_with"] and "float32" in row["metrics"]["baseline_skipped"]
    assert row["metrics"]["speedup_vs_baseline"] > 0
    # too small for bf16 as well: the int8 reference
    monkeypatch.setattr(models, "_available_bytes", lambda: (bf16 + weights.footprint(config, 1)) // 2)
    result = runner.invoke(app, args("runs8"))
    assert result.exit_code == 0, result.output
    docs = [json.loads(p.read_text()) for p in (tmp_path / "runs8").glob("*/result.json")]
    assert sorted(d["config"].get("method", "stack") for d in docs) == ["int8-dynamic", "stack"]
    # what cannot be built layer by layer is refused in one line
    recipe.write_text("configs:\n  - {technique: kv-cache, impl: static}\n")
    result = runner.invoke(app, args("runs-kv"))
    assert result.exit_code == 2 and "layer by layer" in result.output


def test_a_16bit_architecture_is_compared_in_16_bits_not_a_float32_copy(tmp_path, prompts_file, monkeypatch):
    """`bench --recipe` of random weights whose architecture ships in bfloat16, on a CPU that computes in it:
    no float32 baseline, the bf16 reference measured first and named; `--dtype float32`, or a CPU without
    native bf16, or an architecture published in float32 keep the float32 baseline."""
    path = tiny_config(tmp_path, "qwen3", torch_dtype="bfloat16")
    monkeypatch.setattr(weights, "runs_16bit_natively", lambda dtype, flags: dtype == torch.bfloat16)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("configs:\n  - {technique: stack, configs: [{technique: quantize, method: int4-rtn}, "
                      "{technique: lean, compile: false}]}\n")

    def techniques(out: str, *extra: str, model: Path = path) -> dict:
        result = runner.invoke(app, ["bench", "--model", str(model), "--weights", "random", "--recipe", str(recipe),
                                     "--suite", str(prompts_file), "--limit", "1", "--max-new-tokens", "4",
                                     "--out", str(tmp_path / out), *extra, *FAST])
        assert result.exit_code == 0, result.output
        return {d["technique"]: d for d in (json.loads(p.read_text()) for p in (tmp_path / out).glob("*/result.json"))}

    docs = techniques("bf16")
    assert set(docs) == {"quantize", "stack"}  # no float32 baseline row
    assert docs["quantize"]["config"]["method"] == "bf16" and docs["quantize"]["metrics"]["built"] == "layer by layer"
    row = docs["stack"]
    assert row["baseline_run_id"] == docs["quantize"]["run_id"] and "bf16" in row["metrics"]["compared_with"]
    assert "ships in bfloat16" in row["metrics"]["baseline_skipped"]
    from infer_tune.report.leads import decode_speedup

    assert "bf16" in decode_speedup(row).vs  # the report names the reference, not a "baseline"
    shown = runner.invoke(app, ["bench", "--model", str(path), "--weights", "random", "--recipe", str(recipe),
                                "--suite", str(prompts_file), "--limit", "1", "--max-new-tokens", "4",
                                "--out", str(tmp_path / "bf16"), "--resume", "--json", *FAST])
    assert shown.exit_code == 0, shown.output
    assert sorted(d["technique"] for d in json.loads(shown.stdout)) == ["quantize", "stack"]  # the reference once
    assert set(techniques("fp32", "--dtype", "float32")) == {"baseline", "stack"}  # asked for: measured
    (tmp_path / "f32").mkdir()
    assert set(techniques("fp32-config", model=tiny_config(tmp_path / "f32", "qwen3"))) == {"baseline", "stack"}
    monkeypatch.setattr(weights, "runs_16bit_natively", lambda dtype, flags: False)
    assert set(techniques("no-bf16")) == {"baseline", "stack"}
