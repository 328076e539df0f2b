"""Is `make demo`'s answer repeatable? N fresh clones, each running `make demo`, compared.

Targets (issue "one sweep engine"): the same recommended configuration N/N; every candidate's speedup
interval half-width <= 3%; no row flagged noisy on an idle host; wall time <= 15 minutes a run.
A benchmark of the toolkit, not a test: each run builds its own virtualenv (torch from the local
wheel) and takes minutes. Run it on an otherwise idle machine.

    python bench/demo_repeat.py --runs 3 --repo . --work /tmp/demo-repeat
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

OBJECTIVE_KEYS = {"decode": "speedup_vs_baseline", "ttft": "ttft_speedup_vs_baseline",
                  "throughput": "throughput_ratio_vs_baseline"}


def one_run(repo: Path, folder: Path, index: int) -> dict:
    """Clone, `make demo`, read back every row's interval, rounds and noise flag."""
    clone = folder / f"clone-{index}"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    started = time.monotonic()
    log = folder / f"demo-{index}.log"
    with log.open("w") as out:
        proc = subprocess.run(["make", "demo"], cwd=clone, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - started
    docs = [json.loads(p.read_text()) for p in sorted((clone / "runs" / "demo").glob("*/result.json"))]
    rec = _recommendation(clone)
    rows = []
    for doc in docs:
        m = doc["metrics"]
        rounds = m.get("rounds") or {}
        key = OBJECTIVE_KEYS.get(doc.get("objective") or "decode", "speedup_vs_baseline")  # what the row is ranked on
        rows.append({"label": f"{doc['technique']} {doc.get('label', '')}", "speedup": m.get(key), "figure": key,
                     "ci95": m.get(f"{key}_ci95"), "half_width_pct": rounds.get("achieved_half_width_pct"),
                     "rounds": rounds.get("rounds"), "noisy": (m.get("noise") or {}).get("noisy"),
                     "why": (m.get("noise") or {}).get("why"), "major_faults": rounds.get("major_faults_by_round"),
                     "other_cpu": rounds.get("other_cpu_by_round"),
                     "technique": doc["technique"]})
    return {"run": index, "exit": proc.returncode, "wall_s": wall, "recommended": rec, "rows": rows, "log": str(log)}


def _recommendation(clone: Path) -> str | None:
    """The recommended row's label, read from the report's markdown (what a reader sees)."""
    md = clone / "runs" / "demo" / "leaderboard.md"
    if not md.is_file():
        return None
    text = md.read_text()
    part = text.split("## Recommended configuration", 1)[-1].strip().splitlines()
    return part[0].split(":")[0].replace("[noisy]", "").strip("* ") if part else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--repo", type=Path, default=Path("."))
    p.add_argument("--work", type=Path, default=Path("/tmp/demo-repeat"))
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    runs = [one_run(args.repo.resolve(), args.work, i) for i in range(args.runs)]
    for run in runs:
        print(f"run {run['run']}: exit {run['exit']}, {run['wall_s']:.0f} s, recommended: {run['recommended']}")
        for row in run["rows"]:
            if row["technique"] == "baseline" or row["speedup"] is None:
                continue
            ci = row["ci95"]
            shown = f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "(measured once)"
            hw = f"±{row['half_width_pct']:.1f}%" if row["half_width_pct"] is not None else "-"
            print(f"  {row['label']:<40} {row['figure']:<30} {row['speedup']:.2f}x {shown} {hw} rounds={row['rounds']} "
                  f"noisy={row['noisy']}" + (f" ({'; '.join(row['why'])})" if row.get("why") else ""))
    recs = {r["recommended"] for r in runs}
    rounded = [r for run in runs for r in run["rows"] if r["half_width_pct"] is not None]
    print(f"same recommendation: {len(recs) == 1} ({sorted(map(str, recs))})")
    print(f"widest half-width of a row measured in rounds: {max(r['half_width_pct'] for r in rounded):.2f}%"
          if rounded else "no row measured in rounds")
    print(f"rows flagged noisy: {sum(1 for run in runs for r in run['rows'] if r['noisy'])}")
    walls = ", ".join(f"{run['wall_s']:.0f} s" for run in runs)
    print(f"wall time: {walls}")
    (args.work / "summary.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
