"""The equal-bytes comparison's runs: record each `bench/scaling.py --group-size 64` run in docs/results-runs.jsonl,
and print the table of all recorded runs (median, min-max, n per cell, never the best run) with the logit
agreement of both sides (`bench/logit_agreement.py`) beside it.

    python bench/equal_bytes.py record /tmp/eq/scale-llama-3.2-1b-r1.json [...]   # one line per metric and run
    python bench/equal_bytes.py table --agreement /tmp/eq/agree-llama-3.2-1b.json [...]

Claims: `equal-bytes-{decode,ttft49,ttft526}-{model}`, each run's ratio ours / llama-server at its best for the
metric (every served format timed in the same rounds) and, in the same line, the ratio against Q4_0 (4.5 bits a
weight, the same as ours at group 64) and against Q4_0 with llama-quantize's own head type (`q4_0-default`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import results_log  # noqa: E402

METRICS = {"decode": "decode", "ttft_short": "ttft49", "ttft_long": "ttft526"}
SHORT = {"llama-3.2-1b": "1b", "llama-3.2-3b": "3b", "smollm2-135m": "135m"}


def claim_of(metric: str, model: str) -> str:
    return f"equal-bytes-{METRICS[metric]}-{SHORT.get(model, model)}"


def record(path: Path, log: Path, utc: str | None, commit: str | None) -> list[dict]:
    rows = json.loads(path.read_text())
    made = []
    for row in rows if isinstance(rows, list) else [rows]:
        ref = row["llama_cpp"]
        for metric, judged in row["ratios"].items():
            if "ci95" not in judged:
                continue
            by = judged.get("by_format") or {}
            line = {"claim": claim_of(metric, row["model"]), "metrics": {"ratio": judged["point"]},
                    "ci95": {"ratio": judged["ci95"]},
                    "ours": {metric: row["ours"][metric], "group_size": row["group_size"],
                             "step_bytes": row["read_fraction"]["step_bytes"]},
                    "theirs": {metric: ref["served"][metric], "best_format": judged["against"],
                               **{f"{fmt}_bytes": t["bytes"] for fmt, t in ref["formats"].items()}},
                    "command": f"bench/scaling.py --models {row['model']} --group-size {row['group_size']} "
                               f"--formats {','.join(ref['formats'])} --rounds {row['rounds']} --decode-rounds "
                               f"{row['decode_rounds']}",
                    "note": f"verdict {judged['verdict']}; roofline_fraction {row.get('roofline_fraction')}"}
            for fmt in ("q4_0", "q4_0-default"):
                if fmt in by:
                    line["metrics"][f"ratio_vs_{fmt}"] = by[fmt]["point"]
                    line["ci95"][f"ratio_vs_{fmt}"] = by[fmt]["ci95"]
            full = {"claim": line.pop("claim"), "commit": commit or results_log.this_commit(),
                    "host": results_log.this_host(), "utc": utc, **line}
            results_log.append(log, full)
            made.append(full)
    return made


def cell(runs: list[dict], name: str) -> str:
    values = [r["metrics"][name] for r in runs if name in r.get("metrics", {})]
    if not values:
        return "-"
    if len(values) == 1:
        low, high = runs[0]["ci95"].get(name, [None, None])
        return f"{values[0]:.2f}x [{low:.2f}, {high:.2f}] (n=1)" if low else f"{values[0]:.2f}x (n=1)"
    return f"{statistics.median(values):.2f}x ({min(values):.2f}–{max(values):.2f}, n={len(values)})"


def table(log: Path, agreements: list[Path]) -> str:
    runs = results_log.read_runs(log)
    agree = {}
    for path in agreements:
        doc = json.loads(path.read_text())
        agree[doc["model"]] = doc
    out = ["| model | metric | vs llama-server's best (format) | vs Q4_0, Q8_0 head (4.5 bits) | vs Q4_0, its own head |",
           "|---|---|---|---|---|"]
    for model in SHORT:
        for metric, label in METRICS.items():
            mine = [r for r in runs if r["claim"] == claim_of(metric, model)]
            if not mine:
                continue
            best = sorted({r["theirs"].get("best_format", "?") for r in mine})
            out.append(f"| {model} | {label} | {cell(mine, 'ratio')} ({', '.join(b.upper() for b in best)}) | "
                       f"{cell(mine, 'ratio_vs_q4_0')} | {cell(mine, 'ratio_vs_q4_0-default')} |")
    if agree:
        out += ["", "| model | side | bits a weight (ours) / GGUF file | KL(16-bit ‖ quantized) | same top-1 | perplexity ratio |",
                "|---|---|---|---|---|---|"]
        for model, doc in agree.items():
            for key, r in doc["ours"].items():
                out.append(f"| {model} | ours int4 {key} a8 | {r.get('bits_a_weight', 0):.2f} | {r['kld']:.4f} | "
                           f"{r['same_top1']:.4f} | {r['ppl'] / r['ppl_base']:.4f} |")
            for fmt, r in doc["llama_cpp"].items():
                out.append(f"| {model} | llama.cpp {fmt.upper()} | {r['bytes'] / 2**20:.1f} MiB | {r['kld']:.4f} | "
                           f"{r.get('same_top1', float('nan')):.4f} | {r['ppl'] / r['ppl_base']:.4f} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("runs", nargs="+", type=Path)
    rec.add_argument("--utc", default=None, help="when the run was measured (default: the file's modification time)")
    rec.add_argument("--commit", default=None)
    tab = sub.add_parser("table")
    tab.add_argument("--agreement", nargs="*", type=Path, default=[])
    for sp in (rec, tab):
        sp.add_argument("--log", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "results-runs.jsonl")
    args = p.parse_args()
    if args.command == "record":
        import time

        for path in args.runs:
            utc = args.utc or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(path.stat().st_mtime))
            for line in record(path, args.log, utc, args.commit):
                print(f"{line['claim']}: {line['metrics']}")
    else:
        print(table(args.log, args.agreement))


if __name__ == "__main__":
    main()
