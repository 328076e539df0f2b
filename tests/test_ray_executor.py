"""`--executor ray`: a Ray head plus one more Ray node started on this machine (two "nodes" on loopback);
a 4-config recipe gives the same result keys as the local executor, and a worker killed mid-config is
retried with every config landing in --out exactly once. Skipped when Ray is not installed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

# two Ray nodes on loopback take about a minute: run by bench/ray_two_nodes.sh, not by `make test`
pytestmark = pytest.mark.cluster

from infer_tune.runners.multiprocess import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = """workload: {limit: 2, max_new_tokens: 4}
protocol: {warmup: 0, min_iterations: 1, min_duration_s: 0, max_rounds: 4}
configs:
  - {technique: quantize, method: bf16}
  - {technique: quantize, method: int8-dynamic}
  - {technique: kv-cache, impl: static}
  - {technique: speculate, draft: prompt-lookup, num_draft_tokens: 2}
"""
RAY = Path(sys.executable).with_name("ray")


def _start(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([str(RAY), "start", "--block", "--num-cpus", "1", "--resources",
                             '{"infer_tune_node": 1}', "--disable-usage-stats", "--node-ip-address", "127.0.0.1", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """End the process group this test started (ray start and the processes it launched), by its id."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(wait if sig == signal.SIGTERM else 0)
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        pass


def _keys(docs: list[dict]) -> list:
    return [(d["technique"], d.get("label"), sorted(d), sorted(d["metrics"])) for d in docs]


def test_ray_executor_matches_local_and_retries_a_killed_worker(tiny_model_dir, prompts_file, tmp_path):
    from infer_tune.results import find_results

    recipe = tmp_path / "four.yaml"
    recipe.write_text(RECIPE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               INFER_TUNE_RAY_DIR=str(tmp_path / "nodes"), RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1")
    common = ["-m", "infer_tune", "bench", "--recipe", str(recipe), "--model", str(tiny_model_dir), "--suite",
              str(prompts_file), "--no-ppl", "--threads", "1", "--json"]
    local = subprocess.run([sys.executable, *common, "--out", str(tmp_path / "local")], env=env, capture_output=True,
                           text=True, timeout=120)
    assert local.returncode == 0, local.stderr[-800:]

    port = free_port()
    head = _start(["--head", "--port", str(port), "--include-dashboard=false"], env)
    other = None
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([str(RAY), "status", "--address", f"127.0.0.1:{port}"], env=env, capture_output=True,
                             timeout=30).returncode and time.monotonic() < deadline:
            time.sleep(1)
        other = _start(["--address", f"127.0.0.1:{port}"], env)
        time.sleep(3)
        out, err = (tmp_path / "driver.out").open("w"), (tmp_path / "driver.err").open("w")  # no pipe to fill
        driver = subprocess.Popen([sys.executable, *common, "--out", str(tmp_path / "ray"), "--executor", "ray",
                                   "--ray-address", f"127.0.0.1:{port}"], env=env, stdout=out, stderr=err)
        killed = None
        deadline = time.monotonic() + 150
        while killed is None and driver.poll() is None and time.monotonic() < deadline:
            for marker in (tmp_path / "nodes").glob("*/.attempts/int8-dynamic-*"):
                killed = int(marker.suffix[1:])
                os.kill(killed, signal.SIGKILL)  # the Ray worker measuring this config (started by this test)
                break
            time.sleep(0.02)
        driver.wait(timeout=max(10, deadline - time.monotonic()))
        out.close()
        err.close()
        stdout, stderr = (tmp_path / "driver.out").read_text(), (tmp_path / "driver.err").read_text()
    finally:
        if other is not None:
            _stop(other)
        _stop(head)
    assert killed is not None, "the config's attempt marker never appeared"
    assert driver.returncode == 0, stderr[-800:]
    attempts = sorted((tmp_path / "nodes").glob("*/.attempts/int8-dynamic-*"))
    assert len(attempts) == 2  # the killed attempt and its retry
    assert json.loads(sorted(attempts)[0].read_text())["pid"] in {killed, *[int(a.suffix[1:]) for a in attempts]}
    assert _keys(json.loads(stdout)) == _keys(json.loads(local.stdout))
    landed = find_results(tmp_path / "ray")
    configs = [d["label"] for d in landed if d["technique"] != "baseline"]
    assert sorted(configs) == sorted(["bf16-torch", "int8-dynamic-torch", "static", "lookup-k2"])  # each once
    assert not [p for p in (tmp_path / "ray").iterdir() if p.name.startswith(".") and "lock" not in p.name]
    baselines = {d["run_id"] for d in landed if d["technique"] == "baseline"}
    assert {d["baseline_run_id"] for d in landed if d["technique"] != "baseline"} <= baselines
    assert all(d["env"]["executor"]["kind"] == "ray" for d in landed)
