"""Progress in a log (no terminal): one line per finished config with its label, key figure, elapsed
time and the recipe's ETA, and a heartbeat at most every 30 s while a step is silent. CliRunner's
output is not a terminal, so the command-line test sees exactly what a CI log gets."""

from __future__ import annotations

import re

import yaml
from result_docs import make_result, save
from typer.testing import CliRunner

from infer_tune.cli import app
from infer_tune.cli.progress import LineProgress, duration

FAST = ["--warmup", "0", "--min-iterations", "1", "--min-duration", "0", "--threads", "1"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_line_per_finished_config_with_its_key_figure_and_the_recipe_eta(tmp_path):
    clock, lines = Clock(), []
    progress = LineProgress(lines.append, out_dir=tmp_path, clock=clock, start_thread=False)
    progress("configs", 0, 2)  # the sweep starts
    progress("recipe", 0, 4)
    assert lines == []
    clock.now += 20
    save(make_result("r-base", seed=1), tmp_path)  # the baseline is saved with the first config of its group
    doc = make_result("r-int8", technique="quantize", speedup_vs_baseline=3.64, speedup_vs_baseline_ci95=[3.58, 3.70],
                      seed=2)
    doc["label"] = "int8-dynamic-torch"
    save(doc, tmp_path)
    progress("configs", 1, 2)
    progress("recipe", 1, 4)  # a recipe's overall count follows each finished config at once
    assert lines == []  # the line waits a moment: other configs of the same group may finish with it
    clock.now += 11
    progress.beat()
    assert lines[0].startswith("      baseline: TPOT p50 ")
    assert lines[1].startswith("[1/2] quantize int8-dynamic-torch: decode 3.64x [3.58–3.70]")
    assert "took 20s" in lines[1] and "elapsed 20s" in lines[1] and "recipe ETA 1m00s" in lines[1]
    clock.now += 40
    doc = make_result("r-bf16", technique="quantize", speedup_vs_baseline=1.5, seed=3)
    doc["label"] = "bf16-torch"
    save(doc, tmp_path)
    progress("configs", 2, 2)
    progress("recipe", 2, 4)
    progress("configs", 0, 2)  # the next stage starts
    assert lines[2].startswith("[2/2] quantize bf16-torch: decode 1.50x")
    assert "took 51s" in lines[2] and "elapsed 1m11s" in lines[2] and "recipe ETA 1m11s" in lines[2]

    plain, alone = [], LineProgress(lines.append, out_dir=tmp_path, clock=clock, start_thread=False)
    alone.emit = plain.append
    alone("configs", 2, 3)  # resumed: two configs found done; no recipe count follows (a plain sweep)
    alone.beat()
    assert plain == []  # waits a moment for a recipe's count
    clock.now += 11
    alone.beat()
    assert plain[0].startswith("[2/3] 2 config(s) already measured (--resume) · took ") and " · ETA " in plain[0]


def test_configs_that_finish_together_print_the_eta_once_on_the_last_line(tmp_path):
    clock, lines = Clock(), []
    progress = LineProgress(lines.append, out_dir=tmp_path, clock=clock, start_thread=False)
    progress("configs", 0, 4)
    progress("recipe", 0, 12)
    clock.now += 240  # one group of interleaved rounds: four rows saved at the end of it
    for i in range(1, 5):
        doc = make_result(f"r-{i}", technique="quantize", speedup_vs_baseline=1.0 + i, seed=i)
        doc["label"] = f"row-{i}"
        save(doc, tmp_path)
        progress("configs", i, 4)
        progress("recipe", i, 12)
        clock.now += 3  # each row's perplexity and BLEU before it is saved
        progress.beat()
    clock.now += 8
    progress.beat()
    finished = [line for line in lines if line.startswith("[")]
    assert len(finished) == 4
    assert not any("ETA" in line for line in finished[:3])  # 1 of 12 done after 4 min is not a 44-minute recipe
    assert finished[3].endswith("recipe ETA 8m18s")  # 4 done in 4m09s, 8 to go


def test_heartbeat_at_most_every_30s_while_a_step_is_silent():
    clock, lines = Clock(), []
    progress = LineProgress(lines.append, clock=clock, start_thread=False)
    progress("timing kernels", 0, 1)
    for _ in range(95):  # 95 s of silence, the heartbeat thread ticking once a second
        clock.now += 1
        progress.beat()
    assert len(lines) == 3
    assert all(line.startswith("  ... still working: timing kernels 0/1") for line in lines)
    assert "this step 30s" in lines[0] and "this step 1m30s" in lines[2]
    progress("iteration 1", 1, 4)
    clock.now += 10
    progress.beat()
    assert len(lines) == 3  # a heartbeat only after 30 s without a line
    assert duration(3725) == "1h02m"


def test_bench_recipe_in_a_log_prints_each_config_and_a_reproducible_recommendation(tiny_model_dir, prompts_file,
                                                                                    tmp_path):
    recipe = tmp_path / "two.yaml"
    recipe.write_text("configs:\n  - {technique: kv-cache, impl: static}\n  - {technique: kv-cache, impl: none}\n")
    out = tmp_path / "runs"
    result = CliRunner().invoke(app, ["bench", "--recipe", str(recipe), "--model", str(tiny_model_dir), "--suite",
                                      str(prompts_file), "--limit", "2", "--max-new-tokens", "4", "--out", str(out),
                                      *FAST])
    assert result.exit_code == 0, result.output
    stderr = result.stderr.splitlines()
    finished = [line for line in stderr if re.match(r"\[\d+/\d+\] ", line)]
    assert [line.split("]")[0] for line in finished] == ["[1/2", "[2/2"], result.stderr
    assert any(line.startswith("      baseline: TPOT p50") for line in stderr), result.stderr
    assert finished[0].startswith("[1/2] kv-cache static: decode ") and "(vs dynamic cache (the baseline))" in finished[0]
    assert finished[1].startswith("[2/2] kv-cache none: decode ")
    assert all(" · took " in line and " · elapsed " in line for line in finished)
    assert "ETA" not in finished[1]  # the recipe is done
    assert "report: " in result.stdout and "key figures" in result.stdout
    if "reproduce: " in result.stdout:  # a config beat the baseline on this machine: its recipe is beside the report
        command = result.stdout.split("reproduce: ", 1)[1].splitlines()[0]
        assert command == f"infer-tune bench --recipe {out / 'recommended.yaml'}"
        saved = yaml.safe_load((out / "recommended.yaml").read_text())
        assert saved["configs"][0]["technique"] == "kv-cache"
