"""A/A check of the CI gate: two baselines of the same config must pass `compare --fail-if`.

Runs `infer-tune bench` twice with identical settings, then `infer-tune compare A B --fail-if EXPR`,
and repeats the pair `--pairs` times (default 10). A noise-aware gate should pass every pair; each
failure is a false alarm the gate would raise in CI. This is a benchmark of the toolkit, not a test:
it takes minutes (about 2 x pairs x bench time) and wants a quiet machine.

    python bench/gate_aa.py --pairs 10 --limit 4 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def infer_tune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infer_tune", *args], capture_output=True, text=True)


def bench(out: Path, args: argparse.Namespace) -> Path:
    """One baseline run into its own folder; returns the run folder."""
    proc = infer_tune("bench", "--model", args.model, "--suite", args.suite, "--limit", str(args.limit),
                      "--max-new-tokens", str(args.max_new_tokens), "--min-iterations", str(args.min_iterations),
                      "--min-duration", str(args.min_duration), "--no-ppl", "--out", str(out), "--json",
                      *(["--threads", str(args.threads)] if args.threads else []))
    if proc.returncode != 0:
        sys.exit(f"bench failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return out / json.loads(proc.stdout)["run_id"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=10, help="A/A pairs to run")
    parser.add_argument("--fail-if", default="tpot_ms.p50 > +10%", help="gate expression")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--suite", default="chat")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--min-iterations", type=int, default=2)
    parser.add_argument("--min-duration", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs in this folder")
    args = parser.parse_args()

    root = args.keep or Path(tempfile.mkdtemp(prefix="infer-tune-gate-aa-"))
    passed = 0
    rows = []
    try:
        for i in range(args.pairs):
            started = time.perf_counter()
            a, b = bench(root / f"pair-{i}", args), bench(root / f"pair-{i}", args)
            proc = infer_tune("compare", str(a), str(b), "--fail-if", args.fail_if, "--json")
            if proc.returncode not in (0, 1):
                sys.exit(f"compare failed ({proc.returncode}): {proc.stderr.strip()}")
            check = json.loads(proc.stdout)["candidates"][0]["checks"][0]
            passed += proc.returncode == 0
            low, high = check["interval"] or (check["observed"], check["observed"])
            rows.append({"pair": i, "exit_code": proc.returncode, "observed_pct": round(check["observed"], 2),
                         "ci95_pct": [round(low, 2), round(high, 2)],
                         "seconds": round(time.perf_counter() - started, 1)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"gate": args.fail_if, "pairs": args.pairs, "passed": passed,
                      "false_alarms": args.pairs - passed}))
    return 0 if passed == args.pairs else 1


if __name__ == "__main__":
    sys.exit(main())
