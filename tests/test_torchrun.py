"""`experts validate` under torchrun: two launcher invocations on loopback (one process each) are the ranks;
rank 0 writes the results, the other writes nothing; bytes per link kind beside the plan's prediction.
The same check on moe-demo is bench/scale_torchrun.py (docs/scale.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_experts import tiny_moe_dir  # noqa: F401  (the module-scoped checkpoint fixture)

from infer_tune.runners import launcher

ROOT = Path(__file__).resolve().parents[1]


def test_detect_reads_the_launchers_environment(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "GROUP_RANK",
                "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert launcher.detect() is None
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launcher.detect() is None  # no launcher marker: not torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    found = launcher.detect()
    assert found["rank"] == 3 and found["world_size"] == 4 and found["nnodes"] == 2 and found["group_rank"] == 1
    assert found["run_id"] == "job7"


def test_link_bytes_split_by_the_launchers_nodes():
    from infer_tune.tuners.experts import link_bytes

    ranks = [{"rank": r, "group_rank": r // 2, "payload_bytes_to_rank": row}
             for r, row in enumerate([[0, 10, 100, 0], [20, 0, 0, 200], [300, 0, 0, 30], [0, 400, 40, 0]])]
    m = {"plan_node_of_rank": [0, 0, 1, 1], "predicted_inter_node_bytes_per_token": 100.0}
    link_bytes(m, ranks, tokens=10)
    assert m["link_nodes_from"] == "launcher" and m["node_map_matches_plan"]
    assert m["inter_node_bytes_per_token"] == 100.0 and m["intra_node_bytes_per_token"] == 10.0
    assert m["inter_node_bytes_per_token_vs_predicted_pct"] == 0.0
    for r in ranks:
        r["group_rank"] = None  # spawned ranks on one host: the plan's nodes
    link_bytes(m, ranks, tokens=10)
    assert m["link_nodes_from"] == "plan" and m["inter_node_bytes_per_token"] == 100.0


def _communicate_all(procs, timeout: float) -> list[tuple[str, str]]:
    """Both invocations read at once (one stuck node would otherwise hide the other's output); on a timeout the
    test fails with every node's stderr tail."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(procs)) as pool:
        futures = [pool.submit(p.communicate, timeout=timeout) for p in procs]
        try:
            return [f.result() for f in futures]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            tails = [(f.exception() or f.result()) for f in futures]
            tails = [t.stderr if isinstance(t, subprocess.TimeoutExpired) else t[1] for t in tails]
            tails = [(t.decode(errors="replace") if isinstance(t, bytes) else (t or ""))[-800:] for t in tails]
            pytest.fail(f"a torchrun node did not finish in {timeout} s; stderr tails: {tails}")


def test_two_torchrun_invocations_validate_a_two_node_plan(tiny_moe_dir, prompts_file, tmp_path):  # noqa: F811
    from test_experts import _spec

    from infer_tune.results import find_results
    from infer_tune.runners.multiprocess import free_port
    from infer_tune.scenarios.experts import run_plan, run_profile

    spec = _spec(tiny_moe_dir, prompts_file, tmp_path / "runs")
    profile = run_profile(spec, save=tmp_path / "load.json")
    run_plan(profile.path, devices=2, nodes=2, strategies=["round-robin"], save=tmp_path / "plans.json", out_dir=None)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = tmp_path / "runs"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
         str(n), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
         "-m", "infer_tune", "experts", "validate", "--model", str(tiny_moe_dir), "--suite", str(prompts_file),
         "--plan", str(tmp_path / "plans.json"), "--limit", "4", "--max-new-tokens", "6", "--threads", "1",
         "--out", str(out), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for n in (0, 1)]
    finished = _communicate_all(procs, timeout=150)
    assert [p.returncode for p in procs] == [0, 0], [e[-600:] for _, e in finished]
    printed = [o for o, _ in finished if o.strip()]
    assert len(printed) == 1  # rank 0 alone reports (and writes)
    doc = json.loads(printed[0])["results"][0]
    m = doc["metrics"]
    assert [r["launcher"] for r in m["ranks"]] == ["torchrun", "torchrun"]
    assert m["link_nodes_from"] == "launcher" and m["node_of_rank"] == [0, 1] and m["node_map_matches_plan"]
    assert m["outputs_match_single_process"] and m["output_mismatches"] == 0 and m["top1_agreement"] == 1.0
    # one device per node: every byte crosses nodes, and the prediction says so
    assert m["intra_node_bytes_per_token"] == 0 and m["predicted_intra_node_bytes_per_token"] == 0
    assert m["inter_node_bytes_per_token"] == pytest.approx(m["alltoall_bytes_per_token"])
    assert abs(m["inter_node_bytes_per_token_vs_predicted_pct"]) < 25  # tiny workload; homes differ from uniform
    assert len(find_results(out)) == 2  # the single-process baseline and the validation, once each
