"""Leaderboard: one row per result across techniques, md / csv / html files, sorting, filtering, CLI."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from result_docs import make_result, save
from typer.testing import CliRunner

from infer_tune.cli import app
from infer_tune.errors import InferTuneError
from infer_tune.report import leaderboard as lb


def docs() -> list[dict]:
    return [
        make_result("r-base", seed=1),
        make_result("r-int8", technique="quantize", config={"kind": "quantize", "method": "int8"}, tpot_ms=20.0,
                    speedup_vs_baseline=2.0, bleu_drift=-0.7, exact_match_vs_baseline=0.5, ppl_delta_pct=1.5, seed=2),
        make_result("r-int4", technique="quantize", config={"kind": "quantize", "method": "int4"}, tpot_ms=30.0,
                    speedup_vs_baseline=1.3, bleu_drift=-3.0, seed=3),
        make_result("r-static", technique="kv-cache", config={"impl": "static"}, speedup_vs_baseline=1.1,
                    bleu_drift=0.0, per_position_ms=[30.0, 31.0, 33.0, 34.0], suite="code", seed=4),
    ]


def test_build_flattens_one_row_per_result():
    frame = lb.build(docs())
    assert list(frame["run_id"]) == ["r-base", "r-int8", "r-int4", "r-static"]
    assert list(frame.columns) == list(lb.COLUMNS)
    row = frame.set_index("run_id").loc["r-int8"]
    assert row["config"] == "method=int8" and row["tpot_p50_ms"] == pytest.approx(20.0, rel=0.05)
    assert frame.set_index("run_id").loc["r-base", "speedup_vs_baseline"] == 1.0


def test_sort_and_filter():
    frame = lb.build(docs(), sort="speedup_vs_baseline", descending=True)
    assert list(frame["run_id"]) == ["r-int8", "r-int4", "r-static", "r-base"]
    assert list(lb.build(docs(), technique=["quantize"])["run_id"]) == ["r-int8", "r-int4"]
    assert list(lb.build(docs(), suite=["code"])["run_id"]) == ["r-static"]
    with pytest.raises(InferTuneError, match="--sort"):
        lb.build(docs(), sort="nope")


def test_pareto_front():
    points = [(2.0, -0.7), (1.3, -3.0), (1.1, 0.0), (1.0, 0.0)]
    assert lb.pareto_front(points) == [0, 2]


def test_write_all_formats(tmp_path):
    all_docs = docs()
    written = lb.write(lb.build(all_docs), all_docs, tmp_path)
    assert set(written) == {"md", "csv", "html"}  # no result names a baseline: nothing to recommend
    assert len(pd.read_csv(written["csv"])) == 4
    md_rows = [line for line in written["md"].read_text().splitlines() if line.rstrip().endswith((" r-base |",
               " r-int8 |", " r-int4 |", " r-static |"))]
    assert len(md_rows) == 4
    assert md_rows[1].startswith("| quantize | method=int8 |")  # technique and config first, run id last
    assert "decode 2.00x" in md_rows[1] and "ms" in md_rows[1]  # human units, not raw floats
    page = written["html"].read_text()
    assert page.count("data:image/png;base64,") == 2  # bars, per-position
    assert page.count("<svg") == 1 and "perplexity change, %, lower is better" in page  # the Pareto plot, inline
    assert "r-int8" in page and "src=\"http" not in page  # self-contained: no external resource


def test_broken_results_are_marked_and_never_a_speedup():
    from infer_tune.report import display

    row = lb.flatten(make_result("r-bad", technique="quantize", speedup_vs_baseline=3.2, ppl_delta_pct=4e8,
                                 output_mismatches=4, bleu_vs_baseline=0.1))
    assert display.verdict(row) == "broken"
    lead = next(c for c in display.COLUMNS if c.key == "lead_value")
    assert lead.render({**row, "lead": "decode 3.20x"}) == "broken"


def test_recommendation_respects_the_drift_budget_and_lossless(tmp_path):
    from infer_tune.report.recommend import Budget, recommend

    base = make_result("b", seed=1)
    fast_lossy = make_result("fast", technique="quantize", speedup_vs_baseline=3.0, ppl_delta_pct=12.0,
                             bleu_drift=-0.2, output_mismatches=3, seed=2)
    ok = make_result("ok", technique="quantize", speedup_vs_baseline=1.8, ppl_delta_pct=1.0, bleu_drift=-0.1,
                     output_mismatches=2, seed=3)
    lossless = make_result("same", technique="kv-cache", speedup_vs_baseline=1.1, output_mismatches=0, seed=4)
    for d in (fast_lossy, ok, lossless):
        d["baseline_run_id"] = "b"
    docs_ = [base, fast_lossy, ok, lossless]
    assert recommend(docs_, Budget(max_ppl_delta=5.0)).doc["run_id"] == "ok"
    # a saved model is named only while it exists (a run without --save deletes its temporary one)
    ok["metrics"]["save_dir"] = str(tmp_path / "gone")
    assert recommend(docs_, Budget(max_ppl_delta=5.0)).saved_model is None
    ok["metrics"]["save_dir"] = str(tmp_path)
    assert recommend(docs_, Budget(max_ppl_delta=5.0)).saved_model == str(tmp_path)
    assert recommend(docs_, Budget(max_ppl_delta=20.0)).doc["run_id"] == "fast"
    assert recommend(docs_, Budget(require_lossless=True)).doc["run_id"] == "same"
    slow = make_result("slow", technique="kv-cache", speedup_vs_baseline=0.9, output_mismatches=0, seed=5)
    slow["baseline_run_id"] = "b"
    none = recommend([base, slow], Budget(require_lossless=True))
    assert none.doc is None and "beat the baseline" in none.reasons[-1]


def test_claims_table_from_synthetic_results():
    from infer_tune.report import claims
    from infer_tune.tuners.quantize.pipeline import claim_finding

    q = make_result("q", technique="quantize", claim_check={
        "claim": "INT8 halves weight memory", "method": "int8-dynamic", "bytes_ratio_vs_16bit": 0.5,
        "speedup_judged": 1.8, "speedup_vs_16bit": 1.8, "ppl_delta_pct": 1.2, "bleu_drift": 0.1, "held": False,
        "finding": claim_finding("int8-dynamic", 0.5, 1.8, True, 1.2, 0.1)})
    g = make_result("g", technique="speculate", claims=[{"statement": "2-4x on code", "measured": "1.3x",
                                                          "held": None, "why": "no draft on this device"}])
    rows = claims.collect([q, q, g])
    assert [r.verdict for r in rows] == ["did not hold here", "not applicable"]
    assert "1.80x decode vs bf16" in rows[0].measured and rows[1].why == "no draft on this device"


def test_sweep_level_claims_reach_the_claims_table(tmp_path):
    """Batch, speculate and experts judge their claims on a whole sweep (`conclude`); the sweep stores
    the claim in each result on disk, and the claims table shows each once, with its finding."""
    from infer_tune import results
    from infer_tune.report import claims
    from infer_tune.sweep import conclude_sweep

    batch = [make_result(f"b-{s}", technique="batch", config={"scheduler": s, "rate": 2.0}, seed=i,
                         e2e_ms={"mean": 1000.0 if s == "static" else 500.0, "p90": 1500.0}, busy_share=0.95,
                         output_throughput_tok_s=10.0 if s == "static" else 16.0)
             for i, s in enumerate(("static", "continuous"))]
    spec = [make_result(f"s-{k}", technique="speculate", suite="code-edit", seed=5 + k,
                        config={"draft": "prompt-lookup", "num_draft_tokens": k, "engine": "hf"},
                        speedup_vs_baseline=1.5 + k / 10, output_mismatches=0, draft_kind="prompt-lookup",
                        ttft_speedup_vs_baseline=1.0, acceptance_by_position=[0.5] * k) for k in (2, 4)]
    experts = [make_result(f"x-{s}", technique="experts", config={"strategy": s}, seed=9 + i,
                           alltoall_bytes_per_token=b, measured_device_load_share=[0.5, 0.5], balancedness=1.0)
               for i, (s, b) in enumerate((("round-robin", 1000.0), ("locality", 300.0)))]
    for doc in batch + spec + experts:
        doc["label"] = doc["run_id"]
    batch, spec, experts = ([results.load_result(save(doc, tmp_path)) for doc in group] for group in (batch, spec, experts))
    conclude_sweep(batch + spec + experts, own={d["run_id"] for d in batch + spec + experts})
    on_disk = results.find_results(tmp_path)
    rows = claims.collect(on_disk)
    by = {r.technique: r for r in rows}
    assert len(rows) == 3 and set(by) == {"batch", "speculate", "experts"}
    assert by["batch"].verdict == "held" and "-50%" in by["batch"].measured and "1.60x" in by["batch"].measured
    assert by["speculate"].verdict == "did not hold here" and "s-4 1.90x" in by["speculate"].measured
    assert by["experts"].verdict == "held" and "-70.0%" in by["experts"].measured
    assert all(d["metrics"]["claim_check"] for d in on_disk)
    # and each technique's own figures, in every result folder of the sweep (the HTML report shows them)
    figures = {"batch": {"latency_cdf.png", "throughput_latency.png"}, "speculate": {"acceptance.png"},
               "experts": {"plan_loads.png"}}
    for doc in on_disk:
        assert {p.name for p in doc.location.glob("*.png")} == figures[doc["technique"]]


def test_cli_writes_files_and_prints(tmp_path):
    runs = tmp_path / "runs"
    for doc in docs():
        save(doc, runs)
    result = CliRunner().invoke(app, ["leaderboard", str(runs), "--out", str(tmp_path / "lb"), "--sort", "bleu_drift",
                                      "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert len(payload["rows"]) == 4 and set(payload["files"]) == {"md", "csv", "html"}
    assert "recommendation" in payload and "claims" in payload
    result = CliRunner().invoke(app, ["leaderboard", str(runs), "--format", "md,csv", "--technique", "quantize"])
    assert result.exit_code == 0, result.output
    assert (runs / "leaderboard.md").exists() and not (runs / "leaderboard.html").exists()
    assert CliRunner().invoke(app, ["leaderboard", str(tmp_path / "empty")]).exit_code == 2
    assert CliRunner().invoke(app, ["leaderboard", str(runs), "--sort", "nope"]).exit_code == 2


def _stage(docs_: list[dict], baseline: str = "base") -> list[dict]:
    for doc in docs_:
        doc["baseline_run_id"] = baseline
        doc["label"] = doc["run_id"]
    return docs_


def test_each_technique_leads_with_what_it_is_judged_on_and_names_the_comparison():
    batch = _stage([make_result(f"b-{s}", technique="batch", seed=i,
                                config={"scheduler": s, "batch_size": 4, "rate": 2.0, "burstiness": 1.0},
                                e2e_ms={"mean": 2000.0 if s == "static" else 1700.0}, speedup_vs_baseline=0.4,
                                output_throughput_tok_s=26.8 if s == "static" else 34.4)
                    for i, s in enumerate(("static", "continuous"))])
    experts = _stage([make_result(f"x-{s}", technique="experts", seed=5 + i, config={"strategy": s, "devices": 2},
                                  alltoall_bytes_per_token=b, balancedness=bal, speedup_vs_baseline=0.26)
                      for i, (s, b, bal) in enumerate((("round-robin", 134272.0, 0.91), ("locality", 123131.0, 0.95)))])
    spec = _stage([make_result("s-k8", technique="speculate", seed=8, speedup_vs_baseline=2.04,
                               speedup_vs_baseline_ci95=[1.98, 2.10], mean_acceptance_length=3.25)])
    quant = _stage([make_result("q", technique="quantize", seed=9, speedup_vs_baseline=3.64,
                                speedup_vs_baseline_ci95=[3.58, 3.70])])
    rows = lb.build([make_result("base"), *batch, *experts, *spec, *quant]).set_index("run_id")
    assert rows.loc["b-continuous", "lead"] == "throughput 1.28x · mean e2e -15.0%"
    assert rows.loc["b-continuous", "lead_vs"] == "static batching at the same rate (2 req/s)"
    assert rows.loc["b-static", "lead"].startswith("throughput 26.8 tok/s") and "reference" in rows.loc["b-static", "lead_vs"]
    assert rows.loc["x-locality", "lead"] == "bytes/token -8.3% · balancedness 0.95 vs 0.91"
    assert rows.loc["x-locality", "lead_vs"].startswith("round-robin placement")
    assert rows.loc["s-k8", "lead"] == "decode 2.04x [1.98–2.10] · acceptance 3.25 tokens"
    assert rows.loc["q", "lead"] == "decode 3.64x [3.58–3.70]"  # the interval when the result has one
    assert rows.loc["q", "lead_vs"].endswith("baseline (same session)")
    assert "0.4" not in rows.loc["b-continuous", "lead"]  # never single-stream decode speedup for batching


def test_recommended_yaml_reproduces_the_recommended_config_with_only_the_fields_that_apply(tmp_path):
    from infer_tune.recipe import build_configs, expand_stages, load_recipe
    from infer_tune.report.recommend import recommended_recipe

    config = {"kind": "QuantizeConfig", "method": "int8-dynamic", "backend": "torch", "alpha": 0.5, "group_size": 32,
              "calib_suite": "chat", "calib_samples": 16, "decode_kernel": "auto", "prefill_kernel": "auto",
              "head_bits": 8, "activations": "bf16", "compute_dtype": "float32"}
    best = make_result("q", technique="quantize", config=config, speedup_vs_baseline=2.7, ppl_delta_pct=1.8,
                       output_mismatches=4, seed=2)
    best["workload"].update(seed=0, batch_size=1, chat_template=True)
    best["protocol"] = {"warmup": 1, "min_iterations": 2, "min_duration_s": 2.0, "pin_length": True}
    all_docs = [make_result("base", seed=1), *_stage([best])]
    out = tmp_path / "it's a report"
    written = lb.write(lb.build(all_docs), all_docs, out)
    recipe_file = written["recommended"]
    assert recipe_file == out / "recommended.yaml"
    saved = recipe_file.read_text()
    assert "infer-tune bench --recipe '" in saved  # the command in its header, shell-quoted
    for absent in ("alpha", "group_size", "calib_suite", "calib_samples", "head_bits", "activations"):
        assert absent not in saved  # int8-dynamic reads none of them
    stage = expand_stages(load_recipe(str(recipe_file)))[0]
    (rebuilt,) = build_configs(stage)
    assert rebuilt.to_dict() == config  # the same config as the recommended row's
    assert stage.model == "smollm2-135m" and stage.workload["limit"] == 4 and stage.protocol["min_duration_s"] == 2.0
    assert recommended_recipe(best)["configs"][0]["method"] == "int8-dynamic"
    md = written["md"].read_text()
    assert "★" in md and "Reproduce: `infer-tune bench --recipe '" in md


def test_a_recommended_stack_reads_back_as_a_recipe_and_is_served(tmp_path):
    """make demo's winner is a stack (int4 a8 + prompt lookup verified in the native step): its recommended.yaml
    reads back (each part a recipe entry: no `kind`), rebuilds the same stack, and `serve` plans it."""
    from infer_tune.recipe import build_configs, expand_stages, load_recipe
    from infer_tune.scenarios.serve import plan_from_recipe
    from infer_tune.tuners.quantize import QuantizeConfig
    from infer_tune.tuners.speculate import SpeculateConfig
    from infer_tune.tuners.stack import StackConfig

    stack = StackConfig(configs=[QuantizeConfig(method="int4-rtn", activations="int8"),
                                 SpeculateConfig(draft="prompt-lookup", num_draft_tokens=8, engine="lean",
                                                 native_step=True)])
    best = make_result("s", technique="stack", config=stack.to_dict(), speedup_vs_baseline=13.1, ppl_delta_pct=-0.06,
                       seed=2)
    all_docs = [make_result("base", seed=1), *_stage([best])]
    written = lb.write(lb.build(all_docs), all_docs, tmp_path)
    assert "kind" not in written["recommended"].read_text()
    (rebuilt,) = build_configs(expand_stages(load_recipe(str(written["recommended"])))[0])
    assert rebuilt.to_dict() == stack.to_dict()
    plan = plan_from_recipe(str(written["recommended"]))
    assert (plan.speculate, plan.native_step, [c.method for c in plan.weights]) == (8, True, ["int4-rtn"])
    # a stored result's config (to_dict, with `kind`) is read as a stack's part too
    assert StackConfig(configs=stack.to_dict()["configs"]).to_dict() == stack.to_dict()


def test_reproduce_command_is_quoted_and_csv_cells_are_neutralised(tmp_path):
    import shlex

    from infer_tune.report.recommend import reproduce_command

    hostile = tmp_path / "x'; touch PWNED; echo '$(id)"
    command = reproduce_command({}, hostile / "recommended.yaml")
    assert shlex.split(command) == ["infer-tune", "bench", "--recipe", str(hostile / "recommended.yaml")]
    rows = [make_result("=cmd|' /C calc'!A0", technique="quantize", config={"method": "+1+1"}, seed=2),
            make_result("@SUM(1)", technique="-2+3", seed=3, ppl_delta_pct=-1.5)]
    written = lb.write(lb.build(rows), rows, tmp_path, ["csv"])
    frame = pd.read_csv(written["csv"], dtype=str, keep_default_na=False)
    for column in ("run_id", "technique", "config"):
        assert not any(v.startswith(("=", "+", "-", "@")) for v in frame[column] if v not in ("", "-")), frame[column].tolist()
    assert frame.loc[0, "run_id"] == "'=cmd|' /C calc'!A0"
    assert float(frame.loc[1, "ppl_delta_pct"]) == -1.5  # numbers stay numbers


def test_hostile_text_is_escaped_everywhere_in_the_html(tmp_path):
    payload = 'x"><svg/onload=alert(document.domain)>'
    doc = make_result("r-x", technique="quantize", config={"method": payload}, seed=2, speedup_vs_baseline=2.0,
                      claim_check={"claim": payload, "measured": payload, "verdict": payload, "why": payload})
    doc["label"], doc["baseline_run_id"] = payload, "base"
    docs_ = [make_result("base", seed=1), doc]
    page = lb.write(lb.build(docs_), docs_, tmp_path, ["html", "md"])
    html_text = page["html"].read_text()
    assert "<svg/onload" not in html_text and "onload=alert" not in html_text.replace("onload=alert(document.domain)&gt;", "")
    assert 'class="text verdict-other"' in html_text  # an unknown verdict gets no class of its own
    assert "&lt;svg/onload" in html_text
    assert "<svg/onload" not in page["md"].read_text()


def test_rows_saved_within_one_second_keep_their_order(tmp_path):
    """find_results is oldest first; results of the same second come in saved order (millisecond stamps),
    and stamps that tie exactly fall back to the run folders' name order, never its reverse."""
    from infer_tune import results

    stamps = [results.created_stamp() for _ in range(3)]
    assert stamps == sorted(stamps) and "." in stamps[0]
    for run_id in ("20260101-000000-baseline-b", "20260101-000000-batch-static-s", "20260101-000000-batch-x"):
        doc = make_result(run_id)
        doc["created_at"] = "2026-01-01T00:00:00+0000"
        save(doc, tmp_path)
    assert [d["run_id"] for d in results.find_results(tmp_path)] == [
        "20260101-000000-baseline-b", "20260101-000000-batch-static-s", "20260101-000000-batch-x"]


def test_pareto_labels_of_neighbouring_points_do_not_overlap():
    """Two best rows a hair apart (the demo's int4 and lookup rows): their labels' boxes are disjoint."""
    from infer_tune.report import plots

    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.6))
    pts = [("quantize int4-weight-torch-g32", 3.14, -1.14), ("speculate lookup-k8 with a long name", 3.16, -1.10),
           ("stack int4+lookup+native", 3.17, -1.12), ("quantize int8-dynamic-torch", 2.18, 1.84)]
    for _, x, y in pts:
        ax.plot([x], [y], "o")
    ax.margins(x=0.25, y=0.3)
    notes = plots.place_labels(fig, ax, pts)
    renderer = fig.canvas.get_renderer()
    boxes = [plots.text_box(n, renderer) for n in notes]
    plt.close(fig)
    assert len(boxes) == 4
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
