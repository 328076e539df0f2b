"""The HTML report opened by a real headless browser (Debian's Chromium driven by Playwright) at 1280 px:
no console errors, every plot rendered (the Pareto plot inline, a hover title on every point), the
recommended row marked, hostile result text inert, the table sorts on click and filters as typed; a
screenshot is kept in runs/test-artifacts/ (CI artifact). With INFER_TUNE_REPORT_RUNS=DIR the same
checks run on a real runs folder (its report rewritten there, as `make demo` writes it) and its
screenshot is what docs/report.png shows."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from result_docs import make_result, save

from infer_tune import results
from infer_tune.report import leaderboard as lb

ARTIFACTS = Path(__file__).resolve().parent.parent / "runs" / "test-artifacts"


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _report(tmp_path: Path) -> Path:
    from infer_tune.report.plots import per_position_png

    runs = tmp_path / "runs"
    hostile = 'x"><svg/onload=alert(document.domain)>'
    docs = [
        make_result("r-base", seed=1, output_mismatches=None),
        make_result("r-hostile", technique="quantize", config={"method": "bf16"}, tpot_ms=25.0, seed=5,
                    speedup_vs_baseline=1.6, output_mismatches=2, ppl_delta_pct=0.1,
                    claim_check={"claim": hostile, "measured": hostile, "verdict": hostile}),
        make_result("r-int8", technique="quantize", config={"method": "int8-dynamic"}, tpot_ms=12.0,
                    speedup_vs_baseline=3.3, ppl_delta_pct=1.8, bleu_drift=0.2, bleu_drift_ci95=[-1.0, 1.4],
                    output_mismatches=4, exact_match_vs_baseline=0.0, seed=2),
        make_result("r-int4", technique="quantize", config={"method": "int4-rtn"}, tpot_ms=10.0,
                    speedup_vs_baseline=3.9, ppl_delta_pct=5.1, output_mismatches=4, seed=3),
        make_result("r-static", technique="kv-cache", config={"impl": "static"}, tpot_ms=41.0,
                    speedup_vs_baseline=0.98, output_mismatches=0, per_position_ms=[40.0, 41.0, 43.0], seed=4),
    ]
    for doc in docs[1:]:
        doc["baseline_run_id"] = "r-base"
    for doc in docs:
        folder = save(doc, runs)
    (folder / "latency.png").write_bytes(per_position_png({"static": [40.0, 41.0, 43.0]}))
    found = results.find_results(runs)
    written = lb.write(lb.build(found), found, runs, ["html"])
    return written["html"]


def _check_in_browser(page_file: Path, screenshot: Path, *, synthetic: bool) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    errors: list[str] = []
    dialogs: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
            page.goto(page_file.resolve().as_uri())
            page.wait_for_load_state("load")
            images = page.eval_on_selector_all("img", "els => els.map(e => [e.complete, e.naturalWidth])")
            assert len(images) >= (3 if synthetic else 1)  # TTFT/TPOT bars (+ per-position, the techniques' own)
            assert all(done and width > 0 for done, width in images), images
            points = page.eval_on_selector_all("svg.plot g.point", "gs => gs.map(g => g.querySelector('title').textContent)")
            assert points and all("x decode" in t for t in points)  # every Pareto point has a hover title
            svg_width = page.eval_on_selector("svg.plot", "s => s.getBoundingClientRect().width")
            assert 300 < svg_width <= 1280
            recommended = page.eval_on_selector_all("#leaderboard tr.recommended", "rs => rs.length")
            assert recommended == (1 if synthetic or "★" in page.inner_text(".rec") else 0)
            assert page.eval_on_selector_all("[onload]", "els => els.length") == 0  # hostile text stayed text

            def column(header: str) -> list[str]:
                index = page.eval_on_selector_all("#leaderboard th", f"hs => hs.findIndex(h => h.textContent === '{header}')")
                return page.eval_on_selector_all(
                    "#leaderboard tbody tr", f"rs => rs.filter(r => r.style.display !== 'none').map(r => r.cells[{index}].dataset.v)")

            page.click("#leaderboard th:text-is('TPOT p50')")
            ascending = [float(v) for v in column("TPOT p50") if v]
            assert ascending == sorted(ascending)
            page.click("#leaderboard th:text-is('TPOT p50')")
            assert [float(v) for v in column("TPOT p50") if v] == sorted(ascending, reverse=True)
            page.fill("#filter", "kv-cache")
            assert set(column("technique")) == {"kv-cache"}
            page.fill("#filter", "")
            page.click("#leaderboard th:text-is('technique')")
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 1280, f"horizontal scroll: page is {width}px wide"
        finally:
            browser.close()
    assert errors == [] and dialogs == []
    assert screenshot.stat().st_size > 10_000


@pytest.mark.skipif(_chromium() is None, reason="no Chromium installed (make test installs Debian's chromium)")
def test_report_in_a_real_browser(tmp_path):
    _check_in_browser(_report(tmp_path), ARTIFACTS / "report.png", synthetic=True)


@pytest.mark.skipif(_chromium() is None or not os.environ.get("INFER_TUNE_REPORT_RUNS"),
                    reason="set INFER_TUNE_REPORT_RUNS to a runs folder (e.g. runs/demo) to check its report")
def test_real_report_in_a_real_browser(tmp_path):
    runs = Path(os.environ["INFER_TUNE_REPORT_RUNS"])
    found = results.find_results(runs)
    assert found, f"no results under {runs}"
    page_file = lb.write(lb.build(found), found, runs)["html"]  # the report beside the runs, as `make demo` writes it
    _check_in_browser(page_file, ARTIFACTS / "report-real.png", synthetic=False)
