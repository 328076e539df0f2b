"""Nothing lost on interrupt or concurrency: a sweep killed at a random point resumes to every config
exactly once; two sweeps into one runs directory both complete with distinct results; run folders
are never replaced; a swap on overwrite never leaves the target missing; staging leftovers go;
result files are readable by the group; fingerprints follow content, not paths."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from infer_tune import atomic, paths, results

ROOT = Path(__file__).resolve().parent.parent
RECIPE = """\
workload: {limit: 2, max_new_tokens: 4}
protocol: {warmup: 0, min_iterations: 1, min_duration_s: 0, max_rounds: 3}
configs:
"""
METHODS = ("bf16", "int8-dynamic", "int4-rtn")


def recipe(tmp_path: Path, methods=METHODS) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(RECIPE + "".join(f"  - {{technique: quantize, method: {m}, backend: torch}}\n" for m in methods))
    return path


def bench_args(model: Path, suite: Path, recipe_file: Path, out: Path, *extra: str) -> list[str]:
    return ["bench", "--recipe", str(recipe_file), "--model", str(model), "--suite", str(suite), "--threads", "1",
            "--no-ppl", "--out", str(out), "--json", *extra]


def bench(model: Path, suite: Path, recipe_file: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "infer_tune", *bench_args(model, suite, recipe_file, out, *extra)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(out: Path) -> list[dict]:
    return results.find_results(out) if out.exists() else []


def test_sweep_killed_at_a_random_point_resumes_to_every_config_once(tiny_model_dir, prompts_file, tmp_path):
    out = tmp_path / "runs"
    sweep = recipe(tmp_path)
    proc = bench(tiny_model_dir, prompts_file, sweep, out)
    deadline = time.monotonic() + 300
    while not finished(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random().uniform(0.0, 2.0))  # anywhere after the first save: mid-config, mid-save...
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    from typer.testing import CliRunner

    from infer_tune.cli import app

    # the resume runs in this process (what is checked is what the killed one left behind)
    resumed = CliRunner().invoke(app, bench_args(tiny_model_dir, prompts_file, sweep, out, "--resume"))
    assert resumed.exit_code == 0, resumed.output
    stdout = resumed.stdout
    docs = finished(out)
    baselines = {d["run_id"] for d in docs if d["technique"] == "baseline"}
    candidates = [d for d in docs if d["technique"] == "quantize"]
    # killed after the baseline of the rounds was saved but before its rows were: the resumed sweep measures
    # those rows again in rounds of their own, with a new baseline (a saved one is never rewritten)
    assert 1 <= len(baselines) <= 2 and len(docs) == len(baselines) + len(METHODS)
    assert sorted(d["config"].get("method") for d in candidates) == sorted(METHODS)
    assert len({d["fingerprint"] for d in candidates}) == len(METHODS)
    assert all(d["baseline_run_id"] in baselines for d in candidates)
    assert not [p for p in out.iterdir() if atomic.STAGING_TAG in p.name], "staging leftovers were not cleaned"
    reported = json.loads(stdout)
    assert {d["run_id"] for d in reported} <= {d["run_id"] for d in docs}
    assert {d["run_id"] for d in candidates} <= {d["run_id"] for d in reported}


def test_two_sweeps_into_one_runs_dir_both_complete(tiny_model_dir, prompts_file, tmp_path):
    out = tmp_path / "runs"
    sweep = recipe(tmp_path, METHODS[:2])
    procs = [bench(tiny_model_dir, prompts_file, sweep, out) for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, stderr
    reported = [json.loads(stdout) for stdout, _ in outputs]
    docs = finished(out)
    ids = [d["run_id"] for d in docs]
    # each sweep measured its rows in rounds with its own baseline: two baselines, never one rewritten
    assert len(ids) == len(set(ids)) == 2 + 2 * 2
    assert [d["technique"] for d in docs].count("baseline") == 2
    for sweep_docs in reported:
        assert sweep_docs[0]["technique"] == "baseline" and sweep_docs[0]["run_id"] in ids
        assert all(d["run_id"] in ids for d in sweep_docs)
        assert {d["baseline_run_id"] for d in sweep_docs[1:]} == {sweep_docs[0]["run_id"]}
    assert {d["run_id"] for d in reported[0][1:]}.isdisjoint(d["run_id"] for d in reported[1][1:])


def test_preflight_of_one_new_folder_by_many_at_once_never_refuses(tmp_path):
    """Two sweeps started together check the same new runs folder: neither may see the other's
    mkdir as "File exists" nor lose the folder to the other's clean-up."""
    import threading

    failures: list[str] = []
    for round_ in range(40):
        target = tmp_path / f"r{round_}" / "runs"
        barrier = threading.Barrier(6)

        def check(target=target, barrier=barrier):
            barrier.wait()
            try:
                paths.ensure_writable(target, "the runs directory (out_dir)")
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                failures.append(str(exc))

        threads = [threading.Thread(target=check) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not target.exists() or not any(target.iterdir())
    assert not failures, failures[:3]


def test_run_folders_are_never_replaced(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from result_docs import make_result

    doc = make_result("same-id")
    first = results.save_run(tmp_path, dict(doc), [{"output": "a"}])
    second = results.save_run(tmp_path, dict(doc), [{"output": "b"}])
    assert first.run_dir.name == "same-id" and second.run_dir != first.run_dir
    assert json.loads((first.run_dir / "outputs.jsonl").read_text())["output"] == "a"
    assert second.result["run_id"] == second.run_dir.name
    mode = (first.run_dir / "result.json").stat().st_mode & 0o777
    assert mode & 0o044 == 0o044 & ~atomic.umask(), oct(mode)  # readable by group/others as umask allows


def test_overwrite_swaps_without_a_missing_window(tmp_path):
    target = tmp_path / "model"
    with atomic.staged_dir(target) as staging:
        (staging / "w").write_text("old")
    seen_missing = []
    with atomic.staged_dir(target, exists="replace") as staging:
        (staging / "w").write_text("new")
        seen_missing.append(not target.exists())
    assert (target / "w").read_text() == "new" and seen_missing == [False]
    with atomic.staged_dir(target, exists="keep") as staging:  # a concurrent converter finished first
        (staging / "w").write_text("late")
    assert (target / "w").read_text() == "new"
    with pytest.raises(FileExistsError), atomic.staged_dir(target, exists="error") as staging:
        (staging / "w").write_text("x")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_stale_staging_is_cleaned(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".run{atomic.STAGING_TAG}{dead.pid}-abcd"
    live = tmp_path / f".run{atomic.STAGING_TAG}{os.getpid()}-abcd"
    for folder in (stale, live):
        folder.mkdir()
    with results.runs_lock(tmp_path):
        pass
    assert not stale.exists() and live.exists()


def test_runs_lock_is_reentrant_and_exclusive(tmp_path):
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\nfrom infer_tune import results\n"
            f"with results.runs_lock({str(tmp_path)!r}):\n    print('got it')\n")
    with results.runs_lock(tmp_path), results.runs_lock(tmp_path):
        other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=1.5)
    assert other.communicate(timeout=60)[0].strip() == "got it"


def test_fingerprint_follows_content_not_path(tiny_model_dir, tmp_path):
    import shutil

    from infer_tune import env as envinfo
    from infer_tune import models
    from infer_tune.sweep import run_fingerprint
    from infer_tune.workload import Protocol, Workload

    suite_a = tmp_path / "a.jsonl"
    suite_a.write_text('{"prompt": "hi"}\n')
    suite_b = tmp_path / "b.jsonl"
    suite_b.write_text('{"prompt": "hi"}\n')
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    environment = {"threads": 1, "machine": envinfo.machine_key()}

    def fp(model_dir: Path, suite: Path) -> str:
        return run_fingerprint(models.load(str(model_dir)), "baseline", {}, Workload(suite=str(suite)), environment,
                               protocol=Protocol())

    assert fp(tiny_model_dir, suite_a) == fp(copy, suite_b)  # same bytes elsewhere: same measurement
    suite_b.write_text('{"prompt": "hello"}\n')
    assert fp(tiny_model_dir, suite_a) != fp(tiny_model_dir, suite_b)
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (copy / "config.json").write_text(json.dumps(config))
    assert fp(tiny_model_dir, suite_a) != fp(copy, suite_a)


def test_bootstrap_in_chunks_equals_one_draw(monkeypatch):
    from infer_tune.metrics import stats

    data = np.random.default_rng(1).lognormal(size=3000)
    whole = stats.median_interval(data, seed=3, resamples=200)
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 3000 * 7)  # 7 resamples per chunk
    assert stats.median_interval(data, seed=3, resamples=200) == whole


def test_report_embeds_only_regular_pngs_of_the_runs_own_folder(tmp_path):
    """A symlinked `.png` (to a host file or another folder's PNG) and a `_path` naming another folder are
    never embedded: only regular files directly inside the folder the result was read from."""
    import base64

    from result_docs import make_result, save

    from infer_tune.report import leaderboard as lb
    from infer_tune.report.plots import per_position_png

    runs, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    elsewhere.mkdir()
    secret_png = per_position_png({"secret": [1.0, 2.0, 3.0]})
    (elsewhere / "secret.png").write_bytes(secret_png)
    host_file = tmp_path / "hostname"
    host_file.write_bytes(b"\x89PNG\r\n\x1a\n" + b"host secret")
    own_png = per_position_png({"own": [3.0, 2.0, 1.0]})
    base = save(make_result("base", seed=1), runs)
    (base / "own.png").write_bytes(own_png)
    (base / "link.png").symlink_to(host_file)
    (base / "other.png").symlink_to(elsewhere / "secret.png")
    (base / "dir.png").mkdir()
    forged = make_result("forged", technique="quantize", seed=2)
    forged["_path"] = str(elsewhere)  # a `_path` written inside result.json is not where the file is
    save(forged, runs)
    docs = results.find_results(runs)
    page = lb.write(lb.build(docs), docs, tmp_path / "report", ["html"])["html"].read_text()
    assert base64.b64encode(own_png).decode() in page
    assert base64.b64encode(secret_png).decode() not in page
    assert base64.b64encode(host_file.read_bytes()).decode() not in page


# --------------------------------------------------------------------------- issue 21: crafted result files
def _crafted_runs(tmp_path: Path) -> tuple[Path, Path]:
    """A runs folder holding one good result and one of each crafted kind; returns (runs, elsewhere)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from result_docs import make_result, save

    runs, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    elsewhere.mkdir(parents=True)
    good = make_result("good")
    good["_path"] = str(elsewhere)  # a document may not say where it lives
    save(good, runs)
    kv = {"claim": "compute_saved_at_500_tokens", "prompt_tokens": 100, "held": True}  # no flops_saved_fraction
    for run_id, metrics in (("int-verdict", {"claim_check": {"claim": "c", "verdict": 3}}),
                            ("missing-keys", {"claim_check": kv}),
                            ("xss-verdict", {"claim_check": {"claim": "c", "verdict": 'x"><svg/onload=alert(1)>'}})):
        doc = make_result(run_id)
        doc["metrics"].update(metrics)
        save(doc, runs)
    save(make_result("outside"), elsewhere)
    (runs / "linked-run").symlink_to(elsewhere / "outside")  # a symlinked run folder is not entered
    (runs / "linked-file").mkdir()
    (runs / "linked-file" / "result.json").symlink_to(elsewhere / "outside" / "result.json")
    (runs / "huge").mkdir()
    with open(runs / "huge" / "result.json", "wb") as handle:
        handle.truncate(1 << 30)  # 1 GiB, sparse
    return runs, elsewhere


def test_leaderboard_skips_crafted_results_with_one_warning(tmp_path):
    from typer.testing import CliRunner

    from infer_tune.cli import app

    runs, _ = _crafted_runs(tmp_path)
    result = CliRunner().invoke(app, ["leaderboard", str(runs), "--format", "md", "--json"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: skipped 5 unreadable"), result.stderr
    for name in ("int-verdict", "missing-keys", "xss-verdict", "linked-file", "huge"):
        assert name in warnings[0]
    assert [row["run_id"] for row in json.loads(result.stdout)["rows"]] == ["good"]


def test_path_is_where_the_file_is_and_resume_warns_once(tmp_path):
    runs, elsewhere = _crafted_runs(tmp_path)
    seen: list[str] = []
    results.set_warning_handler(seen.append)
    try:
        docs = results.find_results(runs)
        assert [d["run_id"] for d in docs] == ["good"]
        assert str(docs[0].location) == os.path.realpath(runs / "good") and "_path" not in docs[0]  # not the `elsewhere` the file claims
        results.find_results(runs)  # a sweep lists its runs folder many times: still one line per file
    finally:
        results.set_warning_handler(None)
    assert len(seen) == 5 and len(set(seen)) == 5, seen
    assert results.validate({**docs[0], "schema_version": True}) is not None


SUMMARIZED = RECIPE + """\
  - {technique: quantize, method: bf16, backend: torch}
  - {technique: batch, scheduler: static, batch_size: 2, rate: 50.0, requests: 2}
  - {technique: batch, scheduler: continuous, batch_size: 2, rate: 50.0, requests: 2}
"""


def _result_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in out.glob("*/*") if p.is_file()}


def test_a_second_sweep_leaves_every_earlier_result_byte_identical(tiny_model_dir, prompts_file, tmp_path):
    """Saved results are immutable: a later sweep into the same runs folder, resumed or not, with a technique
    whose `conclude` stores a claim over the whole sweep (batch) and a new config beside rows read back, writes
    new results (its baseline too, with its own run id) and leaves every file of the earlier ones as it was;
    each row names the baseline it was measured against (docs/architecture.md, "The sweep engine")."""
    out = tmp_path / "runs"
    first = tmp_path / "first.yaml"
    first.write_text(SUMMARIZED)
    more = tmp_path / "more.yaml"  # the same rows and one more: the resumed rows meet a new baseline and row
    more.write_text(SUMMARIZED + "  - {technique: quantize, method: int8-dynamic, backend: torch}\n")
    from typer.testing import CliRunner

    from infer_tune.cli import app

    seen: dict[str, bytes] = {}
    for recipe_file, extra in ((first, ()), (more, ("--resume",)), (first, ())):
        # in this process (`bench` as its subprocess would run it, less an interpreter start per sweep)
        done = CliRunner().invoke(app, bench_args(tiny_model_dir, prompts_file, recipe_file, out, *extra))
        assert done.exit_code == 0, done.output
        stdout = done.stdout
        now = _result_bytes(out)
        changed = [name for name, data in seen.items() if now.get(name) != data]
        assert not changed, f"an earlier result was rewritten: {changed}"
        seen = now
        docs = {d["run_id"]: d for d in results.find_results(out)}
        for doc in json.loads(stdout)[1:]:  # each row names a baseline that is saved, with its own run id
            assert doc["baseline_run_id"] in docs and docs[doc["baseline_run_id"]]["technique"] == "baseline"
    docs = results.find_results(out)
    assert all(d["metrics"].get("claim_check") for d in docs if d["technique"] == "batch")
    # where a result lives is not part of its data: no `_path` key written, loaded or printed
    assert not [n for n, data in seen.items() if n.endswith("result.json") and "_path" in json.loads(data)]
    assert all("_path" not in d and d.location == out / d["run_id"] for d in docs)
    assert all("_path" not in d for d in json.loads(stdout))
    baselines = [d["run_id"] for d in docs if d["technique"] == "baseline"]
    assert len(baselines) == len(set(baselines)) >= 2  # a baseline measured again is a new result


def test_bench_without_resume_measures_anew_and_leaves_saved_results_as_they_were(tiny_model_dir, prompts_file,
                                                                                    tmp_path):
    """`bench --out D` twice: the second run measures (a new run id) and the first run's files stay byte for
    byte; only --resume hands a saved result back. A recipe run twice leaves the first sweep's files too."""
    from typer.testing import CliRunner

    from infer_tune.cli import app

    runner = CliRunner()
    out = tmp_path / "runs"
    args = ["bench", "--model", str(tiny_model_dir), "--suite", str(prompts_file), "--limit", "2",
            "--max-new-tokens", "4", "--warmup", "0", "--min-iterations", "1", "--min-duration", "0",
            "--threads", "1", "--no-ppl", "--out", str(out), "--json"]

    def snapshot() -> dict[str, bytes]:
        return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()
                and p.name in ("result.json", "outputs.jsonl")}

    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    before = snapshot()
    second = runner.invoke(app, args)
    assert second.exit_code == 0, second.output
    assert json.loads(second.stdout)["run_id"] != json.loads(first.stdout)["run_id"]
    after = snapshot()
    assert {k: after[k] for k in before} == before and len(after) == 2 * len(before)
    resumed = runner.invoke(app, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["run_id"] in {json.loads(r.stdout)["run_id"] for r in (first, second)}
    assert snapshot() == after
    sweep = recipe(tmp_path, METHODS[:1])
    for _ in range(2):
        before = snapshot()
        again = runner.invoke(app, [*args, "--recipe", str(sweep)])
        assert again.exit_code == 0, again.output
        after = snapshot()
        assert {k: after[k] for k in before} == before  # the earlier baselines were not refreshed in place
        assert len(after) == len(before) + 2 * 2  # this sweep's own baseline and row
