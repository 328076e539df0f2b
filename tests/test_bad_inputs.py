"""A corpus of bad inputs across every command: each one exits 2 with exactly one `error:` line on
stderr, no traceback, and nothing left behind (no run folder, no leaderboard, no written file).

One tiny model folder (session fixture) and its broken copies serve every case; no case measures.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from result_docs import make_result, save
from typer.testing import CliRunner

from infer_tune.cli import app

runner = CliRunner()
FAST = ["--warmup", "0", "--min-iterations", "1", "--min-duration", "0", "--threads", "1"]
UNWRITABLE = "/proc/1/infer-tune-test-out"  # refused even to root (procfs has no such folder to create)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    """Paths of every broken input, by placeholder name."""
    root = tmp_path_factory.mktemp("bad-inputs")
    paths: dict[str, Path] = {"model": tiny_model_dir}

    def model_variant(name: str, change) -> None:
        folder = root / name
        shutil.copytree(tiny_model_dir, folder)
        change(folder)
        paths[name] = folder

    def truncate(folder: Path) -> None:
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    model_variant("truncated", truncate)
    model_variant("empty_weights", lambda f: (f / "model.safetensors").write_bytes(b""))
    model_variant("junk_weights", lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 64))
    model_variant("no_weights", lambda f: (f / "model.safetensors").unlink())
    model_variant("empty_config", lambda f: (f / "config.json").write_text(""))
    model_variant("list_config", lambda f: (f / "config.json").write_text("[1, 2]"))
    model_variant("corrupt_config", lambda f: (f / "config.json").write_text("{not json"))
    model_variant("unknown_arch", lambda f: (f / "config.json").write_text('{"model_type": "no-such-arch"}'))
    model_variant("broken_tokenizer", lambda f: (f / "tokenizer.json").write_text("{}"))
    (root / "empty_dir").mkdir()
    paths["empty_dir"] = root / "empty_dir"

    files = {
        "fake_gguf": ("model.gguf", b"this is text, not GGUF"),
        "suite": ("suite.jsonl", b'{"prompt": "hi there", "reference": "hello"}\n{"prompt": "2+2?"}\n'),
        "empty_suite": ("empty.jsonl", b""),
        "other_suite": ("other.jsonl", b'{"question": "hi"}\n'),
        "corrupt_suite": ("corrupt.jsonl", b'{"prompt": "a"\n{{{{\n'),
        "latin1_suite": ("latin1.jsonl", '{"prompt": "caf\u00e9 cr\u00e8me"}\n'.encode("latin-1")),
        "text_suite": ("notes.txt", b"prompt: hello\n"),
        "recipe_list": ("list.yaml", b"- 1\n- 2\n"),
        "recipe_bad_yaml": ("bad.yaml", b"workload: {suite: [\n"),
        "recipe_unknown_key": ("unknown.yaml", b"workloads: {}\n"),
        "recipe_str_limit": ("str-limit.yaml", b"workload: {limit: '4'}\nconfigs: []\n"),
        "recipe_alpha_high": ("alpha.yaml", b"configs: [{technique: quantize, method: int8-static, alpha: high}]\n"),
        "recipe_null_workload": ("null.yaml", b"workload: null\nconfigs: []\n"),
        "recipe_int_key": ("int-key.yaml", b"workload: {1: chat}\nconfigs: []\n"),
        "recipe_latin1": ("latin1.yaml", "description: caf\u00e9\n".encode("latin-1")),
        "recipe_technique": ("technique.yaml", b"configs: [{technique: teleport}]\n"),
        "recipe_field": ("field.yaml", b"configs: [{technique: quantize, bits: 3}]\n"),
        "recipe_huge": ("huge.yaml", b"workload: {limit: 1e400}\nconfigs: []\n"),
        "recipe_aliases": ("aliases.yaml", b"a: &a [x, x, x, x, x, x, x, x, x]\n"
                           + b"".join(b"%c: &%c [%s]\n" % (c, c, b",".join([b"*" + bytes([c - 1])] * 9))
                                      for c in b"bcdefghi")),
        "result_corrupt": ("corrupt.json", b'{"schema_version": 1, "run_id": '),
        "result_empty": ("empty.json", b""),
        "result_latin1": ("latin1.json", '{"run_id": "caf\u00e9"}'.encode("latin-1")),
        "result_list": ("list.json", b"[1, 2, 3]"),
    }
    for name, (filename, data) in files.items():
        (root / filename).write_bytes(data)
        paths[name] = root / filename
    (root / "suite_dir").mkdir()
    paths["suite_dir"] = root / "suite_dir"
    (root / "plain_file").write_text("not a folder")
    paths["plain_file"] = root / "plain_file"
    (root / "not_a_model").mkdir()
    (root / "not_a_model" / "keep.txt").write_text("user data")
    paths["not_a_model"] = root / "not_a_model"

    results = root / "results"
    base = make_result("base")
    base["samples"]["prompt_index"] = [i % 4 for i in range(len(base["samples"]["ttft_ms"]))]
    paths["base"] = save(base, results)
    variants = {
        "result_version": {**base, "schema_version": 7},
        "result_missing": {k: v for k, v in base.items() if k != "metrics"},
        "result_metric_type": {**base, "metrics": {**base["metrics"], "tpot_ms": "fast"}},
        "result_samples_type": {**base, "samples": {**base["samples"], "tpot_ms": 12}},
        "result_sample_strings": {**base, "samples": {**base["samples"], "prompt_index": ["a", "b"]}},
        "result_workload_type": {**base, "workload": "chat"},
        "result_run_id_type": {**base, "run_id": 42},
        "result_other_tokens": {**base, "run_id": "tokens", "workload": {**base["workload"], "max_new_tokens": 64}},
        "result_other_dtype": {**base, "run_id": "dtype", "model": {**base["model"], "dtype": "bfloat16"}},
        "result_other_threads": {**base, "run_id": "threads", "env": {**base["env"], "threads": 8}},
        "result_other_batch": {**base, "run_id": "batch", "workload": {**base["workload"], "batch_size": 4}},
        # issue 21: impossible timings and claims that cannot be trusted
        "result_negative": {**base, "samples": {**base["samples"],
                                                **{k: [-2 * v for v in base["samples"][k]] for k in
                                                   ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms")}}},
        "result_zero": {**base, "samples": {**base["samples"],
                                            **{k: [0.0] * len(base["samples"][k]) for k in
                                               ("ttft_ms", "tpot_ms", "e2e_ms", "itl_ms")}}},
        "result_huge": {**base, "samples": {**base["samples"], "tpot_ms": [1e15] * len(base["samples"]["tpot_ms"])}},
        "result_stat_negative": {**base, "metrics": {**base["metrics"],
                                                     "tpot_ms": {**base["metrics"]["tpot_ms"], "p50": -40.0}}},
        "result_short_e2e": {**base, "samples": {**base["samples"], "e2e_ms": base["samples"]["e2e_ms"][:-1]}},
        "result_verdict_int": {**base, "metrics": {**base["metrics"], "claim_check": {"claim": "x", "verdict": 3}}},
        "result_noise_type": {**base, "metrics": {**base["metrics"], "noise": {"noisy": "no"}}},
    }
    for name, doc in variants.items():
        folder = results / name
        folder.mkdir()
        (folder / "result.json").write_text(json.dumps(doc))
        paths[name] = folder
    oversized = results / "result_oversized"
    oversized.mkdir()
    with open(oversized / "result.json", "wb") as handle:  # sparse: 65 MiB that take no disk
        handle.truncate(65 << 20)
    paths["result_oversized"] = oversized
    bad_runs = root / "bad-runs"
    for name in ("result_version", "result_metric_type"):
        (bad_runs / name).mkdir(parents=True)
        shutil.copy(paths[name] / "result.json", bad_runs / name / "result.json")
    paths["bad_runs"] = bad_runs
    return {k: str(v) for k, v in paths.items()}


B = ["bench", "--suite", "{suite}", "--limit", "1", *FAST]
M = ["--model", "{model}"]
CASES: dict[str, tuple[list[str], str]] = {
    # models
    "unknown model name": ([*B, "--model", "no-such-model"], "unknown model"),
    "hub id while offline": ([*B, "--model", "nobody/no-such-model"], "offline"),
    "missing model path": ([*B, "--model", "./no/such/dir"], "not found"),
    "text renamed .gguf": ([*B, "--model", "{fake_gguf}"], "not a GGUF file"),
    "folder without config.json": ([*B, "--model", "{empty_dir}"], "without config.json"),
    "a file as model": ([*B, "--model", "{plain_file}"], "is a file, not a model"),
    "truncated safetensors": ([*B, "--model", "{truncated}"], "cannot load model"),
    "empty safetensors": ([*B, "--model", "{empty_weights}"], "cannot load model"),
    "junk safetensors": ([*B, "--model", "{junk_weights}"], "cannot load model"),
    "no weights": ([*B, "--model", "{no_weights}"], "cannot load model"),
    "empty config.json": ([*B, "--model", "{empty_config}"], "cannot load model"),
    "config.json is a list": ([*B, "--model", "{list_config}"], "cannot load model"),
    "corrupt config.json": ([*B, "--model", "{corrupt_config}"], "cannot load model"),
    "unknown architecture": ([*B, "--model", "{unknown_arch}"], "cannot load model"),
    "broken tokenizer": ([*B, "--model", "{broken_tokenizer}"], "cannot load model"),
    "models pull unknown": (["models", "pull", "no-such-model"], "unknown model"),
    # suites
    "empty suite": ([*B, *M, "--suite", "{empty_suite}"], "empty"),
    "missing suite": ([*B, *M, "--suite", "./no/such/suite.jsonl"], "not found"),
    "suite is a folder": ([*B, *M, "--suite", "{suite_dir}"], "directory"),
    "suite without the prompt field": ([*B, *M, "--suite", "{other_suite}"], "no field 'prompt'"),
    "corrupt JSON lines": ([*B, *M, "--suite", "{corrupt_suite}"], "cannot load suite"),
    "non-UTF-8 suite": ([*B, *M, "--suite", "{latin1_suite}"], "not UTF-8"),
    "unsupported suite type": ([*B, *M, "--suite", "{text_suite}"], "unsupported type"),
    "unknown suite offline": ([*B, *M, "--suite", "no-such-suite"], "built-in suite (chat, code)"),
    "execute without tests": ([*B, *M, "--execute", "--unsafe-execute"], "pass@1 needs a suite with tests"),
    # numbers
    "limit 0": ([*B, *M, "--limit", "0"], "--limit"),
    "negative limit": ([*B, *M, "--limit", "-5"], "--limit"),
    "limit not a number": ([*B, *M, "--limit", "four"], "--limit"),
    "negative max-new-tokens": ([*B, *M, "--max-new-tokens", "-1"], "--max-new-tokens"),
    "huge max-new-tokens": ([*B, *M, "--max-new-tokens", "99999999"], "context of 1024 positions"),
    "batch size 0": ([*B, *M, "--batch-size", "0"], "--batch-size"),
    "threads 0": ([*B, *M, "--threads", "0"], "--threads"),
    "infinite min-duration": ([*B, *M, "--min-duration", "inf"], "--min-duration"),
    "NaN min-duration": ([*B, *M, "--min-duration", "nan"], "--min-duration"),
    "min-iterations 0": ([*B, *M, "--min-iterations", "0"], "--min-iterations"),
    "max-prompt-tokens 0": ([*B, *M, "--max-prompt-tokens", "0"], "--max-prompt-tokens"),
    "unknown dtype": ([*B, *M, "--dtype", "int3"], "dtype"),
    "unknown device": ([*B, *M, "--device", "tpu"], "unknown device"),
    "unknown lang": ([*B, *M, "--lang", "xx"], "--lang"),
    "unknown option": ([*B, *M, "--no-such-option"], "No such option"),
    # where results go
    "unwritable --out": ([*B, *M, "--out", UNWRITABLE], "not writable"),
    "--out is a file": ([*B, *M, "--out", "{plain_file}/runs"], "is a file"),
    # recipes
    "missing recipe": ([*B, *M, "--recipe", "./no/such.yaml"], "not found"),
    "unknown built-in recipe": ([*B, *M, "--recipe", "no-such-recipe"], "unknown recipe"),
    "recipe is a folder": ([*B, *M, "--recipe", "{suite_dir}"], "directory"),
    "recipe is a list": ([*B, *M, "--recipe", "{recipe_list}"], "must be a mapping"),
    "recipe not YAML": ([*B, *M, "--recipe", "{recipe_bad_yaml}"], "not valid YAML"),
    "recipe unknown key": ([*B, *M, "--recipe", "{recipe_unknown_key}"], "unknown keys workloads"),
    "recipe limit as string": ([*B, *M, "--recipe", "{recipe_str_limit}"], "limit must be an integer or null"),
    "recipe alpha: high": ([*B, *M, "--recipe", "{recipe_alpha_high}"], "alpha must be a number"),
    "recipe workload: null": ([*B, *M, "--recipe", "{recipe_null_workload}"], "workload must be a mapping"),
    "recipe integer key": ([*B, *M, "--recipe", "{recipe_int_key}"], "keys must be names"),
    "recipe not UTF-8": ([*B, *M, "--recipe", "{recipe_latin1}"], "not UTF-8"),
    "recipe unknown technique": ([*B, *M, "--recipe", "{recipe_technique}"], "teleport"),
    "recipe unknown field": ([*B, *M, "--recipe", "{recipe_field}"], "unknown fields bits"),
    "recipe huge number": ([*B, *M, "--recipe", "{recipe_huge}"], "limit must be an integer"),
    "recipe of nested aliases": ([*B, *M, "--recipe", "{recipe_aliases}"], "aliases are refused"),
    # technique commands
    "quantize unknown method": (["quantize", *M, "--method", "int3", "--suite", "{suite}"], "method"),
    "quantize alpha out of range": (["quantize", *M, "--alpha", "2", "--suite", "{suite}"], "alpha"),
    "quantize over user data": (["quantize", *M, "--save", "{not_a_model}", "--overwrite", "--suite", "{suite}"],
                                "not a quantized model"),
    "kv-cache unknown impl": (["kv-cache", *M, "--impl", "bogus"], "--impl"),
    "kv-cache lengths not numbers": (["kv-cache", *M, "--context-lengths", "abc"], "--context-lengths"),
    "kv-cache beyond the context": (["kv-cache", *M, "--context-lengths", "100000"], "positions"),
    "tune unknown objective": (["tune", *M, "--suite", "{suite}", "--objective", "latency"], "--objective"),
    "tune negative TTFT SLO": (["tune", *M, "--suite", "{suite}", "--objective", "goodput", "--slo-ttft-ms", "-5"],
                               "--slo-ttft-ms"),
    "tune zero TPOT SLO": (["tune", *M, "--suite", "{suite}", "--objective", "goodput", "--slo-tpot-ms", "0"],
                           "--slo-tpot-ms"),
    "tune infinite rate": (["tune", *M, "--suite", "{suite}", "--objective", "goodput", "--rate", "inf"], "--rate"),
    "tune SLO without goodput": (["tune", *M, "--suite", "{suite}", "--slo-ttft-ms", "500"],
                                 "applies to --objective goodput"),
    "tune goodput batched baseline": (["tune", *M, "--suite", "{suite}", "--objective", "goodput", "--batch-size", "2"],
                                      "--batch-size must be 1"),
    "tune goodput on ray": (["tune", *M, "--suite", "{suite}", "--objective", "goodput", "--executor", "ray"],
                            "--executor local"),
    "tune goodput without compiling": (["tune", *M, "--suite", "{suite}", "--objective", "goodput", "--no-compile"],
                                       "--no-compile"),
    # compare
    "compare missing base": (["compare", "./no/such/result.json", "{base}"], "not found"),
    "compare folder without result": (["compare", "{suite_dir}", "{base}"], "not found"),
    "compare corrupt JSON": (["compare", "{result_corrupt}", "{base}"], "not valid JSON"),
    "compare empty file": (["compare", "{result_empty}", "{base}"], "not valid JSON"),
    "compare non-UTF-8": (["compare", "{result_latin1}", "{base}"], "not valid JSON"),
    "compare a JSON list": (["compare", "{result_list}", "{base}"], "does not hold a result"),
    "compare schema version": (["compare", "{base}", "{result_version}"], "schema_version 7"),
    "compare missing keys": (["compare", "{base}", "{result_missing}"], "lacks keys: metrics"),
    "compare metric of wrong type": (["compare", "{base}", "{result_metric_type}"], "metrics.tpot_ms"),
    "compare samples of wrong type": (["compare", "{base}", "{result_samples_type}"], "samples.tpot_ms"),
    "compare prompt index strings": (["compare", "{base}", "{result_sample_strings}"], "prompt_index"),
    "compare workload a string": (["compare", "{base}", "{result_workload_type}"], "'workload' is str"),
    "compare run id a number": (["compare", "{base}", "{result_run_id_type}"], "'run_id' is int"),
    "compare negative samples": (["compare", "{base}", "{result_negative}"], "negative"),
    "compare all-zero samples": (["compare", "{base}", "{result_zero}"], "a request takes time"),
    "compare huge samples": (["compare", "{base}", "{result_huge}"], "beyond any request"),
    "compare negative statistic": (["compare", "{base}", "{result_stat_negative}"], "metrics.tpot_ms.p50"),
    "compare ragged samples": (["compare", "{base}", "{result_short_e2e}"], "differ in length"),
    "compare int verdict": (["compare", "{base}", "{result_verdict_int}"], "claim_check.verdict"),
    "compare noise of the wrong type": (["compare", "{base}", "{result_noise_type}"], "metrics.noise.noisy"),
    "compare oversized result": (["compare", "{base}", "{result_oversized}"], "over the 64 MiB"),
    "compare other max_new_tokens": (["compare", "{base}", "{result_other_tokens}"], "max_new_tokens 64 vs 32"),
    "compare other dtype": (["compare", "{base}", "{result_other_dtype}"], "dtype"),
    "compare other threads": (["compare", "{base}", "{result_other_threads}"], "threads 8 vs 2"),
    "compare other batch size": (["compare", "{base}", "{result_other_batch}"], "batch_size"),
    "compare unparsable gate": (["compare", "{base}", "{base}", "--fail-if", "tpot goes up"], "cannot parse"),
    "compare unknown metric": (["compare", "{base}", "{base}", "--fail-if", "nope_ms > 5%"], "unknown metric"),
    "compare unknown format": (["compare", "{base}", "{base}", "--format", "pdf"], "--format"),
    # leaderboard
    "leaderboard missing dir": (["leaderboard", "./no/such/runs"], "not found"),
    "leaderboard on a file": (["leaderboard", "{plain_file}"], "is a file"),
    "leaderboard only bad results": (["leaderboard", "{bad_runs}"], "2 unreadable"),
    "leaderboard unknown format": (["leaderboard", "{bad_runs}/..", "--format", "pdf"], "--format"),
    "leaderboard unknown sort": (["leaderboard", "{base}/..", "--sort", "nope", "--out", "{suite_dir}"], "--sort"),
}


def files_under(folder: Path) -> set[str]:
    return {str(p) for p in folder.rglob("*")} if folder.exists() else set()


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_nothing_written(case, corpus, tmp_path):
    args, expected = CASES[case]
    out = tmp_path / "runs"
    argv = [a.format(**corpus) for a in args]
    if argv[0] in ("bench", "quantize", "kv-cache", "tune") and "--out" not in argv:
        argv += ["--out", str(out)]
    watched = [Path(corpus["base"]).parent, Path(corpus["suite_dir"]), Path(corpus["not_a_model"])]
    before = [files_under(w) for w in watched]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.output
    assert result.stdout == ""
    assert not files_under(out), "a refused command left files behind"
    assert [files_under(w) for w in watched] == before


def test_corpus_is_large():
    assert len(CASES) >= 40


def test_unwritable_home_is_refused_before_work(corpus, tmp_path):
    result = runner.invoke(app, ["bench", "--model", corpus["model"], "--suite", corpus["suite"],
                                 "--out", str(tmp_path / "runs")], env={"INFER_TUNE_HOME": UNWRITABLE})
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "INFER_TUNE_HOME" in lines[0], result.stderr


def test_leaderboard_names_the_files_it_skipped(corpus, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(Path(corpus["base"]), runs / "base")
    shutil.copytree(Path(corpus["bad_runs"]), runs, dirs_exist_ok=True)
    result = runner.invoke(app, ["leaderboard", str(runs), "--format", "md"])
    assert result.exit_code == 0, result.output
    assert "skipped 2 unreadable" in result.stderr
    assert "result_version" in result.stderr and "result_metric_type" in result.stderr


def test_compare_with_allow_mismatch_warns_and_says_how_it_paired(corpus):
    result = runner.invoke(app, ["compare", corpus["base"], corpus["result_other_tokens"], "--allow-mismatch",
                                 "--format", "json"])
    assert result.exit_code == 0, result.output
    assert "warning:" in result.stderr and "max_new_tokens 64 vs 32" in result.stderr
    doc = json.loads(result.stdout)
    assert doc["warnings"] and "not paired" in doc["candidates"][0]["pairing"]
    same = json.loads(runner.invoke(app, ["compare", corpus["base"], corpus["base"], "--format", "json"]).stdout)
    assert same["warnings"] == [] and same["candidates"][0]["pairing"].startswith("paired per prompt")
