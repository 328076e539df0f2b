"""Crafted result files and JSON from outside (docs/hardening.md, "Second attack pass"): each ends cleanly,
a file skipped with its reason named (leaderboard) or one `error:` line and exit 2 (compare, loaders)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from result_docs import make_result, save
from typer.testing import CliRunner

from infer_tune import jsonsafe
from infer_tune.cli import app
from infer_tune.errors import ConfigError

runner = CliRunner()
DEEP = "[" * 200_000 + "]" * 200_000


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def candidate(run_id: str, **metrics) -> dict:
    doc = make_result(run_id, technique="quantize", config={"method": run_id}, seed=2,
                      **{"bleu_drift": 0.0, "ppl_delta_pct": 0.0, **metrics})
    doc["baseline_run_id"] = "base"
    return doc


def write_raw(doc_text: str, runs: Path, name: str) -> Path:
    folder = runs / name
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(doc_text)
    return folder


@pytest.mark.parametrize("value, reason", [
    (1e308, "'metrics.speedup_vs_baseline' is 1e+308, expected a finite number within"),
    ("fast", "'metrics.speedup_vs_baseline' is str 'fast', expected a number"),
    (float("inf"), "'metrics.speedup_vs_baseline' is inf"),
    (-3.0, "'metrics.speedup_vs_baseline' is -3.0, expected a ratio above 0"),
    (0.0, "'metrics.speedup_vs_baseline' is 0.0, expected a ratio above 0"),
])
def test_a_result_with_an_impossible_value_is_skipped_by_name_and_refused_by_compare(tmp_path, value, reason):
    runs = tmp_path / "runs"
    base = save(make_result("base", seed=1), runs)
    good = save(candidate("good", speedup_vs_baseline=1.1), runs)
    bad = write_raw(json.dumps(candidate("bad", speedup_vs_baseline=value)), runs, "bad")
    result = runner.invoke(app, ["leaderboard", str(runs), "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "bad/result.json" in warnings[0] and reason in warnings[0], result.stderr
    doc = json.loads(result.stdout)
    assert {row["run_id"] for row in doc["rows"]} == {"base", "good"}
    assert (doc["recommendation"].get("run_id") or "good") == "good"
    refused = runner.invoke(app, ["compare", str(base), str(bad)])
    assert refused.exit_code == 2 and reason in one_error_line(refused)
    assert runner.invoke(app, ["compare", str(base), str(good)]).exit_code == 0


def test_a_string_where_any_reported_number_belongs_is_skipped(tmp_path):
    runs = tmp_path / "runs"
    save(make_result("base", seed=1), runs)
    write_raw(json.dumps(candidate("bad", bleu="high")), runs, "bad")
    result = runner.invoke(app, ["leaderboard", str(runs), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "'metrics.bleu' is str 'high', expected a number" in result.stderr


def test_a_deeply_nested_result_is_skipped_and_refused_in_one_line(tmp_path):
    runs = tmp_path / "runs"
    base = save(make_result("base", seed=1), runs)
    doc = json.dumps(candidate("deep"))
    deep = write_raw(doc[:-1] + ', "extra": ' + DEEP + "}", runs, "deep")
    shallow = write_raw(doc[:-1] + ', "extra": ' + "[" * 100 + "]" * 100 + "}", runs, "shallow")
    result = runner.invoke(app, ["leaderboard", str(runs), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "deep/result.json" in result.stderr and "shallow/result.json" in result.stderr
    assert "nested deeper than 64 levels" in result.stderr
    for bad in (deep, shallow):
        refused = runner.invoke(app, ["compare", str(base), str(bad)])
        assert refused.exit_code == 2 and "nested deeper than 64 levels" in one_error_line(refused)


def test_a_deeply_nested_load_file_is_one_config_error(tmp_path):
    from infer_tune.tuners.experts import loadfile

    path = tmp_path / "load.json"
    path.write_text('{"layers": ' + DEEP + "}")
    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
        loadfile.load(path)


def test_bounded_json_loads():
    assert jsonsafe.loads('{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    assert jsonsafe.depth([[[]]]) == 3 and jsonsafe.depth(5) == 0
    assert jsonsafe.loads("[" * 64 + "]" * 64)
    for text in ("[" * 65 + "]" * 65, DEEP, '{"a": ' * 100_000 + "1" + "}" * 100_000):
        with pytest.raises(json.JSONDecodeError, match="nested deeper than 64 levels"):
            jsonsafe.loads(text)


EVIL = "\x1b[2J\x1b]0;pwned\x07evil\u202eabc\x08\x9b31m"


def test_control_characters_of_a_result_never_reach_the_terminal_or_the_files(tmp_path):
    """A label (and suite, model, config) with ESC sequences, BEL, backspace, a C1 CSI and a bidi override:
    the terminal table, leaderboard.md / .csv / .html and the recommendation carry none of them."""
    runs = tmp_path / "runs"
    save(make_result("base", seed=1), runs)
    doc = candidate("evil", speedup_vs_baseline=1.5)
    doc["label"] = f"int8 {EVIL}"
    doc["model"]["ref"] = f"smollm2-135m{EVIL}"
    doc["config"] = {"method": f"m{EVIL}"}
    save(doc, runs)
    out = tmp_path / "out"
    result = runner.invoke(app, ["leaderboard", str(runs), "--out", str(out)])
    assert result.exit_code == 0, result.output
    texts = {"stdout": result.stdout, "stderr": result.stderr,
             **{name: (out / name).read_text(encoding="utf-8")
                for name in ("leaderboard.md", "leaderboard.csv", "leaderboard.html")}}
    for where, text in texts.items():
        bad = sorted({hex(ord(c)) for c in text if (ord(c) < 32 and c not in "\n\r\t") or 0x7F <= ord(c) < 0xA0
                      or c in "\u202e\u200e\u200f"})
        assert not bad, f"{where} carries control characters {bad}"
    assert "int8 [2J]0;pwnedevilabc31m" in texts["leaderboard.md"]
    assert "int8 [2J]0;pwnedevilabc31m" in texts["leaderboard.csv"]
    assert "int8 [2J]0;pwnedevilabc31m" in texts["leaderboard.html"]


def test_a_tampered_but_self_consistent_quantized_checkpoint_cannot_be_loaded(tiny_loaded, prompts_file, tmp_path):
    """q_proj cut to half its outputs in both the tensors and nothing else to contradict it: `cannot load
    model` (ModelError, exit 2) at load, not a kernel error (exit 3) at the first forward pass."""
    from safetensors.torch import load_file, save_file
    from test_quantize import quantized_copy

    from infer_tune import models
    from infer_tune.errors import ModelError
    from infer_tune.tuners.quantize.serialize import save_quantized

    model, config, summary = quantized_copy(tiny_loaded, "int8-dynamic", prompts_file)
    target = tmp_path / "q"
    save_quantized(model, tiny_loaded.tokenizer, target, {"method": "int8-dynamic", "backend": "torch",
                   "summary": summary, "config": {k: v for k, v in config.to_dict().items() if k != "kind"}})
    assert models.load(str(target)).model is not None  # the untouched checkpoint loads
    state = load_file(str(target / "model.safetensors"))
    prefix = "model.layers.0.self_attn.q_proj."
    rows = state[prefix + "qweight"].shape[0]
    for key in [k for k in state if k.startswith(prefix)]:
        if state[key].dim() >= 1 and state[key].shape[0] == rows:
            state[key] = state[key][: rows // 2].contiguous()
    save_file(state, str(target / "model.safetensors"))
    with pytest.raises(ModelError, match=rf"cannot load model .*q_proj is saved as \d+ -> {rows // 2} features but "
                                         rf"config.json makes it \d+ -> {rows}"):
        models.load(str(target))


def test_leaderboard_memory_does_not_grow_with_the_samples_of_each_row(tmp_path):
    """`leaderboard` held every row's per-request samples (~0.45 MB per row: 2,000 rows took 1.37 GB);
    it keeps none now. tracemalloc's peak over 8 and 32 rows of 2,000 requests each grows by less than
    100 KB per row (it grew by about 1 MB per row before)."""
    import tracemalloc

    def peak(rows: int) -> int:
        runs = tmp_path / f"runs{rows}"
        save(make_result("base", seed=1, n=2000), runs)
        for k in range(rows - 1):
            save(candidate(f"row{k}", n=2000, speedup_vs_baseline=1.0 + k / 100), runs)
        tracemalloc.start()
        try:
            result = runner.invoke(app, ["leaderboard", str(runs), "--out", str(tmp_path / f"out{rows}"),
                                         "--format", "md,csv", "--json"])
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            assert result.exit_code == 0, result.output

    peak(4)  # imports and caches outside the measurement
    small, large = peak(8), peak(32)
    assert (large - small) / 24 < 100_000, f"{(large - small) / 24 / 1e3:.0f} KB per row"
