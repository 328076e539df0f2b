#!/usr/bin/env python3
"""The runs behind docs/results.md: one JSON line per comparison run in docs/results-runs.jsonl, and the median,
spread (min-max) and count of a metric over every run recorded for a claim (never the best run).

    python scripts/results_log.py add --claim scaling-decode-4b --metric ratio=1.23 --ci ratio=1.09,1.40 \\
        --ours decode_tok_s=15.0 --theirs decode_tok_s=13.4 --command "bench/scaling.py ..." [--commit C]
        [--host H] [--utc T] [--note TEXT] [--from-json run.json] [--log PATH]
    python scripts/results_log.py summary --claim scaling-decode-4b [--metric ratio] [--json] [--log PATH]
    python scripts/results_log.py claims [--log PATH]

A line: {"claim", "commit", "host", "utc", "metrics": {name: value}, "ci95": {name: [lo, hi]}, "ours": {...},
"theirs": {...}, "command", "note"}. `metrics` holds the figures the page compares (a ratio ours / theirs), `ours`
and `theirs` each side's own figures. Without --commit / --host / --utc the line takes this checkout's revision,
this host's CPU model, cores and ISA flags (infer_tune.env) and the time now. `--from-json FILE` reads the same
fields from a JSON object (options given on the command line win). A line is appended by reading the file,
adding the line and writing the whole to a temp file moved into place (infer_tune.atomic), under an exclusive
lock, so a reader never sees half a line and two writers never lose one. Bad input: one line, exit code 2.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG = ROOT / "docs" / "results-runs.jsonl"
if str(ROOT) not in sys.path:  # infer_tune (atomic writes; env for the host) from this checkout
    sys.path.insert(0, str(ROOT))
FIELDS = ("claim", "commit", "host", "utc", "metrics", "ci95", "ours", "theirs", "command", "note")


class BadInput(Exception):
    """Input the user can fix: printed as one line, exit code 2."""


def _pairs(items: list[str] | None, what: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise BadInput(f"{what} {item!r}: expected NAME=VALUE")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise BadInput(f"{what} {item!r}: {value!r} is not a number") from None
    return out


def _intervals(items: list[str] | None) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        bounds = value.split(",")
        try:
            lo, hi = (float(b) for b in bounds) if sep and len(bounds) == 2 else (None, None)
        except ValueError:
            lo = hi = None
        if lo is None or hi is None or not name.strip() or lo > hi:
            raise BadInput(f"--ci {item!r}: expected NAME=LOW,HIGH with LOW <= HIGH")
        out[name.strip()] = [lo, hi]
    return out


def this_host() -> str:
    from infer_tune import env

    flags = ", ".join(env.cpu_flags()) or "no flags"
    return f"{env.cpu_model()}, {os.cpu_count()} cores ({flags})"


def this_commit() -> str | None:
    from infer_tune import env

    return env.git_revision()


def make_record(args: argparse.Namespace) -> dict:
    base: dict = {}
    if args.from_json:
        try:
            base = json.loads(Path(args.from_json).read_text())
        except (OSError, ValueError) as exc:
            raise BadInput(f"--from-json {args.from_json}: {exc}") from None
        if not isinstance(base, dict):
            raise BadInput(f"--from-json {args.from_json}: not a JSON object")
        unknown = sorted(set(base) - set(FIELDS))
        if unknown:
            raise BadInput(f"--from-json {args.from_json}: unknown fields {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    record = {key: base.get(key) for key in FIELDS}
    for key in ("metrics", "ours", "theirs", "ci95"):
        record[key] = dict(record[key] or {})
    record["metrics"].update(_pairs(args.metric, "--metric"))
    record["ours"].update(_pairs(args.ours, "--ours"))
    record["theirs"].update(_pairs(args.theirs, "--theirs"))
    record["ci95"].update(_intervals(args.ci))
    for key in ("claim", "commit", "host", "utc", "command", "note"):
        value = getattr(args, key)
        if value is not None:
            record[key] = value
    if not record["claim"]:
        raise BadInput("a run needs --claim (the key its section's medians are taken by)")
    if not record["metrics"]:
        raise BadInput("a run needs at least one --metric NAME=VALUE (the figure the claim compares)")
    for name, value in record["metrics"].items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise BadInput(f"metric {name!r}: {value!r} is not a number")
    unknown_ci = sorted(set(record["ci95"]) - set(record["metrics"]))
    if unknown_ci:
        raise BadInput(f"--ci for {', '.join(unknown_ci)}: not a --metric of this run")
    record["commit"] = record["commit"] or this_commit()
    record["host"] = record["host"] or this_host()
    record["utc"] = record["utc"] or datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {key: value for key, value in record.items() if value not in (None, {}, "")}


def read_runs(path: Path) -> list[dict]:
    if not path.exists():
        return []
    runs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            run = json.loads(line)
        except ValueError:
            raise BadInput(f"{path}: line {number} is not JSON") from None
        if not isinstance(run, dict) or not isinstance(run.get("metrics"), dict) or not run.get("claim"):
            raise BadInput(f"{path}: line {number} is not a run (a JSON object with a claim and metrics)")
        runs.append(run)
    return runs


def _lock(path: Path) -> int:
    """An exclusive lock on the file as it is now at `path` (created empty if missing). A writer that waited
    on a file another one has since replaced takes the lock again on the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def append(path: Path, record: dict) -> None:
    """Read the file, add one line, write the whole atomically (temp file + os.replace)."""
    from infer_tune import atomic

    fd = _lock(path)
    try:
        read_runs(path)  # refuse to append to a file that is not a log of runs
        text = path.read_text()
        if text and not text.endswith("\n"):
            text += "\n"
        atomic.write_text(path, text + json.dumps(record, sort_keys=False) + "\n")
    finally:
        os.close(fd)


def value_of(run: dict, metric: str) -> float | None:
    """`metric` from the run's metrics, or `ours.NAME` / `theirs.NAME` from one side's figures."""
    side, sep, name = metric.partition(".")
    if sep and side in ("ours", "theirs"):
        return (run.get(side) or {}).get(name)
    return run["metrics"].get(metric)


def summarize(runs: list[dict], claim: str, metric: str) -> dict:
    """Median, min, max and n of `metric` over every run of `claim` that has it, and the runs in file order."""
    chosen = [(run, value_of(run, metric)) for run in runs if run["claim"] == claim]
    chosen = [(run, value) for run, value in chosen if value is not None]
    if not chosen:
        raise BadInput(f"no run of claim {claim!r} records {metric!r}")
    values = [value for _, value in chosen]
    return {"claim": claim, "metric": metric, "median": statistics.median(values), "min": min(values),
            "max": max(values), "n": len(values),
            "runs": [{"utc": run.get("utc"), "commit": run.get("commit"), "value": value,
                      "ci95": (run.get("ci95") or {}).get(metric), "note": run.get("note")} for run, value in chosen]}


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def print_summary(summary: dict) -> None:
    print(f"{summary['claim']}  {summary['metric']}: median {_fmt(summary['median'])}  min {_fmt(summary['min'])}  "
          f"max {_fmt(summary['max'])}  n={summary['n']}")
    for run in summary["runs"]:
        ci = f" (95% {_fmt(run['ci95'][0])}, {_fmt(run['ci95'][1])})" if run["ci95"] else ""
        note = f"  {run['note']}" if run["note"] else ""
        print(f"  {run['utc']}  {run['commit'] or '?'}  {_fmt(run['value'])}{ci}{note}")


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log", type=Path, default=LOG, help=f"the runs file (default {LOG.relative_to(ROOT)})")
    p = argparse.ArgumentParser(prog="results_log.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add", parents=[common], help="append one comparison run")
    add.add_argument("--claim", help="the claim's key, e.g. scaling-decode-4b")
    add.add_argument("--metric", action="append", metavar="NAME=VALUE", help="a compared figure (repeatable)")
    add.add_argument("--ci", action="append", metavar="NAME=LOW,HIGH", help="the run's own 95%% interval of a metric")
    add.add_argument("--ours", action="append", metavar="NAME=VALUE", help="our side's figure (repeatable)")
    add.add_argument("--theirs", action="append", metavar="NAME=VALUE", help="the other side's figure (repeatable)")
    add.add_argument("--commit", help="default: this checkout's revision")
    add.add_argument("--host", help="default: this host's CPU model, cores and ISA flags")
    add.add_argument("--utc", help="when the run was measured (default: now, UTC)")
    add.add_argument("--command", help="the command that measured it")
    add.add_argument("--note")
    add.add_argument("--from-json", metavar="FILE", help="the run's fields as one JSON object")
    show = sub.add_parser("summary", parents=[common], help="median [min-max] n of a claim's metric over all its runs")
    show.add_argument("--claim", required=True)
    show.add_argument("--metric", help="a metric name, or ours.NAME / theirs.NAME (default: each metric of the claim)")
    show.add_argument("--json", action="store_true")
    sub.add_parser("claims", parents=[common], help="the claims recorded, with their run counts")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.action == "add":
            record = make_record(args)
            append(args.log, record)
            print(f"{args.log}: run of {record['claim']} added ({record['utc']}, {record.get('commit') or '?'})")
            return 0
        runs = read_runs(args.log)
        if args.action == "claims":
            for claim in dict.fromkeys(run["claim"] for run in runs):
                print(f"{claim}  n={sum(run['claim'] == claim for run in runs)}")
            return 0
        of_claim = [run for run in runs if run["claim"] == args.claim]
        if not of_claim:
            raise BadInput(f"no runs of claim {args.claim!r} in {args.log}")
        metrics = [args.metric] if args.metric else list(dict.fromkeys(m for run in of_claim for m in run["metrics"]))
        summaries = [summarize(runs, args.claim, metric) for metric in metrics]
        if args.json:
            print(json.dumps(summaries if len(summaries) > 1 else summaries[0], indent=1))
        else:
            for summary in summaries:
                print_summary(summary)
        return 0
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
