"""`experts validate` under torchrun, two "nodes" on this machine (docs/scale.md).

Profiles moe-demo (`infer-tune experts build-demo` builds it), plans it for 2 devices on 2 nodes, then
starts two torchrun invocations (--nnodes 2 --nproc-per-node 1, c10d rendezvous on 127.0.0.1), which
validate the plan; rank 0 writes the results. Checks: outputs identical to single-process execution,
measured bytes (all of them, and per link kind) within 10% of the plan's prediction, the launcher's
node of each rank equal to the plan's, only one process printing a result.

    flock /tmp/infer-tune-cpu.lock python bench/scale_torchrun.py --limit 2 --max-new-tokens 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infer_tune.runners.multiprocess import free_port


def cli(*args: str, timeout: float) -> str:
    done = subprocess.run([sys.executable, "-m", "infer_tune", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise SystemExit(f"infer-tune {' '.join(args)} failed: {done.stderr.strip()[-800:]}")
    return done.stdout


def torchrun_pair(plan: Path, out: Path, limit: int, tokens: int, strategies: str, timeout: float) -> list[str]:
    """Two torchrun invocations (one per "node"); their stdouts."""
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
               "-m", "infer_tune", "experts", "validate", "--plan", str(plan), "--strategy", strategies,
               "--limit", str(limit), "--max-new-tokens", str(tokens), "--out", str(out), "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([*command[:7], "--node-rank", str(n), *command[7:]], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for n in (0, 1)]
    outs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            if proc.returncode:
                raise SystemExit(f"a torchrun invocation failed (exit {proc.returncode}): {stderr.strip()[-800:]}")
            outs.append(stdout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--strategy", default="round-robin,locality")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="infer-tune-torchrun-") as tmp:
        tmp = Path(tmp)
        cli("experts", "profile", "--model", "moe-demo", "--limit", str(args.limit), "--save", str(tmp / "load.json"),
            "--out", str(tmp / "runs"), timeout=args.timeout)
        cli("experts", "plan", "--load", str(tmp / "load.json"), "--devices", "2", "--nodes", "2", "--strategy",
            args.strategy, "--save", str(tmp / "plans.json"), "--out", str(tmp / "plans"), timeout=args.timeout)
        start = time.perf_counter()
        outs = torchrun_pair(tmp / "plans.json", tmp / "runs", args.limit, args.max_new_tokens, args.strategy,
                             args.timeout)
        wall = time.perf_counter() - start
    printed = [o for o in outs if o.strip()]
    if len(printed) != 1:
        raise SystemExit(f"expected one process (rank 0) to print the result, {len(printed)} did")
    docs = json.loads(printed[0])["results"]
    print(f"two torchrun invocations (2 nodes x 1 process, c10d on 127.0.0.1): {wall:.1f} s wall")
    print("| strategy | all-to-all B/tok pred / meas | between nodes B/tok pred / meas | inside a node meas | "
          "nodes from | outputs vs single process |")
    print("|---|---|---|---|---|---|")
    ok = True
    for doc in docs:
        m = doc["metrics"]
        total = m["alltoall_bytes_per_token_vs_predicted_pct"]
        inter = m.get("inter_node_bytes_per_token_vs_predicted_pct")
        same = m["outputs_match_single_process"] and m.get("output_mismatches") == 0
        ok &= same and abs(total) <= 10 and inter is not None and abs(inter) <= 10 and m["node_map_matches_plan"]
        print(f"| {doc['config']['strategy']} | {m['predicted_alltoall_bytes_per_token']:,.0f} / "
              f"{m['alltoall_bytes_per_token']:,.0f} ({total:+.1f}%) | {m['predicted_inter_node_bytes_per_token']:,.0f} / "
              f"{m['inter_node_bytes_per_token']:,.0f} ({inter:+.1f}%) | {m['intra_node_bytes_per_token']:,.0f} | "
              f"{m['link_nodes_from']} {m['node_of_rank']} | {'identical' if same else 'DIFFER'} |")
    print("checks:", "passed" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
