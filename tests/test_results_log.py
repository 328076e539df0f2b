"""scripts/results_log.py: runs appended atomically as JSON lines, medians over every run of a claim, and the
seeded docs/results-runs.jsonl giving the medians docs/results.md quotes."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load():
    spec = importlib.util.spec_from_file_location("results_log", ROOT / "scripts" / "results_log.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add(rl, log: Path, claim: str, value: float, **extra) -> int:
    argv = ["add", "--log", str(log), "--claim", claim, "--metric", f"ratio={value}", "--commit", "abc1234",
            "--host", "test host (avx2)", "--utc", extra.pop("utc", "2026-12-01T00:00:00Z"),
            "--ours", "decode_tok_s=20", "--theirs", "decode_tok_s=15"]
    for key, val in extra.items():
        argv += [f"--{key}", val]
    return rl.main(argv)


def test_add_appends_lines_and_summary_is_median_of_all_runs(tmp_path, capsys):
    rl = load()
    log = tmp_path / "runs.jsonl"
    for value in (1.31, 1.07, 1.23, 1.26, 1.11):
        assert add(rl, log, "scaling-decode-4b", value) == 0
    assert add(rl, log, "other", 9.0, ci="ratio=8,10") == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 6
    assert lines[0] == {"claim": "scaling-decode-4b", "commit": "abc1234", "host": "test host (avx2)",
                        "utc": "2026-12-01T00:00:00Z", "metrics": {"ratio": 1.31},
                        "ours": {"decode_tok_s": 20.0}, "theirs": {"decode_tok_s": 15.0}}
    assert lines[-1]["ci95"] == {"ratio": [8.0, 10.0]}
    summary = rl.summarize(rl.read_runs(log), "scaling-decode-4b", "ratio")
    # the median of all five, not the best (1.31) nor the last
    assert (summary["median"], summary["min"], summary["max"], summary["n"]) == (1.23, 1.07, 1.31, 5)
    assert rl.summarize(rl.read_runs(log), "scaling-decode-4b", "theirs.decode_tok_s")["median"] == 15.0
    capsys.readouterr()
    assert rl.main(["summary", "--log", str(log), "--claim", "scaling-decode-4b", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["median"] == 1.23 and printed["n"] == 5 and [r["value"] for r in printed["runs"]][0] == 1.31


def test_append_is_atomic(tmp_path, monkeypatch):
    rl = load()
    log = tmp_path / "runs.jsonl"
    assert add(rl, log, "c", 1.0) == 0
    before = log.read_text()
    replaced = []
    real_replace = os.replace

    def failing_replace(src, dst):
        replaced.append((src, dst))
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        add(rl, log, "c", 2.0)
    monkeypatch.setattr(os, "replace", real_replace)
    # the new content went through a temp file and os.replace; a failed replace leaves the file as it was
    assert replaced and Path(replaced[0][1]) == log and Path(replaced[0][0]) != log
    assert log.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.jsonl"]


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    rl = load()
    log = tmp_path / "runs.jsonl"
    assert rl.main(["add", "--log", str(log), "--claim", "c", "--metric", "ratio=fast", "--host", "h",
                    "--commit", "c", "--utc", "t"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a number" in err
    assert not log.exists() or log.read_text() == ""
    assert rl.main(["summary", "--log", str(log), "--claim", "nothing"]) == 2
    assert "no runs of claim 'nothing'" in capsys.readouterr().err
    log.write_text("{not json\n")
    assert rl.main(["summary", "--log", str(log), "--claim", "c"]) == 2
    assert "line 1 is not JSON" in capsys.readouterr().err


def test_seeded_runs_give_the_medians_the_page_quotes():
    rl = load()
    runs = rl.read_runs(ROOT / "docs" / "results-runs.jsonl")
    four_b = rl.summarize(runs, "scaling-decode-4b", "ratio")
    assert (four_b["median"], four_b["min"], four_b["max"], four_b["n"]) == (1.23, 1.07, 1.31, 5)
    page = (ROOT / "docs" / "results.md").read_text()
    assert "1.23x (1.07–1.31, n=5)" in page
    serve = rl.summarize(runs, "serve-trace-8rps", "throughput_ratio")
    assert serve["n"] == 1 and serve["median"] == 1.108
