"""The self-contained HTML report: environment, the leaderboard (sortable and filterable in the page,
no server), the claims table, the recommendation, the shared plots and each technique's own plots
(PNG files its results saved, embedded). Opens offline; no external script, style or font."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from infer_tune.report import display
from infer_tune.report.claims import ClaimRow
from infer_tune.report.recommend import Recommendation

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1400px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;width:100%;font-size:12.5px;table-layout:auto}
th,td{border-bottom:1px solid #ddd;padding:4px 6px;text-align:right;white-space:nowrap}
td.text,td.run{white-space:normal;overflow-wrap:break-word}th{white-space:normal}
th{background:#f4f4f4;cursor:pointer;user-select:none;position:sticky;top:0}
th.sorted-asc::after{content:" \\25B2"}th.sorted-desc::after{content:" \\25BC"}
td.text,th.text{text-align:left}td.run{font-size:10.5px;color:#777}
tr.broken td{background:#fde8e8}tr.baseline td{background:#eef4fb}
.verdict-held{color:#176b2c;font-weight:600}.verdict-did-not-hold-here{color:#a11;font-weight:600}
.verdict-not-applicable{color:#777}
.env{font-size:12.5px;columns:2}.env div{break-inside:avoid}
input#filter{width:100%;max-width:420px;padding:4px 8px;margin:.4em 0 .8em}
.figs{display:flex;flex-wrap:wrap;gap:1em}figure{margin:0;flex:1 1 560px;max-width:100%}
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
    return html.escape(str(value), quote=True)


def leaderboard_table(rows: list[dict]) -> str:
    cols = display.columns()
    head = "".join(f"<th class=\"{'' if c.numeric else 'text'}\">{_esc(c.header)}</th>" for c in cols)
    lines = []
    for row in rows:
        verdict = display.verdict(row)
        cells = []
        for c in cols:
            cls = "run" if c.key == "run_id" else ("" if c.numeric else "text")
            cells.append(f"<td class=\"{cls}\" data-v=\"{_esc(display.sort_value(row, c))}\">{_esc(c.render(row))}</td>")
        lines.append(f"<tr class=\"{_esc(verdict)}\">{''.join(cells)}</tr>")
    return (f"<table id=\"leaderboard\"><thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table>")


def claims_table(claims: list[ClaimRow]) -> str:
    if not claims:
        return "<p>No claim checks in these results.</p>"
    rows = "".join(
        f"<tr><td class=\"text\">{_esc(c.claim)}</td><td class=\"text\">{_esc(c.measured)}"
        f"{' ' + _esc(f'[{c.interval[0]:.3g}, {c.interval[1]:.3g}]') if c.interval else ''}</td>"
        f"<td class=\"text verdict-{c.verdict.replace(' ', '-')}\">{_esc(c.verdict)}"
        f"{' (' + _esc(c.why) + ')' if c.why and c.verdict != 'held' else ''}</td>"
        f"<td class=\"text\">{_esc(c.technique)}</td></tr>" for c in claims)
    return ("<table id=\"claims\"><thead><tr><th class=\"text\">claim</th><th class=\"text\">measured here</th>"
            f"<th class=\"text\">verdict</th><th class=\"text\">technique</th></tr></thead><tbody>{rows}</tbody></table>")


def recommendation_block(rec: Recommendation, budget_text: str) -> str:
    if rec.doc is None:
        why = "; ".join(rec.reasons[-3:]) or "no candidate results"
        return f"<div class=\"rec\"><p>No configuration to recommend within {_esc(budget_text)}: {_esc(why)}.</p></div>"
    m = rec.doc["metrics"]
    saved = f"<p>Saved model: <code>{_esc(rec.saved_model)}</code></p>" if rec.saved_model else ""
    return (f"<div class=\"rec\"><p><b>{_esc(rec.doc['technique'])} {_esc(rec.doc.get('label', ''))}</b>: "
            f"{display.times(m.get('speedup_vs_baseline'))} decode, TTFT {display.ms((m.get('ttft_ms') or {}).get('p50'))}, "
            f"perplexity {display.signed_pct(m.get('ppl_delta_pct'))}, "
            f"same output as baseline {display.pct(m.get('exact_match_vs_baseline'))} "
            f"(within {_esc(budget_text)}).</p><p>{_esc(rec.decision())}.</p>"
            f"<p>Reproduce: <code>{_esc(rec.command)}</code></p>{saved}</div>")


def environment_block(env: dict) -> str:
    keys = ("cpu", "cpu_flags", "torch_cpu_capability", "cores", "threads", "ram_bytes", "accelerator", "os",
            "python", "torch", "transformers", "mem_bandwidth_gb_s")
    items = []
    for key in keys:
        if key in env:
            value = env[key]
            if key == "ram_bytes":
                value = display.mib(value)
            elif key == "cpu_flags":
                value = " ".join(value) if value else "-"
            elif key == "mem_bandwidth_gb_s":
                value = f"{value:.1f} GB/s (measured)"
            items.append(f"<div><b>{_esc(key)}</b>: {_esc(value)}</div>")
    return f"<div class=\"env\">{''.join(items)}</div>"


def figure(title: str, png: bytes) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (f"<figure><img alt=\"{_esc(title)}\" src=\"data:image/png;base64,{data}\">"
            f"<figcaption>{_esc(title)}</figcaption></figure>")


def technique_images(docs: list[dict]) -> list[tuple[str, bytes]]:
    """PNG files saved in the run folders (per-position curves, acceptance, latency CDFs, heatmaps...),
    each once even when a sweep saved the same plot with every row."""
    found, seen = [], set()
    for doc in docs:
        folder = doc.get("_path")
        if not folder or not Path(folder).is_dir():
            continue
        for png in sorted(Path(folder).glob("*.png")):
            data = png.read_bytes()
            if data in seen:
                continue
            seen.add(data)
            found.append((f"{doc.get('technique')} · {doc.get('label') or ''} · {png.stem}", data))
    return found


def page(rows: list[dict], env: dict, claims: list[ClaimRow], rec: Recommendation, budget_text: str,
         plots: dict[str, bytes], extra: list[tuple[str, bytes]]) -> str:
    figures = "".join(figure(t, d) for t, d in plots.items())
    extras = "".join(figure(t, d) for t, d in extra) or "<p>No technique plots in these results.</p>"
    data = json.dumps({"rows": len(rows), "claims": len(claims)})
    return (
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>infer-tune report</title><style>{STYLE}</style></head><body>"
        f"<h1>infer-tune report</h1><script type=\"application/json\" id=\"summary\">{data}</script>"
        f"<h2>Recommended configuration</h2>{recommendation_block(rec, budget_text)}"
        f"<h2>Leaderboard ({len(rows)} results)</h2>"
        "<input id=\"filter\" type=\"search\" placeholder=\"filter rows (technique, config, suite...)\">"
        f"{leaderboard_table(rows)}"
        "<p style=\"font-size:12px;color:#555\">Speedup: baseline TPOT p50 / this TPOT p50 in the same run. "
        "Drift is judged on perplexity change and on outputs identical to the baseline's; BLEU drift shows "
        "its 95% paired bootstrap interval over prompts (wide when there are few). Rows marked broken are "
        "never called a speedup. Click a column to sort.</p>"
        f"<h2>Claims</h2>{claims_table(claims)}"
        f"<h2>Plots</h2><div class=\"figs\">{figures}</div>"
        f"<h2>Technique plots</h2><div class=\"figs\">{extras}</div>"
        f"<h2>Environment</h2>{environment_block(env)}"
        f"<script>{SCRIPT}</script></body></html>\n")
