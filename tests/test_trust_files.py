"""Attack pass, round three (docs/hardening.md): trust files that name code to run, impossible values in
results, a missing llama.cpp binary named with its variable, and private folders whatever the umask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from result_docs import make_result, save
from typer.testing import CliRunner

from infer_tune.cli import app

runner = CliRunner()


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "Traceback" not in result.output
    return lines[0]


def _candidate(run_id: str, **overrides) -> dict:
    doc = make_result(run_id, technique="quantize", config={"method": run_id}, seed=2,
                      bleu_drift=0.0, ppl_delta_pct=0.0)
    doc["baseline_run_id"] = "base"
    for key, value in overrides.items():
        doc["samples"][key] = [value] * len(doc["samples"][key])
    return doc


# ----------------------------------------------------------------------------- impossible values (finding 8)
@pytest.mark.parametrize("samples, reason", [
    ({"tpot_ms": 1e-9}, "below what a clock measures"),
    ({"ttft_ms": 1e-7, "e2e_ms": 1e-7}, "below what a clock measures"),
    ({"tpot_ms": -1.0}, "negative"),
])
def test_compare_refuses_sub_nanosecond_and_negative_timings(tmp_path, samples, reason):
    """A candidate whose timings are sub-nanosecond passed the gate at -100%; it is refused at load."""
    runs = tmp_path / "runs"
    base = save(make_result("base", seed=1), runs)
    doc = _candidate("bad", **samples)
    folder = runs / "bad"
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps(doc))
    refused = runner.invoke(app, ["compare", str(base), str(folder), "--fail-if", "tpot_ms.p50 > 5%"])
    assert refused.exit_code == 2, refused.output
    assert reason in one_error_line(refused)


def test_an_integer_beyond_a_float_is_refused_not_a_crash(tmp_path):
    """Samples of 10**400 made compare and leaderboard exit 3 (OverflowError); now compare refuses the file in
    one line and leaderboard skips it by name."""
    runs = tmp_path / "runs"
    base = save(make_result("base", seed=1), runs)
    save(_candidate("good"), runs)
    text = json.dumps(_candidate("huge", tpot_ms=7.0)).replace("7.0", str(10**400), 1)
    assert str(10**400) in text
    folder = runs / "huge"
    folder.mkdir()
    (folder / "result.json").write_text(text)
    refused = runner.invoke(app, ["compare", str(base), str(folder)])
    assert refused.exit_code == 2, refused.output
    assert "integer of 401 digits" in one_error_line(refused)
    board = runner.invoke(app, ["leaderboard", str(runs), "--out", str(tmp_path / "out"), "--json"])
    assert board.exit_code == 0, board.output
    assert "huge/result.json" in board.stderr and "integer of 401 digits" in board.stderr
    assert {row["run_id"] for row in json.loads(board.stdout)["rows"]} == {"base", "good"}
