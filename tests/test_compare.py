"""`compare`: the gate rule on synthetic samples, the EXPR parser, exit codes and formats through the CLI."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from result_docs import make_result, save
from typer.testing import CliRunner

from infer_tune.cli import app
from infer_tune.errors import ResultError
from infer_tune.report import run_to_run as rtr
from infer_tune.report.compare import ExprError, MismatchError, compare, judge, parse_expr

runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_step_summary(monkeypatch):
    """A CI runner's own GITHUB_STEP_SUMMARY must not receive these tests' reports."""
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)


@pytest.mark.parametrize(("text", "metric", "op", "value", "relative"), [
    ("tpot_ms.p50 > +10%", "tpot_ms.p50", ">", 10.0, True),
    ("bleu_drift < -1.0", "bleu_drift", "<", -1.0, False),
    ("output_throughput_tok_s<-5%", "output_throughput_tok_s", "<", -5.0, True),
    ("  ttft_ms >= 1e3 ", "ttft_ms.p50", ">=", 1000.0, False),
    ("itl_ms.p99 <= .5%", "itl_ms.p99", "<=", 0.5, True),
])
def test_parse_valid(text, metric, op, value, relative):
    expr = parse_expr(text)
    assert (expr.metric, expr.op, expr.value, expr.relative) == (metric, op, value, relative)


@pytest.mark.parametrize("text", ["", "tpot_ms.p50", "tpot_ms.p50 > ", "> 10%", "tpot_ms.p50 => 10",
                                  "tpot_ms.p50 > ten", "tpot_ms.p50 == 10", "tpot_ms.p50 > 10%%", "1x > 3"])
def test_parse_invalid(text):
    with pytest.raises(ExprError):
        parse_expr(text)


def test_identical_distributions_pass():
    base, cand = make_result("a", seed=1), make_result("b", seed=2)
    check = judge(parse_expr("tpot_ms.p50 > +10%"), base, cand)
    assert not check.regressed
    assert check.interval[0] < 0 < check.interval[1]


def test_twenty_percent_shift_fails():
    base, cand = make_result("a", seed=1), make_result("b", tpot_ms=48.0, seed=2)
    check = judge(parse_expr("tpot_ms.p50 > +10%"), base, cand)
    assert check.regressed and check.method == "bootstrap ratio"
    assert 10 < check.interval[0] < 20 < check.interval[1] < 30


def test_whole_interval_rule_tolerates_noise():
    # A point estimate past the threshold with an interval straddling it is not a regression.
    base = make_result("a", n=6, noise=0.3, seed=3)
    cand = make_result("b", tpot_ms=46.0, n=6, noise=0.3, seed=4)
    check = judge(parse_expr("tpot_ms.p50 > +10%"), base, cand)
    assert check.interval[0] < 10 < check.interval[1]
    assert not check.regressed


def test_absolute_and_pairwise_rules():
    base = make_result("a", bleu=10.0, ppl=5.0)
    cand = make_result("b", bleu=8.5, ppl=5.5, seed=1)
    assert judge(parse_expr("bleu_drift < -1.0"), base, cand).method == "pairwise vs base"
    assert judge(parse_expr("bleu_drift < -1.0"), base, cand).regressed
    assert judge(parse_expr("ppl_delta_pct > 5"), base, cand).regressed  # +10%
    own = make_result("c", technique="quantize", bleu_drift=-0.2, seed=1)
    assert not judge(parse_expr("bleu_drift < -1.0"), base, own).regressed
    assert judge(parse_expr("output_throughput_tok_s < -5%"), base, make_result("d", tpot_ms=50.0)).regressed


def test_compare_refuses_mismatch_and_unknown_metric():
    base = make_result("a")
    with pytest.raises(MismatchError, match="suite"):
        compare(base, [make_result("b", suite="code")])
    with pytest.raises(MismatchError, match="model"):
        compare(base, [make_result("b", model="other")])
    assert compare(base, [make_result("b", suite="code")], allow_mismatch=True).candidates
    with pytest.raises(ExprError, match="known: .*tpot_ms.p50"):
        compare(base, [make_result("b")], [parse_expr("tpot_bogus > 10%")])


@pytest.fixture()
def runs(tmp_path):
    return {
        "base": save(make_result("base", seed=1), tmp_path),
        "same": save(make_result("same", seed=2), tmp_path),
        "slow": save(make_result("slow", tpot_ms=48.0, seed=3), tmp_path),
        "code": save(make_result("code", suite="code", seed=4), tmp_path),
    }


def invoke(*args: str):
    return runner.invoke(app, ["compare", *args])


def test_cli_exit_codes(runs, tmp_path):
    gate = ["--fail-if", "tpot_ms.p50 > +10%"]
    assert invoke(str(runs["base"]), str(runs["same"]), *gate).exit_code == 0
    slow = invoke(str(runs["base"]), str(runs["same"]), str(runs["slow"]), *gate)
    assert slow.exit_code == 1 and "tpot_ms.p50" in slow.output
    assert invoke(str(runs["base"]), str(runs["slow"])).exit_code == 0  # no gate: deltas only
    assert invoke(str(runs["base"]), str(runs["same"]), "--fail-if", "tpot_ms.p50 >> 10%").exit_code == 2
    assert invoke(str(runs["base"]), str(runs["same"]), "--fail-if", "nope > 1").exit_code == 2
    assert invoke(str(runs["base"]), str(tmp_path / "missing")).exit_code == 2
    assert invoke(str(runs["base"]), str(runs["code"]), *gate).exit_code == 2
    assert invoke(str(runs["base"]), str(runs["code"]), *gate, "--allow-mismatch").exit_code == 0


def test_cli_bad_files(runs, tmp_path):
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    future = tmp_path / "future.json"
    future.write_text(json.dumps({**make_result("f"), "schema_version": 99}))
    for bad in (corrupt, future):
        result = invoke(str(runs["base"]), str(bad))
        assert result.exit_code == 2
        assert "Traceback" not in result.output


def test_cli_json_and_junit(runs):
    result = invoke(str(runs["base"]), str(runs["slow"]), "--fail-if", "tpot_ms.p50 > +10%", "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["regressed"] and doc["candidates"][0]["checks"][0]["regressed"]
    result = invoke(str(runs["base"]), str(runs["same"]), str(runs["slow"]), "--fail-if", "tpot_ms.p50 > +10%",
                    "--fail-if", "bleu_drift < -1.0", "--format", "junit")
    root = ET.fromstring(result.stdout)
    cases = root.findall(".//testcase")
    assert len(cases) == 4 and root.get("failures") == "1"
    assert [c.get("name") for c in cases if c.find("failure") is not None] == ["tpot_ms.p50 > +10%"]


def test_cli_markdown_and_step_summary(runs, tmp_path, monkeypatch):
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = invoke(str(runs["base"]), str(runs["same"]), "--fail-if", "tpot_ms.p50 > +10%", "--format", "md")
    assert result.exit_code == 0
    assert "| tpot_ms.p50 > +10% |" in result.stdout
    assert "pass" in summary.read_text()


def _paired_doc(run_id: str, factor: float, seed: int) -> dict:
    """Four prompts of very different speed (context length), 3 iterations each, 3% noise."""
    rng = np.random.default_rng(seed)
    prompt_ms = [20.0, 40.0, 60.0, 80.0]
    index = [i for _ in range(3) for i in range(4)]
    tpot = [prompt_ms[i] * factor * (1 + 0.03 * rng.standard_normal()) for i in index]
    doc = make_result(run_id, seed=seed)
    doc["samples"]["tpot_ms"] = tpot
    doc["samples"]["prompt_index"] = index
    doc["samples"]["ttft_ms"] = doc["samples"]["ttft_ms"][: len(index)]
    doc["samples"]["e2e_ms"] = doc["samples"]["e2e_ms"][: len(index)]
    return doc


def _rounds_doc(run_id: str, levels: list[float], group: str = "g1") -> dict:
    """A row of interleaved rounds: per round four prompts at 0.5x, 0.9x, 1.1x, 1.5x of the round's level,
    so each round's median TPOT is its level; its rounds block is what those samples give."""
    index = [i for _ in levels for i in range(4)]
    tpot = [level * f for level in levels for f in (0.5, 0.9, 1.1, 1.5)]
    doc = make_result(run_id, tpot_ms=float(np.mean(levels)), n=len(index))
    doc["samples"].update(tpot_ms=tpot, prompt_index=index)
    doc["metrics"]["tpot_ms"]["p50"] = float(np.median(tpot))
    ttft = doc["samples"]["ttft_ms"]
    doc["metrics"]["rounds"] = {"group": group, "rounds": len(levels), "per_round": {
        "tpot_ms": list(levels), "ttft_ms": [float(np.median(ttft[4 * k:4 * k + 4])) for k in range(len(levels))]}}
    return doc


def test_a_copied_rounds_block_is_refused_not_trusted(tmp_path):
    """A copy of the base made 2x slower that keeps the base's rounds block passed as "+0.0%, paired rounds";
    the per-round figures are recomputed from each row's own samples, and a block they contradict is exit 2."""
    levels = [40.0, 41.0, 39.5, 40.5, 40.2]
    base = _rounds_doc("base", levels)
    honest = _rounds_doc("honest", [level * 1.001 for level in levels])
    check = compare(base, [honest], [parse_expr("tpot_ms.p50 > +5%")]).candidates[0].checks[0]
    assert check.method == "paired rounds (5)" and check.outcome == "pass"
    slower = json.loads(json.dumps(base))
    slower["run_id"] = "slower"
    for key in ("tpot_ms", "ttft_ms", "e2e_ms", "itl_ms"):
        slower["samples"][key] = [2 * v for v in slower["samples"][key]]
        slower["metrics"][key] = {k: v if k == "n" else [2 * x for x in v] if isinstance(v, list) else 2 * v
                                  for k, v in slower["metrics"][key].items()}
    slower["metrics"]["output_throughput_tok_s"] /= 2
    with pytest.raises(ResultError, match="per_round.* the rounds block does not match the row's samples"):
        compare(base, [slower], [parse_expr("tpot_ms.p50 > +5%")])
    result = invoke(str(save(base, tmp_path)), str(save(slower, tmp_path)), "--fail-if", "tpot_ms.p50 > +5%")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: slower: metrics.rounds.per_round."), result.stderr
    assert "+0.0%" not in result.output
    # a block that its samples cannot check (no samples per round) is not used: the row is judged on its samples
    bare = json.loads(json.dumps(slower))
    bare["samples"]["ttft_ms"] = bare["samples"]["ttft_ms"][:-1]
    bare["samples"]["e2e_ms"] = bare["samples"]["e2e_ms"][:-1]
    bare["samples"]["tpot_ms"] = bare["samples"]["tpot_ms"][:-1]
    bare["samples"]["prompt_index"] = bare["samples"]["prompt_index"][:-1]
    check = compare(base, [bare], [parse_expr("tpot_ms.p50 > +5%")]).candidates[0].checks[0]
    assert "rounds" not in check.method and check.outcome == "regression" and check.observed > 80


def test_paired_comparison_is_tight_where_unpaired_is_wide():
    from infer_tune.report.compare import compare, parse_expr
    from infer_tune.report.run_to_run import NONE

    base, same, slower = _paired_doc("a", 1.0, 1), _paired_doc("b", 1.0, 2), _paired_doc("c", 1.2, 3)
    expr = parse_expr("tpot_ms.p50 > +10%")
    check_same = compare(base, [same], [expr], spread=NONE).candidates[0].checks[0]
    check_slower = compare(base, [slower], [expr], spread=NONE).candidates[0].checks[0]
    assert check_same.method == "paired bootstrap ratio" and not check_same.regressed
    assert check_slower.regressed and check_slower.interval[0] > 10.0
    # without prompt indices the same 20% shift is lost in the prompt-to-prompt spread
    for doc in (base, slower):
        del doc["samples"]["prompt_index"]
    assert not compare(base, [slower], [expr], spread=NONE).candidates[0].checks[0].regressed


def test_run_to_run_spread_widens_separate_runs_only(tmp_path, monkeypatch):
    """Separate runs get one run's level spread per side added in quadrature (a tight paired interval is
    not the whole story between processes); rows of the same rounds get none; a calibration of repeated
    runs is stored per machine and used by default."""
    from infer_tune.report import run_to_run as rtr
    from infer_tune.report.compare import compare, parse_expr

    expr = parse_expr("tpot_ms.p50 > +2.5%")
    base, cand = _paired_doc("a", 1.0, 1), _paired_doc("b", 1.02, 2)
    tight = compare(base, [cand], [expr], spread=rtr.NONE).candidates[0].checks[0]
    wide = compare(base, [cand], [expr], spread=rtr.for_host(base, 1.5)).candidates[0].checks[0]
    assert wide.run_to_run_pct == pytest.approx(1.5 * 2 ** 0.5) and wide.method.endswith("+ run-to-run")
    assert wide.interval[0] < tight.interval[0] and wide.interval[1] > tight.interval[1]
    assert wide.mde > tight.mde and "run-to-run spread" in wide.mde_hint
    assert wide.outcome == "inconclusive"  # +2% measured apart: cannot be told from +2.5% at 1.5% per run
    for doc in (base, cand):
        doc["metrics"]["rounds"] = {"group": "g1"}
    same = compare(base, [cand], [expr], spread=rtr.for_host(base, 1.5)).candidates[0]
    assert same.same_rounds and same.checks[0].interval == tight.interval and same.checks[0].run_to_run_pct is None
    # with per-round figures, rows of one rounds run are judged on the rounds' pairs (the engine's interval)
    base = _rounds_doc("a", [40.0, 41.0, 39.5, 40.5])
    cand = _rounds_doc("b", [42.0, 43.1, 41.4, 42.6])
    rounds_check = compare(base, [cand], [expr]).candidates[0].checks[0]
    assert rounds_check.method == "paired rounds (4)" and rounds_check.outcome == "regression"
    assert 4.8 < rounds_check.observed < 5.2 and rounds_check.interval[0] > 2.5
    # the host's drift counts in proportion to the time between the two results, up to the calibration's span
    drifting = rtr.Spread({"*": 1.0}, "calibrated", "test", drift_pct={"*": 3.0}, span_s=600.0)
    assert drifting.pair_sd("tpot_ms.p50", 0.0) == pytest.approx(2 ** 0.5)
    assert drifting.pair_sd("tpot_ms.p50", 150.0) == pytest.approx(2 ** 0.5 * (1 + 9 / 4) ** 0.5)
    assert drifting.pair_sd("tpot_ms.p50", 6000.0) == drifting.pair_sd("tpot_ms.p50", None) == pytest.approx(20 ** 0.5)
    # calibration: 4 repeated runs whose levels differ by a known 3% spread, far above their sampling error
    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path / "home"))  # the stored calibration stays in this test
    runs = []
    for i, level in enumerate((1.0, 1.03, 0.97, 1.0)):
        doc = make_result(f"r{i}", tpot_ms=40.0 * level, seed=i)
        runs.append(save(doc, tmp_path))
    result = invoke(*map(str, runs), "--calibrate", "--json")
    assert result.exit_code == 0, result.output
    cal = {m["metric"]: m for m in json.loads(result.stdout)["metrics"]}
    assert 1.5 < cal["tpot_ms"]["sigma_pct"] <= cal["tpot_ms"]["adjacent_pct"] < 3.5
    stored = rtr.for_host(make_result("x"))
    assert stored.source == "calibrated" and stored.sigma("tpot_ms.p50") == cal["tpot_ms"]["sigma_pct"]
    assert invoke(str(runs[0]), "--calibrate").exit_code == 2  # one run cannot show a spread
    # the smallest gate separate runs pass 19 times in 20: (1.645 + 1.96) x sqrt(2) x the adjacent-run spread
    adjacent = cal["tpot_ms"]["adjacent_pct"]
    assert cal["tpot_ms"]["gate_pct"] == pytest.approx(100 * math.expm1(3.605 * 2 ** 0.5 * adjacent / 100), rel=1e-3)
    assert "smallest gate" in invoke(*map(str, runs), "--calibrate").stdout


def test_smallest_gate_of_a_simulated_host_passes_19_of_20_pairs():
    """The rule behind `gate_pct`, checked by simulation: A/A pairs of runs whose levels spread by the
    calibrated amount, each judged with the interval compare would give, pass at the smallest gate about
    95% of the time, and far less often at half of it."""
    rng = np.random.default_rng(0)
    sigma = 3.0  # % per run
    gate = rtr.smallest_gate_pct(sigma)
    change = 100 * np.expm1(rng.normal(0, sigma / 100, 4000) - rng.normal(0, sigma / 100, 4000))
    top = [rtr.widen(c, None, 2 ** 0.5 * sigma)[1] for c in change]
    passed = np.mean([t < gate for t in top])
    assert 0.93 < passed < 0.97
    assert np.mean([t < gate / 2 for t in top]) < 0.75


# --------------------------------------------------------------------------- outcomes (report/gate.py)
def _noisy(doc: dict, cv: float = 0.08) -> dict:
    doc["metrics"]["noise"] = {"noisy": True, "tpot_p50_cv": cv, "ttft_p50_cv": cv, "why": ["test"]}
    return doc


def test_three_outcomes_and_the_detectable_change():
    from infer_tune.report.gate import outcome

    expr = parse_expr("tpot_ms.p50 > +10%")
    same = judge(expr, make_result("a", seed=1), make_result("b", seed=2))
    slow = judge(expr, make_result("a", seed=1), make_result("b", tpot_ms=48.0, seed=2))
    straddle = judge(expr, make_result("a", n=6, noise=0.3, seed=3), make_result("b", tpot_ms=46.0, n=6, noise=0.3, seed=4))
    assert (same.outcome, slow.outcome, straddle.outcome) == ("pass", "regression", "inconclusive")
    assert not straddle.regressed and slow.regressed
    for check in (same, slow, straddle):
        assert check.mde == pytest.approx((check.interval[1] - check.interval[0]) / 2)
        assert "--limit, now 4" in check.mde_hint and "--min-iterations" in check.mde_hint
    assert straddle.mde > 5 * same.mde  # 6 samples of 30% noise against 60 of 2%
    assert "about" in straddle.mde_hint and "--limit" in straddle.mde_hint.split("about")[1]
    # the rule itself, for each operator direction
    assert outcome(">", 10, 12, [11, 13]) == "regression" and outcome(">", 10, 5, [4, 9]) == "pass"
    assert outcome(">", 10, 9, [8, 12]) == "inconclusive" and outcome("<", -5, -6, [-7, -4]) == "inconclusive"
    assert outcome("<", -5, -8, [-9, -6]) == "regression" and outcome("<=", -5, 1.0, None) == "pass"


def test_a_noisy_candidate_cannot_pass_a_2x_slowdown():
    expr = parse_expr("tpot_ms.p50 > +10%")
    base = make_result("a", seed=1)
    for cv, spread in ((0.08, 0.02), (0.5, 0.6)):  # declares itself noisy; or noisy and widely spread
        cand = _noisy(make_result("b", tpot_ms=80.0, n=12, noise=spread, seed=5), cv)
        check = judge(expr, base, cand)
        assert check.outcome != "pass"
    assert judge(expr, base, _noisy(make_result("b", tpot_ms=80.0, seed=5))).outcome == "regression"


def test_a_noisy_base_and_a_real_18_percent_slowdown_never_pass():
    expr = parse_expr("tpot_ms.p50 > +10%")
    for seed in range(8):
        base = _noisy(make_result("a", n=12, noise=0.10, seed=seed))
        cand = make_result("b", tpot_ms=40.0 * 1.18, n=12, noise=0.03, seed=100 + seed)
        assert judge(expr, base, cand).outcome in ("regression", "inconclusive")


def test_noise_only_withholds_a_pass():
    expr = parse_expr("tpot_ms.p50 > +10%")
    base = make_result("a", seed=1)
    near = judge(expr, base, _noisy(make_result("b", seed=2)))  # equal speed, noisy: within 16% of +10%
    assert near.outcome == "inconclusive" and "widened" in near.noise
    far = judge(expr, base, _noisy(make_result("b", tpot_ms=24.0, seed=2)))  # 40% faster: passes even widened
    assert far.outcome == "pass" and "passes even widened" in far.noise
    assert judge(expr, base, make_result("b", seed=2)).outcome == "pass"  # the same candidate, quiet


def test_cli_inconclusive_exit_code_and_strict(tmp_path):
    base = save(make_result("base", n=6, noise=0.3, seed=3), tmp_path)
    cand = save(make_result("cand", tpot_ms=46.0, n=6, noise=0.3, seed=4), tmp_path)
    gate = ["--fail-if", "tpot_ms.p50 > +10%"]
    result = invoke(str(base), str(cand), *gate)
    assert result.exit_code == 4 and "inconclusive" in result.output and "detectable change" in result.output
    assert invoke(str(base), str(cand), *gate, "--strict").exit_code == 1
    doc = json.loads(invoke(str(base), str(cand), *gate, "--json").stdout)
    assert doc["outcome"] == "inconclusive" and not doc["regressed"]
    check = doc["candidates"][0]["checks"][0]
    assert check["outcome"] == "inconclusive" and doc["candidates"][0]["outcome"] == "inconclusive"
    assert check["mde"] > 0 and "--limit" in check["mde_hint"]
    root = ET.fromstring(invoke(str(base), str(cand), *gate, "--format", "junit").stdout)
    assert root.get("skipped") == "1" and root.get("failures") == "0"
    strict = ET.fromstring(invoke(str(base), str(cand), *gate, "--format", "junit", "--strict").stdout)
    assert strict.get("failures") == "1"
    assert "⚠️ inconclusive" in invoke(str(base), str(cand), *gate, "--format", "md").stdout


def test_regression_outweighs_inconclusive_overall(runs, tmp_path):
    wide = save(make_result("wide", tpot_ms=46.0, n=6, noise=0.3, seed=4), tmp_path)
    result = invoke(str(runs["base"]), str(wide), str(runs["slow"]), "--fail-if", "tpot_ms.p50 > +10%",
                    "--allow-mismatch", "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["outcome"] == "regression"
    assert [c["outcome"] for c in doc["candidates"]] == ["inconclusive", "regression"]


def test_a_self_declared_endpoint_runner_relaxes_nothing():
    base = make_result("a")
    other = make_result("b", model="served-elsewhere")
    other["env"]["threads"] = 8
    other["runner"] = "endpoint"
    with pytest.raises(MismatchError, match="model .*threads"):
        compare(base, [other])
    same_but_endpoint = make_result("c")
    same_but_endpoint["runner"] = "endpoint"
    with pytest.raises(MismatchError, match="runner 'endpoint'"):
        compare(base, [same_but_endpoint])
    both = {**make_result("d", model="deploy-a"), "runner": "endpoint"}
    assert compare(both, [other]).warnings == []  # two deployments: their servers' own settings differ


def test_failed_requests_are_refused_by_the_gate(tmp_path):
    base = save(make_result("base", seed=1), tmp_path)
    cand = make_result("cand", seed=2, requests_failed=3, warmup_failures=1, requests_ok=29,
                       failures_by_kind={"http_500": 4})
    folder = save(cand, tmp_path)
    gate = ["--fail-if", "tpot_ms.p50 > +10%"]
    result = invoke(str(base), str(folder), *gate, "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    failed = [c for c in doc["candidates"][0]["checks"] if c["metric"] == "requests_failed"][0]
    assert failed["outcome"] == "regression" and failed["observed"] == 4 and "http_500 4" in failed["reason"]
    assert [c["outcome"] for c in doc["candidates"][0]["checks"]][0] == "pass"  # the latency alone passed
    assert "failed requests > 0" in invoke(str(base), str(folder)).output  # also without --fail-if
    assert invoke(str(base), str(folder), *gate, "--max-failed-requests", "4").exit_code == 0
    assert invoke(str(base), str(folder), *gate, "--max-failed-requests", "3").exit_code == 1
    clean = save(make_result("clean", seed=3, requests_failed=0, warmup_failures=0), tmp_path)
    assert invoke(str(base), str(clean), *gate).exit_code == 0


@pytest.mark.parametrize("where", ["negative", "zero", "stat"])
def test_impossible_timings_are_bad_input(tmp_path, where):
    base = save(make_result("base", seed=1), tmp_path)
    cand = make_result("cand", seed=2)
    if where == "negative":
        cand["samples"]["tpot_ms"] = [-2.0 * v for v in cand["samples"]["tpot_ms"]]
    elif where == "zero":
        cand["samples"] = {k: [0.0] * len(v) for k, v in cand["samples"].items()}
    else:
        cand["samples"] = {}
        cand["metrics"]["ttft_ms"]["p50"] = -5.0
    folder = save(cand, tmp_path)
    for args in ((str(base), str(folder)), (str(folder), str(base))):
        result = invoke(*args, "--fail-if", "tpot_ms.p50 > +10%")
        # the loader refuses it first (malformed), or the gate does (impossible timings): one line, exit 2
        assert result.exit_code == 2 and ("impossible timings" in result.output or "malformed" in result.output)
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_cli_noise_never_exits_0_on_a_real_slowdown(tmp_path):
    gate = ["--fail-if", "tpot_ms.p50 > +10%"]
    base = save(make_result("base", seed=1), tmp_path)
    twice = save(_noisy(make_result("twice", tpot_ms=80.0, seed=2)), tmp_path)  # 2x slower, says it is noisy
    assert invoke(str(base), str(twice), *gate).exit_code == 1
    noisy_base = save(_noisy(make_result("noisy-base", n=12, noise=0.10, seed=3)), tmp_path)
    slower = save(make_result("slower", tpot_ms=40.0 * 1.18, n=12, noise=0.03, seed=4), tmp_path)
    assert invoke(str(noisy_base), str(slower), *gate).exit_code in (1, 4)
    bad_count = save(make_result("bad-count", seed=5, requests_failed=-3), tmp_path)
    for args in ((str(base), str(bad_count)), (str(bad_count), str(base))):
        assert invoke(*args).exit_code == 2


def test_a_zero_latency_between_separate_runs_is_widened_not_a_crash():
    """A loopback server can deliver every token of a response in one read: ITL and TPOT of 0 are real
    measurements (-100%). Widening such a change by the run-to-run spread stays on the log scale's floor
    instead of failing (it exited 3, "math domain error")."""
    assert rtr.widen(-100.0, [-100.0, -100.0], 2.0)[0] == pytest.approx(-99.999, abs=1e-3)
    low, high = rtr.widen(-100.0, None, 2.0)
    assert low < high and high < -99.9
    base, cand = make_result("a", seed=1), make_result("b", seed=2)
    for key in ("itl_ms", "tpot_ms"):
        cand["samples"][key] = [0.0] * len(cand["samples"][key])
        cand["metrics"][key].update(p50=0.0, p90=0.0, p99=0.0, mean=0.0, stdev=0.0, mad=0.0, p50_ci95=[0.0, 0.0])
    found = compare(base, [cand], [parse_expr("bleu_drift < -1.0")], spread=rtr.for_host(base, 1.5))
    itl = next(d for d in found.candidates[0].deltas if d.metric == "itl_ms.p50")
    assert itl.change_pct == pytest.approx(-100.0) and itl.ci95_pct[1] < -99.0
