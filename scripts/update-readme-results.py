#!/usr/bin/env python3
"""Regenerate the measured results from a finished `make demo`: the full tables in docs/results.md and
the one-screen summary the demo ends with in README.md.

    .venv/bin/python scripts/update-readme-results.py [runs/demo]

Replaces what lies between `<!-- results:begin -->` and `<!-- results:end -->` in docs/results.md with
the machine the run measured on and the report's markdown (table, claims, recommendation), and what lies
between `<!-- summary:begin -->` and `<!-- summary:end -->` in README.md with the terminal summary
(infer_tune/report/summary.py) of the same results: the numbers are copied from the results, never typed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
SUMMARY_BEGIN, SUMMARY_END = "<!-- summary:begin -->", "<!-- summary:end -->"


def machine_line(runs: Path) -> str:
    docs = [json.loads(p.read_text()) for p in sorted(runs.glob("*/result.json"))]
    env = next((d.get("env") for d in docs), {}) or {}
    dates = sorted(str(d.get("created_at") or "")[:16].replace("T", " ") for d in docs if d.get("created_at"))
    import subprocess  # the checkout the runs folder lies in: the code that ran (make demo writes runs/demo there)

    found = subprocess.run(["git", "-C", str(runs), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    commit = found.stdout.strip() if found.returncode == 0 else None
    when = f"{dates[0]}-{dates[-1][11:]} UTC" if dates else "?"
    return (f"Measured by `make demo` {when}{f' at {commit[:7]}' if commit else ''} on: {env.get('cpu', '?')} ({', '.join(env.get('cpu_flags') or []) or 'no flags'}), "
            f"{env.get('cores', '?')} cores, {env.get('threads', '?')} threads, "
            f"{(env.get('ram_bytes') or 0) / 2**30:.0f} GiB RAM, memory bandwidth "
            f"{env.get('mem_bandwidth_gb_s', 0):.1f} GB/s (measured), torch {env.get('torch', '?')}, "
            f"transformers {env.get('transformers', '?')}, accelerator {env.get('accelerator') or 'none'}.")


def replace_block(path: Path, begin: str, end: str, body: str) -> None:
    text = path.read_text()
    if begin not in text or end not in text:
        sys.exit(f"error: {path.relative_to(ROOT)} lacks the {begin} / {end} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{body.strip()}\n{end}{tail}")


def main() -> None:
    runs = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/demo")
    board = runs / "leaderboard.md"
    if not board.is_file():
        sys.exit(f"error: {board} not found; run `make demo` first")
    sys.path.insert(0, str(ROOT))
    from infer_tune import results
    from infer_tune.report import summary

    machine = machine_line(runs)
    body = board.read_text().replace("# infer-tune leaderboard", "### Leaderboard", 1)
    body = body.replace("\n## Claims", "\n### Claims").replace("\n## Recommended configuration", "\n### Recommended configuration")
    replace_block(ROOT / "docs" / "results.md", BEGIN, END, f"{machine}\n\n{body}")
    lines = summary.lines(results.find_results(runs), runs, write=False)
    shown = f"runs/{runs.resolve().name}"  # the paths `make demo` prints in a clone, wherever the run was made
    lines = [line.replace(str(runs), shown) for line in lines]
    replace_block(ROOT / "README.md", SUMMARY_BEGIN, SUMMARY_END, "```text\n" + "\n".join(lines) + "\n```\n\n" + machine)
    print(f"docs/results.md and the README summary regenerated from {runs}")


if __name__ == "__main__":
    main()
