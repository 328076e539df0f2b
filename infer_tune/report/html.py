"""The self-contained HTML report: environment, the leaderboard (sortable and filterable in the page,
no server), the claims table, the recommendation, the shared plots and each technique's own plots
(PNG files its results saved, embedded). Opens offline; no external script, style or font."""

from __future__ import annotations

import base64
import html
import json
import os
import stat
from pathlib import Path

from infer_tune.document import ResultDocument
from infer_tune.report import display
from infer_tune.report.claims import ClaimRow
from infer_tune.report.recommend import Recommendation

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1400px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;width:100%;font-size:12px;table-layout:auto}
.tablewrap{overflow-x:auto;max-width:100%}
th,td{border-bottom:1px solid #ddd;padding:3px 4px;text-align:right;white-space:nowrap}
td.wrap{white-space:normal}
td.text{white-space:normal;overflow-wrap:break-word}th{white-space:normal}
td.run{max-width:8em;overflow:hidden;text-overflow:ellipsis;direction:rtl;text-align:left}
th{background:#f4f4f4;cursor:pointer;user-select:none;position:sticky;top:0}
th.sorted-asc::after{content:" \\25B2"}th.sorted-desc::after{content:" \\25BC"}
td.text,th.text{text-align:left}td.run{font-size:10.5px;color:#777}
tr.broken td{background:#fde8e8}tr.baseline td{background:#eef4fb}
tr.recommended td{background:#fff6e0;font-weight:600}td.lead{white-space:normal;min-width:12em;text-align:left}
td.vs{white-space:normal;font-size:11.5px;color:#555;min-width:8em;text-align:left}
svg.plot{max-width:100%;height:auto;border:1px solid #eee}svg.plot .point{cursor:help}
.verdict-held{color:#176b2c;font-weight:600}.verdict-did-not-hold-here{color:#a11;font-weight:600}
.verdict-not-applicable{color:#777}.verdict-inconclusive{color:#8a5a00;font-weight:600}
.env{font-size:12.5px;columns:2}.env div{break-inside:avoid}
input#filter{width:100%;max-width:420px;padding:4px 8px;margin:.4em 0 .8em}
.figs{display:flex;flex-wrap:wrap;gap:1em}figure{margin:0;flex:1 1 560px;max-width:100%}
figure.wide{flex-basis:100%}figure.half{flex:0 1 620px}
figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:12px;color:#555}
.rec{background:#f3faf3;border:1px solid #cde5cd;padding:.6em 1em}code{font-size:12px;overflow-wrap:anywhere}
"""

SCRIPT = """
(function(){
  const table=document.getElementById('leaderboard');
  const body=table.tBodies[0];
  table.querySelectorAll('th').forEach(function(th,col){
    th.addEventListener('click',function(){
      const asc=!th.classList.contains('sorted-asc');
      table.querySelectorAll('th').forEach(function(h){h.classList.remove('sorted-asc','sorted-desc');});
      th.classList.add(asc?'sorted-asc':'sorted-desc');
      const rows=Array.from(body.rows);
      rows.sort(function(a,b){
        const x=a.cells[col].dataset.v, y=b.cells[col].dataset.v;
        if(x===''&&y==='')return 0; if(x==='')return 1; if(y==='')return -1;
        const nx=parseFloat(x), ny=parseFloat(y);
        const c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);
        return asc?c:-c;
      });
      rows.forEach(function(r){body.appendChild(r);});
    });
  });
  document.getElementById('filter').addEventListener('input',function(e){
    const q=e.target.value.toLowerCase();
    Array.from(body.rows).forEach(function(r){r.style.display=r.textContent.toLowerCase().includes(q)?'':'none';});
  });
})();
"""


def _esc(value) -> str:
    return html.escape(display.plain(value, lines=True), quote=True)


# Class names come from this allow-list only, never from a result's text (results are untrusted input).
ROW_CLASSES = {"baseline", "broken", "lossless", "lossy"}
CLAIM_CLASSES = {"held": "verdict-held", "did not hold here": "verdict-did-not-hold-here",
                 "inconclusive": "verdict-inconclusive", "not applicable": "verdict-not-applicable"}


def _cell_class(key: str, numeric: bool) -> str:
    return {"run_id": "run", "lead_value": "lead", "lead_vs": "vs", "verdict_evidence": "vs", "bleu_drift": "wrap"}.get(
        key, "" if numeric else "text")


def leaderboard_table(rows: list[dict]) -> str:
    """The table; a row's verdict evidence is the verdict cell's hover title (a column of it would make
    every row many lines tall)."""
    cols = [c for c in display.columns() if c.key != "verdict_evidence"]
    head = "".join(f"<th class=\"{'' if c.numeric and c.key != 'lead_value' else 'text'}\">{_esc(c.header)}</th>"
                   for c in cols)
    lines = []
    for row in rows:
        verdict = display.verdict(row)
        classes = [verdict] if verdict in ROW_CLASSES else []
        if row.get("recommended"):
            classes.append("recommended")
        cells = []
        for c in cols:
            title = ""
            if c.key == "run_id":
                title = f" title=\"{_esc(c.render(row))}\""
            elif c.key == "verdict" and row.get("verdict_evidence"):
                title = f" title=\"{_esc(row['verdict_evidence'])}\""
            cells.append(f"<td class=\"{_cell_class(c.key, c.numeric)}\"{title} data-v=\"{_esc(display.sort_value(row, c))}\">"
                         f"{_esc(c.render(row))}</td>")
        lines.append(f"<tr class=\"{' '.join(classes)}\">{''.join(cells)}</tr>")
    return (f"<div class=\"tablewrap\"><table id=\"leaderboard\"><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(lines)}</tbody></table></div>")


def _interval(c: ClaimRow) -> str:
    ci = c.interval
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                              for v in ci):
        return " " + _esc(f"[{ci[0]:.3g}, {ci[1]:.3g}]")
    return ""


def claims_table(claims: list[ClaimRow]) -> str:
    if not claims:
        return "<p>No claim checks in these results.</p>"
    rows = "".join(
        f"<tr><td class=\"text\">{_esc(c.claim)}</td><td class=\"text\">{_esc(c.measured)}{_interval(c)}</td>"
        f"<td class=\"text {CLAIM_CLASSES.get(str(c.verdict), 'verdict-other')}\">{_esc(c.verdict)}"
        f"{' (' + _esc(c.why) + ')' if c.why and c.verdict != 'held' else ''}</td>"
        f"<td class=\"text\">{_esc(c.technique)}</td></tr>" for c in claims)
    return ("<table id=\"claims\"><thead><tr><th class=\"text\">claim</th><th class=\"text\">measured here</th>"
            f"<th class=\"text\">verdict</th><th class=\"text\">technique</th></tr></thead><tbody>{rows}</tbody></table>")


def recommendation_block(rec: Recommendation, budget_text: str, rows: list[dict]) -> str:
    if rec.doc is None:
        why = "; ".join(rec.reasons[-3:]) or "no candidate results"
        return f"<div class=\"rec\"><p>No configuration to recommend within {_esc(budget_text)}: {_esc(why)}.</p></div>"
    m = rec.doc.get("metrics") or {}
    saved = f"<p>Saved model: <code>{_esc(rec.saved_model)}</code></p>" if rec.saved_model else ""
    ttft = m.get("ttft_ms") if isinstance(m.get("ttft_ms"), dict) else {}
    return (f"<div class=\"rec\"><p><b>{_esc(display.recommendation_line(rec, rows))}</b>, TTFT {_esc(display.ms(ttft.get('p50')))}, "
            f"same output as baseline {_esc(display.pct(m.get('exact_match_vs_baseline')))} "
            f"(within {_esc(budget_text)}).</p><p>{_esc(rec.decision())}.</p>"
            f"<p>Reproduce: <code>{_esc(rec.command)}</code></p>{saved}</div>")


def environment_block(env: dict) -> str:
    keys = ("cpu", "cpu_flags", "torch_cpu_capability", "cores", "threads", "ram_bytes", "accelerator", "os",
            "python", "torch", "transformers", "mem_bandwidth_gb_s")
    items = []
    for key in keys:
        if key in env:
            value = env[key]
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if key == "ram_bytes" and number:
                value = display.mib(value)
            elif key == "cpu_flags" and isinstance(value, list):
                value = " ".join(map(str, value)) or "-"
            elif key == "mem_bandwidth_gb_s" and number:
                value = f"{value:.1f} GB/s (measured)"
            items.append(f"<div><b>{_esc(key)}</b>: {_esc(value)}</div>")
    return f"<div class=\"env\">{''.join(items)}</div>"


def figure(title: str, png: bytes, css: str = "") -> str:
    data = base64.b64encode(png).decode("ascii")
    return (f"<figure class=\"{css}\"><img alt=\"{_esc(title)}\" src=\"data:image/png;base64,{data}\">"
            f"<figcaption>{_esc(title)}</figcaption></figure>")


def svg_figure(title: str, svg: str) -> str:
    """An inline SVG the report drew itself (its hover titles escaped where they were added)."""
    return f"<figure class=\"half\">{svg}<figcaption>{_esc(title)}</figcaption></figure>"


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_PNG_BYTES = 8 * 2**20


def _run_pngs(folder: Path, run_id: str) -> list[Path]:
    """The regular `.png` files directly inside a run's own folder (named by its run id, holding its
    result.json; no symlinks, nothing outside it)."""
    try:
        result = folder / "result.json"
        if folder.is_symlink() or not folder.is_dir() or folder.name != run_id or result.is_symlink() \
                or not result.is_file():
            return []
        real = folder.resolve()
        found = []
        for entry in sorted(os.scandir(real), key=lambda e: e.name):
            if not entry.name.endswith(".png") or entry.is_symlink():
                continue
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and info.st_size <= MAX_PNG_BYTES and Path(entry.path).parent == real:
                found.append(Path(entry.path))
        return found
    except OSError:
        return []


def _read_png(path: Path) -> bytes | None:
    """The file's bytes when it is still a regular PNG file (opened without following a symlink)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return None
        data = handle.read(MAX_PNG_BYTES + 1)
    return data if data.startswith(PNG_MAGIC) and len(data) <= MAX_PNG_BYTES else None


def technique_images(docs: list[ResultDocument]) -> list[tuple[str, bytes]]:
    """PNG files saved in the run folders (per-position curves, acceptance, latency CDFs, heatmaps...),
    each once even when a sweep saved the same plot with every row. A run's folder is its `location`,
    which the results loader sets from where the result.json really is (never a value read from the file)."""
    found, seen = [], set()
    for doc in docs:
        folder = doc.location
        if not folder:
            continue
        for png in _run_pngs(Path(folder), str(doc.get("run_id"))):
            data = _read_png(png)
            if data is None or data in seen:
                continue
            seen.add(data)
            found.append((f"{doc.get('technique')} · {doc.get('label') or ''} · {png.stem}", data))
    return found


def page(rows: list[dict], env: dict, claims: list[ClaimRow], rec: Recommendation, budget_text: str,
         plots: list[tuple[str, str, object]], extra: list[tuple[str, bytes]], sections: str = "") -> str:
    """The whole report. `plots`: (title, "svg" | "png", content) from report.plots.report_plots;
    `sections`: HTML placed before the plots (the per-turn tables of multi-turn results)."""
    figures = "".join(svg_figure(t, c) if kind == "svg" else figure(t, c, "wide" if kind == "png-wide" else "")
                      for t, kind, c in plots)
    extras = "".join(figure(t, d) for t, d in extra) or "<p>No technique plots in these results.</p>"
    data = json.dumps({"rows": len(rows), "claims": len(claims)})
    return (
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>infer-tune report</title><style>{STYLE}</style></head><body>"
        f"<h1>infer-tune report</h1><script type=\"application/json\" id=\"summary\">{data}</script>"
        f"<h2>Recommended configuration</h2>{recommendation_block(rec, budget_text, rows)}"
        f"<h2>Leaderboard ({len(rows)} results)</h2>"
        "<input id=\"filter\" type=\"search\" placeholder=\"filter rows (technique, config, suite...)\">"
        f"{leaderboard_table(rows)}"
        "<p style=\"font-size:12px;color:#555\">Key figures: what each technique is judged on, against what the "
        "next column names (decode speedup = baseline TPOT p50 / this TPOT p50 in the same session, with its 95% "
        "interval when measured; batching against static batching at the same rate; expert placement against "
        "round-robin). ★ marks the recommended configuration. "
        "Drift is judged on perplexity change and on outputs identical to the baseline's; BLEU drift shows "
        "its 95% paired bootstrap interval over prompts (wide when there are few). Rows marked broken are "
        "never called a speedup. Click a column to sort.</p>"
        f"<h2>Claims</h2>{claims_table(claims)}{sections}"
        f"<h2>Plots</h2><div class=\"figs\">{figures}</div>"
        f"<h2>Technique plots</h2><div class=\"figs\">{extras}</div>"
        f"<h2>Environment</h2>{environment_block(env)}"
        f"<script>{SCRIPT}</script></body></html>\n")
