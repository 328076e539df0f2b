"""Kernel choice and decode speedup of `quantize --method int8-dynamic` on an idle host and under a CPU hog.

Runs `infer-tune quantize --model MODEL --method int8-dynamic --no-ppl --json` once idle, then with one
`yes > /dev/null` per logical CPU started by this script (and stopped by it, by process id), and
repeats the pair `--pairs` times. Per run it prints the kernels chosen per kind and regime (with the
screen's rounds and whether the fastest was separated) and the decode speedup vs the baseline.

Targets (issue 20): under the hog the same kernels as idle, and a decode speedup within 10% of the
idle one (the screen takes more rounds; it must never settle on a wrong kernel). A benchmark, not a
test; run it on an otherwise quiet machine.

    python bench/kernel_hog.py --pairs 1
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def quantize(out: Path, model: str, method: str, extra: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "infer_tune", "quantize", "--model", model, "--method", method,
                           "--no-ppl", "--out", str(out), "--json", *extra], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"quantize failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    doc = json.loads(proc.stdout)
    return doc[-1] if isinstance(doc, list) else doc


def summary(doc: dict, seconds: float) -> dict:
    m = doc["metrics"]
    record = m.get("kernels") or {}
    chosen = {}
    for kind, regimes in (record.get("by_kind") or {}).items():
        for regime, choice in regimes.items():
            chosen[f"{kind}/{regime}"] = {"chosen": choice.get("chosen"), "rounds": choice.get("rounds"),
                                          "separated": choice.get("separated"),
                                          "vs_fp32_ci95": choice.get("vs_fp32_ci95")}
    return {"kernels": chosen, "speedup_vs_baseline": m.get("speedup_vs_baseline"),
            "tpot_p50_ms": (m.get("tpot_ms") or {}).get("p50"), "noisy": (m.get("noise") or {}).get("noisy"),
            "seconds": round(seconds, 1)}


def hogs_start() -> list[subprocess.Popen]:
    return [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(os.cpu_count() or 1)]


def hogs_stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="int8-dynamic")
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed relative change of the speedup")
    parser.add_argument("--args", default="", help="extra `quantize` options, e.g. '--limit 2' (default: none)")
    args = parser.parse_args()
    print(json.dumps({"quantize_args": shlex.split(args.args), "method": args.method}), flush=True)

    root = Path(tempfile.mkdtemp(prefix="infer-tune-kernel-hog-"))
    ok = True
    try:
        for i in range(args.pairs):
            runs = {}
            for condition in ("idle", "hog"):
                procs = hogs_start() if condition == "hog" else []
                started = time.perf_counter()
                try:
                    doc = quantize(root / f"{condition}-{i}", args.model, args.method, shlex.split(args.args))
                finally:
                    hogs_stop(procs)
                runs[condition] = summary(doc, time.perf_counter() - started)
                print(json.dumps({"pair": i, "condition": condition, **runs[condition]}), flush=True)
            same = {k: v["chosen"] for k, v in runs["idle"]["kernels"].items()} == \
                {k: v["chosen"] for k, v in runs["hog"]["kernels"].items()}
            idle, hog = runs["idle"]["speedup_vs_baseline"], runs["hog"]["speedup_vs_baseline"]
            within = bool(idle and hog and abs(hog / idle - 1) <= args.tolerance)
            ok &= same and within
            print(json.dumps({"pair": i, "same_kernels": same, "speedup_idle": idle, "speedup_hog": hog,
                              "speedup_ratio_hog_vs_idle": round(hog / idle, 3) if idle and hog else None,
                              "target_met": same and within}), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
