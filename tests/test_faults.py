"""Dying in the middle (docs/hardening.md, "Faults"): sweeps SIGKILLed at seeded points resume to every config
once with every saved result untouched; a disk that fills during a write ends in one line with the earlier
results intact; a server that dies mid-stream, answers garbage or stalls gives failed requests with their
reasons and a run that ends within its deadline. Bounded: loopback only, every wait has a deadline."""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infer_tune import atomic, results
from tests.test_data_safety import METHODS, RECIPE  # the same cheap sweep the data-safety tests run

ROOT = Path(__file__).resolve().parent.parent
KILLS = 20
SEED = 20261206


class Forker:
    """tests/fakes/forker.py: CLI commands in children forked from one process that imported infer-tune."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fakes" / "forker.py")], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _read(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0.0))
        if not ready:
            return None
        line = self.proc.stdout.readline()
        assert line, "the forker died"
        return json.loads(line)

    def run(self, argv: list[str], log: Path, kill_after: float | None, limit_s: float = 120.0) -> int:
        """Run `argv`; SIGKILL it `kill_after` seconds after the fork unless it ended first. Its exit status."""
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        started = self._read(60.0)
        assert started is not None, "the forker did not fork"
        pid = started["pid"]
        t0 = time.monotonic()
        if kill_after is not None:
            ended = self._read(kill_after)
            if ended is not None:
                return ended["status"]
            os.kill(pid, signal.SIGKILL)
        ended = self._read(limit_s - (time.monotonic() - t0))
        assert ended is not None, f"{argv[0]} did not end within {limit_s} s: {log.read_text()[-2000:]}"
        return ended["status"]

    def close(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=30)


@pytest.fixture()
def forker():
    made = Forker()
    try:
        yield made
    finally:
        if made.proc.poll() is None:
            made.proc.kill()
            made.proc.wait(timeout=30)


def _hashes(out: Path) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.glob("*/result.json")}


def _check_sweep_done(out: Path) -> None:
    docs = results.find_results(out)
    candidates = [d for d in docs if d["technique"] == "quantize"]
    baselines = {d["run_id"] for d in docs if d["technique"] == "baseline"}
    assert sorted(d["config"].get("method") for d in candidates) == sorted(METHODS), out
    assert len({d["fingerprint"] for d in candidates}) == len(METHODS)
    assert all(d["baseline_run_id"] in baselines for d in candidates)
    assert not [p for p in out.iterdir() if atomic.STAGING_TAG in p.name], "staging leftovers were not cleaned"


def test_sweeps_killed_at_20_seeded_points_resume_with_every_saved_result_untouched(forker, tiny_model_dir,
                                                                                   prompts_file, tmp_path):
    """20 SIGKILLs of `bench --recipe` sweeps, each at a seeded delay after its start (from the load to the last
    save), spread over as many sweeps as they take: after each kill `--resume` runs (and may be killed too);
    every result.json on disk is a complete, valid result (results.load_result) at every step, none is ever
    rewritten (sha256 of each before each resume equal after it), and each sweep ends with every config once."""
    rng = random.Random(SEED)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(RECIPE + "".join(f"  - {{technique: quantize, method: {m}, backend: torch}}\n"
                                      for m in METHODS))
    kills = lanes = 0
    deadline = time.monotonic() + 240
    while kills < KILLS:
        assert time.monotonic() < deadline, f"only {kills} kills landed"
        out = tmp_path / f"runs-{lanes}"
        lanes += 1
        seen: dict[Path, str] = {}
        for attempt in range(40):
            argv = ["bench", "--recipe", str(sweep), "--model", str(tiny_model_dir), "--suite", str(prompts_file),
                    "--threads", "1", "--no-ppl", "--out", str(out), "--json"] + (["--resume"] if attempt else [])
            delay = rng.uniform(0.05, 2.5) if kills < KILLS else None
            status = forker.run(argv, tmp_path / "log.txt", delay)
            now = _hashes(out) if out.exists() else {}
            assert {p: now.get(p) for p in seen} == seen, "a saved result was rewritten or removed"
            for path in now:
                results.load_result(path)  # complete, valid: a truncated file raises here
            seen = now
            if status == -signal.SIGKILL:
                kills += 1
                continue
            assert status == 0, (tmp_path / "log.txt").read_text()[-3000:]
            _check_sweep_done(out)
            break
        else:
            pytest.fail("a sweep did not finish in 40 resumes")
    forker.close()
    assert kills == KILLS


# ----------------------------------------------------------------------------- the disk filling during a write
def test_a_disk_that_fills_while_a_result_is_written_ends_in_one_line_and_keeps_the_earlier_results(
        tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    """ENOSPC injected where the disk reports it (fsync of the staged result.json, as delayed allocation does):
    `bench` ends with one `error:` line and exit 2 (an unusable environment, not a crash log: the crash log
    could not be written either), leaves no partial result and no staging folder, and the result saved before
    is byte for byte what it was."""
    from typer.testing import CliRunner

    from infer_tune.cli import app

    runner = CliRunner()
    out = tmp_path / "runs"
    args = ["bench", "--model", str(tiny_model_dir), "--suite", str(prompts_file), "--limit", "1",
            "--max-new-tokens", "2", "--warmup", "0", "--min-iterations", "1", "--min-duration", "0", "--threads", "1",
            "--no-ppl", "--out", str(out)]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    before = _hashes(out)
    assert len(before) == 1
    real_fsync = os.fsync
    hits = []

    def full_disk(fd):
        name = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        if "result.json" in name:
            hits.append(name)
            raise OSError(28, os.strerror(28))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    second = runner.invoke(app, args)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert hits, "the injection never fired"
    assert second.exit_code == 2, second.output
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: the disk is full"), second.stderr
    assert "Traceback" not in second.output
    assert _hashes(out) == before
    assert not [p for p in out.rglob("*") if atomic.STAGING_TAG in p.name or p.name.endswith(".partial")]
    assert len([p for p in out.iterdir() if not p.name.startswith(".")]) == 1


# ----------------------------------------------------------------------------- the server under test failing
SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Server: faulty\r\n\r\n")
FAST = ["--warmup", "1", "--min-iterations", "2", "--min-duration", "0", "--limit", "3", "--max-new-tokens", "8",
        "--served-model", "m", "--json"]


def _faulty(kind: str, every: int):
    """The loopback server (infer_tune/endpoint/loopback.py) failing on every `every`-th completion request:
    `die` (half a stream, then the connection reset: the server process gone mid-answer), `garbage` (bytes that
    are no HTTP at all, then close) or `stall` (half a stream, then silence for 30 s)."""
    import asyncio

    from infer_tune.endpoint.loopback import Behaviour, LoopbackServer, _chunk, _event, _Handler

    class Faulty(_Handler):
        async def complete(self, request, n, writer):
            if n % every:
                return await super().complete(request, n, writer)
            event = {"id": f"r{n}", "object": "chat.completion.chunk", "model": "m",
                     "choices": [{"index": 0, "delta": {"content": "half "}}]}
            if kind == "garbage":
                writer.write(b"\x00\xff\xfeSSH-2.0-garbage\r\n" * 64)
                await writer.drain()
                writer.close()
                return
            writer.write(SSE_HEAD + _chunk(_event(event)))
            await writer.drain()
            if kind == "die":
                writer.transport.abort()  # RST: what a killed server's kernel sends
            else:
                await asyncio.sleep(30)

    server = LoopbackServer(Behaviour(model="m"))
    server.handler = Faulty(Behaviour(model="m"))
    return server


@pytest.mark.parametrize("kind", ["die", "garbage", "stall"])
def test_a_server_that_dies_mid_stream_answers_garbage_or_stalls_gives_failed_requests_with_reasons(tmp_path,
                                                                                                     kind):
    """Every 2nd completion request fails in the server (1 handshake, 1 warmup, 6 timed: 3 of the timed): the run
    records each as a failed request with its reason, saves the result and ends well within its deadline (the
    stall is cut by --idle-timeout 0.5 s, not waited out)."""
    from typer.testing import CliRunner

    from infer_tune.cli import app

    started = time.monotonic()
    with _faulty(kind, every=2) as server:
        result = CliRunner().invoke(app, ["bench", "--endpoint", server.url, "--out", str(tmp_path), *FAST,
                                          "--idle-timeout", "0.5", "--request-timeout", "10"])
    elapsed = time.monotonic() - started
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    m = doc["metrics"]
    assert m["requests_failed"] == 3 and m["requests_ok"] == 3, m
    assert sum(m["failures_by_kind"].values()) == 3 and all(m["failures_by_kind"]), m["failures_by_kind"]
    assert elapsed < 20, f"the run took {elapsed:.1f} s"
    saved = results.load_result(Path(tmp_path).glob("*/result.json").__next__())
    assert saved.metrics["requests_failed"] == 3
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "3 of 6 requests failed" in warnings[0], result.stderr
    print(kind, m["failures_by_kind"], f"{elapsed:.2f} s")


def test_a_server_process_killed_mid_run_ends_the_run_within_its_deadline(tmp_path):
    """The server process itself SIGKILLed while `bench --endpoint` times it (its streams cut, then every
    connection refused): the run ends on its own, well within --request-timeout x requests, with the requests
    after the kill failed by reason, or one `error:` line and exit 2 when too few requests succeeded; never a
    hang or a traceback."""
    import threading

    from typer.testing import CliRunner

    from infer_tune.cli import app

    code = ("import sys, time\n"
            "from infer_tune.endpoint.loopback import Behaviour, LoopbackServer\n"
            "server = LoopbackServer(Behaviour(model='m', gap_s=0.05))\n"
            "server.__enter__()\n"
            "print(server.url, flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        killer = threading.Timer(1.5, proc.kill)  # after the handshake and warmup, amid the timed requests
        killer.start()
        started = time.monotonic()
        result = CliRunner().invoke(app, ["bench", "--endpoint", url, "--out", str(tmp_path), *FAST,
                                          "--min-iterations", "6", "--request-timeout", "10"])
        elapsed = time.monotonic() - started
        killer.join()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert "Traceback" not in result.output
    assert elapsed < 30, f"the run took {elapsed:.1f} s"
    print(result.exit_code, result.stderr[-500:], f"{elapsed:.2f} s")
    if result.exit_code == 0:
        m = json.loads(result.stdout)["metrics"]
        assert m["requests_failed"] >= 1 and all(m["failures_by_kind"]), m
    else:
        assert result.exit_code == 2, result.output
        lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
        assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
