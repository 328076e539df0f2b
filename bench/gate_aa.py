"""A/A and A/B checks of the CI gate (`infer-tune compare --fail-if`), at the commands' default settings.

Three scenarios, each `--runs` times (default 20), interleaved run by run; every compare is between
two separate `bench` processes (or, for `slow5`, one recipe's rounds):

- `aa`: two baselines of the same config (2 threads), back to back: run i compares baselines i and
  i+1, so 21 baselines give 20 pairs. The gate should say "pass" for each pair; target: at most 1 of
  20 not "pass" (a regression or inconclusive outcome is a false alarm in CI). Two processes differ by
  more than either's samples show, so `compare` adds the host's run-to-run spread between them
  (docs/compare.md, "Run-to-run spread"); with `--calibrate K` (default 6) the script first runs K more
  baselines and calibrates that spread with `compare --calibrate` (stored for this machine in
  $INFER_TUNE_HOME), never from the pairs it then judges.
- `threads`: baseline i (2 threads) against its own bench at 1 thread (`--allow-mismatch`): a real
  slowdown; target: caught (outcome "regression") in at least 19 of 20.
- `slow5`: a baseline and a bench-only technique that busy-waits a fixed time per forward call,
  sized to 5% of the first baseline's TPOT p50. The technique is registered
  inside this script's child processes (`child` mode below) and never ships in infer_tune/. Target:
  caught in at least 19 of 20. Baseline and busy-wait are measured in one process's interleaved rounds,
  so no run-to-run spread is added and a tighter threshold (`--slow5-fail-if`, +2.5%) than the
  cross-process A/A gate's (`--fail-if`, +12%) applies: that difference is the point of measuring a
  candidate beside its base.

Prints one JSON line per run (exit code, outcome, estimate, interval, detectable change, seconds) and
a summary per scenario. A benchmark of the toolkit, not a test: runs + 1 baselines, runs 1-thread
benches and runs two-config recipes (about 1.5, 2.5 and 3 minutes each on an idle 2-core host); run
it on a quiet machine, under the repository's CPU lock. Ctrl-C prints the summary of what finished.

    python bench/gate_aa.py --runs 20 --scenarios aa,threads,slow5
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

BENCH_TECHNIQUE = "bench-busy-wait"
CALIBRATED_GATE: dict[str, float] = {}  # metric -> the calibration's smallest gate for separate runs (%)
RESUME = False  # --resume: reuse the finished benches of a --keep folder (a set continued in a later session)
EXTRA: list[str] = []  # --bench-args: settings other than the defaults (a quick smoke run), recorded in the output


# --------------------------------------------------------------------------- child: the bench-only technique
def register_busy_wait() -> None:
    """Register a technique that adds a fixed busy-wait to every forward call (bench-only): one per
    decode step (and one per prefill)."""
    from infer_tune.nn_utils import shallow_clone
    from infer_tune.runners.prepared import PreparedModel
    from infer_tune.tuners import TechniqueConfig, register_technique

    @dataclass
    class BusyWaitConfig(TechniqueConfig):
        technique: ClassVar[str] = BENCH_TECHNIQUE
        wait_us: int = 0

        def label(self) -> str:
            return f"busy-wait-{self.wait_us}us"

    @register_technique(BusyWaitConfig, measure_ppl=False)
    def prepare(loaded, config: BusyWaitConfig, ctx) -> PreparedModel:
        wait_ns = config.wait_us * 1000

        def spin(_module, _args):
            end = time.perf_counter_ns() + wait_ns
            while time.perf_counter_ns() < end:
                pass

        # a clone over the same weights: the baseline, measured in the same rounds, stays untouched
        model = shallow_clone(loaded.model)
        model.register_forward_pre_hook(spin)
        return PreparedModel(model=model, tokenizer=loaded.tokenizer, label=config.label(),
                             metrics={"busy_wait_us": config.wait_us})


def child(argv: list[str]) -> int:
    """`gate_aa.py child ARGS...`: run `infer-tune ARGS...` with the bench-only technique registered."""
    from infer_tune.tuners.base import load_techniques

    load_techniques()
    register_busy_wait()
    from infer_tune.cli import app

    app(args=argv, prog_name="infer-tune")
    return 0


# --------------------------------------------------------------------------- parent
def infer_tune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, __file__, "child", *args], capture_output=True, text=True)


def bench(out: Path, model: str, *extra: str, results: int = 1) -> list[Path]:
    """One `infer-tune bench` at default settings into `out`; returns its run folders (baseline first).
    With --resume, a folder already holding the `results` rows of a finished bench is reused as it is."""
    folders = [p.parent for p in out.glob("*/result.json")]
    if not (RESUME and len(folders) >= results):
        proc = infer_tune("bench", "--model", model, "--no-ppl", "--out", str(out), "--json", *EXTRA, *extra)
        if proc.returncode != 0:
            sys.exit(f"bench failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        folders = [p.parent for p in out.glob("*/result.json")]
    return sorted(folders, key=lambda p: json.loads((p / "result.json").read_text())["technique"] != "baseline")


def gate(base: Path, cand: Path, expr: str, *extra: str) -> dict:
    proc = infer_tune("compare", str(base), str(cand), "--fail-if", expr, "--json", *extra)
    if proc.returncode not in (0, 1, 4):
        sys.exit(f"compare failed ({proc.returncode}): {proc.stderr.strip()}")
    doc = json.loads(proc.stdout)
    check = doc["candidates"][0]["checks"][0]
    return {"exit_code": proc.returncode, "outcome": doc.get("outcome"), "observed_pct": round(check["observed"], 2),
            "run_to_run_pct": check.get("run_to_run_pct"),
            "ci95_pct": [round(v, 2) for v in check["interval"]] if check["interval"] else None,
            "detectable_pct": None if check.get("mde") is None else round(check["mde"], 2)}


def judged_at(row: dict, threshold_pct: float) -> str:
    """What `compare --fail-if "X > +T%"` says of a check already run at another threshold: its interval
    does not depend on the threshold, so compare's own outcome rule (report/gate.py) on it."""
    from infer_tune.report.gate import outcome

    return outcome(">", threshold_pct, row["observed_pct"], row["ci95_pct"])


def tpot_p50(folder: Path) -> float:
    return json.loads((folder / "result.json").read_text())["metrics"]["tpot_ms"]["p50"]


def slow5(i: int, root: Path, args: argparse.Namespace, wait_us: int) -> dict:
    """The baseline and the busy-wait technique of one recipe (measured together in interleaved rounds)."""
    out = root / f"slow5-{i}"
    recipe = out / "busy.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    recipe.write_text(f"description: busy-wait\nconfigs:\n  - {{technique: {BENCH_TECHNIQUE}, wait_us: {wait_us}}}\n")
    folders = bench(out, args.model, "--recipe", str(recipe), results=2)
    return gate(folders[0], folders[-1], args.slow5_fail_if)


def record(rows: list[dict], name: str, i: int, row: dict, started: float) -> None:
    row.update(scenario=name, run=i, seconds=round(time.perf_counter() - started, 1))
    if name != "aa":
        row["caught"] = row["outcome"] == "regression"
    rows.append(row)
    print(json.dumps(row), flush=True)


def run_all(scenarios: list[str], root: Path, args: argparse.Namespace, rows: list[dict]) -> None:
    """Fresh measurements, shared where that is honest: A/A run i compares baselines i and i+1 (so
    `runs` + 1 baselines give `runs` pairs, each of two separate `bench` processes); the threads run i
    compares baseline i (2 threads) with its own 1-thread bench. Scenarios are interleaved run by run,
    so a drift of the host meets all three alike; rows are printed as they come."""
    need_base = "aa" in scenarios or "threads" in scenarios or "slow5" in scenarios
    bases: list[Path] = []

    def baseline(i: int) -> Path:
        while len(bases) <= i:
            bases.append(bench(root / f"base-{len(bases)}", args.model, "--threads", "2")[0])
        return bases[i]

    if args.calibrate and "aa" in scenarios:
        runs = [bench(root / f"calibrate-{k}", args.model, "--threads", "2")[0] for k in range(args.calibrate)]
        proc = infer_tune("compare", *map(str, runs), "--calibrate", "--json")
        if proc.returncode != 0:
            sys.exit(f"compare --calibrate failed ({proc.returncode}): {proc.stderr.strip()}")
        cal = json.loads(proc.stdout)
        CALIBRATED_GATE.update({m["metric"]: m["gate_pct"] for m in cal["metrics"]})
        print(json.dumps({"calibration": {m["metric"]: {k: round(m[k], 3) for k in ("between_pct", "within_pct", "sigma_pct",
                                                                                     "gate_pct")}
                                          for m in cal["metrics"]}, "runs": cal["runs"], "stored": cal["path"]}), flush=True)
    wait_us = 0
    if need_base and "slow5" in scenarios:
        probe = tpot_p50(baseline(0))
        wait_us = round(args.slowdown * probe * 1000)
        print(json.dumps({"probe_tpot_p50_ms": round(probe, 3), "busy_wait_us": wait_us}), flush=True)
    for i in range(args.runs):
        if "aa" in scenarios:
            started = time.perf_counter()
            a, b = baseline(i), baseline(i + 1)
            record(rows, "aa", i, gate(a, b, args.fail_if), started)
        if "threads" in scenarios:
            started = time.perf_counter()
            a = baseline(i)
            one = bench(root / f"threads1-{i}", args.model, "--threads", "1")[0]
            record(rows, "threads", i, gate(a, one, args.threads_fail_if, "--allow-mismatch"), started)
        if "slow5" in scenarios:
            started = time.perf_counter()
            record(rows, "slow5", i, slow5(i, root, args, wait_us), started)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="runs per scenario")
    parser.add_argument("--scenarios", default="aa,threads,slow5", help="comma-separated: aa, threads, slow5")
    parser.add_argument("--fail-if", default="tpot_ms.p50 > +12%",
                        help="gate of the A/A pairs (separate processes): above the calibrated run-to-run "
                             "resolution of the host (about 6%% on the 2-core Xeon this was tuned on)")
    parser.add_argument("--slow5-fail-if", default="tpot_ms.p50 > +2.5%", help="gate of the 5%% runs (one process's rounds)")
    parser.add_argument("--calibrate", type=int, default=6,
                        help="baselines run first to calibrate the run-to-run spread (0: use what is stored / the default)")
    parser.add_argument("--threads-fail-if", default="tpot_ms.p50 > +10%", help="gate of the 1-vs-2-threads runs")
    parser.add_argument("--slowdown", type=float, default=0.05, help="injected slowdown, share of TPOT p50")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs in this folder (default: a temp folder, removed)")
    parser.add_argument("--resume", action="store_true",
                        help="with --keep: reuse every bench that already finished there, run only the missing ones")
    parser.add_argument("--bench-args", default="", help="extra `bench` options, e.g. '--limit 2' (default: none)")
    args = parser.parse_args()
    if args.resume and args.keep is None:
        parser.error("--resume continues a --keep folder")
    global RESUME
    RESUME = args.resume
    EXTRA[:] = shlex.split(args.bench_args)
    print(json.dumps({"bench_args": EXTRA, "fail_if": args.fail_if, "slow5_fail_if": args.slow5_fail_if,
                      "threads_fail_if": args.threads_fail_if}), flush=True)

    root = args.keep or Path(tempfile.mkdtemp(prefix="infer-tune-gate-aa-"))
    scenarios = [s for s in args.scenarios.split(",") if s]
    rows: list[dict] = []
    try:
        run_all(scenarios, root, args, rows)
    except KeyboardInterrupt:
        print(json.dumps({"interrupted_after_rows": len(rows)}), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    ok = True
    for name in scenarios:
        mine = [r for r in rows if r["scenario"] == name]
        outcomes = {o: sum(r["outcome"] == o for r in mine) for o in ("pass", "inconclusive", "regression")}
        allowed = len(mine) // 20  # 1 of 20 may miss
        target = (outcomes["inconclusive"] + outcomes["regression"] <= allowed) if name == "aa" \
            else outcomes["regression"] >= len(mine) - allowed
        ok &= target
        print(json.dumps({"scenario": name, "runs": len(mine), **outcomes, "target_met": target,
                          "median_detectable_pct": sorted(r["detectable_pct"] or 0 for r in mine)[len(mine) // 2]
                          if mine else None}))
        gate_pct = CALIBRATED_GATE.get(args.fail_if.split(".")[0].strip())
        if name == "aa" and gate_pct and mine:  # the same pairs judged at the calibration's smallest gate
            at = [judged_at(r, gate_pct) for r in mine]
            print(json.dumps({"scenario": "aa at the calibrated smallest gate", "gate": f"> +{gate_pct:.1f}%",
                              **{o: at.count(o) for o in ("pass", "inconclusive", "regression")}}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
