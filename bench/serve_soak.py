"""Soak `infer-tune serve`: mixed load for N minutes with clients that hang up at random (mid-stream and
mid-non-stream), /health polled throughout. Prints the server's RSS before load, after warm-up and at the
end, requests served, failures by reason, the slots free at the end, /health latency (max) and the
tracebacks in the server's log (docs/hardening.md, "Serving: third attack pass").

    python bench/serve_soak.py                      # smollm2-135m, 5 minutes
    python bench/serve_soak.py --minutes 2 --clients 8 --serve-args "--method int4-rtn --slots 4"

tests/test_serve_hardening.py runs the same load (`soak`) for seconds against a tiny model. Loopback only;
every request has a timeout and every loop ends at the deadline.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

PROMPTS = ["Question 1: what is 1 plus 1?", "def add(a, b):\n    return a + b", "The quick brown fox",
           "Hello", "Write a short poem about the sea.", "List three prime numbers."]
KINDS = ("stream", "whole", "stream_hangup", "whole_hangup")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_server(serve_args: list[str], *, env: dict | None = None, ready_s: float = 600.0):
    """`infer-tune serve ... --port 0` in a subprocess; (process, base URL without /v1) once it printed READY.
    Its stderr goes to a temporary file (read back by `stop_server`) so a full pipe never blocks it."""
    import tempfile

    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen([sys.executable, "-m", "infer_tune", "serve", *serve_args, "--port", "0"],
                               stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    process.log = log
    deadline = time.monotonic() + ready_s
    line = ""
    while time.monotonic() < deadline and not line.startswith("READY"):
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"serve exited with {process.returncode}: {log.read()[-2000:]}")
    if not line.startswith("READY"):
        stop_server(process)
        raise RuntimeError(f"serve did not print READY within {ready_s:.0f} s")
    return process, line.split()[1].removesuffix("/v1")


def stop_server(process) -> tuple[int, str]:
    """SIGTERM, then kill after 30 s; (exit code, the server's stderr)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    process.log.seek(0)
    return process.returncode, process.log.read()


def _connect(base: str, timeout: float) -> http.client.HTTPConnection:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    return http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)


def health(base: str) -> dict:
    conn = _connect(base, 10)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        body = response.read()
        return {**(json.loads(body) if body.startswith(b"{") else {}), "http": response.status}
    finally:
        conn.close()


def one_request(base: str, kind: str, rng: random.Random, timeout: float = 60.0) -> str:
    """One request of `kind`; 'ok', 'hangup' (the client left on purpose) or a failure reason."""
    stream = kind.startswith("stream")
    hangup = kind.endswith("hangup")
    body = {"prompt": rng.choice(PROMPTS), "stream": stream}
    if not hangup:
        body["max_tokens"] = rng.randint(4, 48)  # a hang-up leaves a request that would decode to the full slot
    conn = _connect(base, timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        if hangup and not stream:  # sent; leave before the answer (a few ms to a few steps in)
            time.sleep(rng.uniform(0.005, 0.2))
            return "hangup"
        response = conn.getresponse()
        if response.status != 200:
            response.read()
            return f"http {response.status}"
        if not stream:
            answer = json.loads(response.read())
            return "ok" if answer["choices"][0]["finish_reason"] in ("stop", "length") else "bad finish"
        leave_after = rng.randint(1, 6) if hangup else None
        events = 0
        while True:
            line = response.readline()
            if not line:
                return "stream ended without [DONE]"
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                return "ok"
            if b'"error"' in line:
                return "error event"
            events += 1
            if leave_after is not None and events >= leave_after:
                return "hangup"
    except TimeoutError:
        return "timeout"
    except (ConnectionError, http.client.HTTPException, OSError) as exc:
        return f"{type(exc).__name__}"
    finally:
        conn.close()  # a hang-up: the socket closes with the request unfinished


def soak(base: str, pid: int, seconds: float, *, clients: int = 6, warmup_s: float | None = None,
         seed: int = 0, health_every_s: float = 0.25, settle_s: float = 15.0, log=None) -> dict:
    """Drive `clients` threads of mixed requests (KINDS in turn, at random) for `seconds`, /health polled
    every `health_every_s`; then wait up to `settle_s` for every slot to be free. Returns the figures."""
    warmup_s = min(30.0, seconds / 5) if warmup_s is None else warmup_s
    started = time.monotonic()
    deadline = started + seconds
    outcomes: Counter = Counter()
    lock = threading.Lock()
    health_ms: list[float] = []
    health_bad: Counter = Counter()
    rss = {"before": rss_bytes(pid)}
    samples: list[tuple[float, int]] = []

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        while time.monotonic() < deadline:
            outcome = one_request(base, rng.choice(KINDS), rng)
            with lock:
                outcomes[outcome] += 1

    def poller() -> None:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                state = health(base)
                ok = state["http"] == 200
            except Exception as exc:  # noqa: BLE001 (counted by kind)
                state, ok = {"error": type(exc).__name__}, False
            health_ms.append((time.perf_counter() - t0) * 1e3)
            if not ok:
                health_bad[str(state.get("http", state.get("error")))] += 1
            now = time.monotonic()
            if "warm" not in rss and now - started >= warmup_s:
                rss["warm"] = rss_bytes(pid)
            samples.append((now - started, rss_bytes(pid)))
            time.sleep(health_every_s)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    threads.append(threading.Thread(target=poller, daemon=True))
    for t in threads:
        t.start()
    last_print = started
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline + 90:
        for t in threads:
            t.join(1.0)
        if log is not None and time.monotonic() - last_print >= 30:
            last_print = time.monotonic()
            with lock:
                done = sum(outcomes.values())
            log(f"  {last_print - started:6.0f} s: {done} requests, RSS {rss_bytes(pid) / 2**20:.1f} MiB")
    stuck = sum(t.is_alive() for t in threads)
    state: dict = {}
    settle_deadline = time.monotonic() + settle_s
    while time.monotonic() < settle_deadline:
        state = health(base)
        if state.get("busy") == 0 and state.get("waiting") == 0:
            break
        time.sleep(0.05)
    rss.setdefault("warm", rss["before"])
    rss["end"] = rss_bytes(pid)
    failures = {k: v for k, v in outcomes.items() if k not in ("ok", "hangup")}
    return {"seconds": round(time.monotonic() - started, 1), "clients": clients, "served": outcomes["ok"],
            "hangups": outcomes["hangup"], "failures": failures, "rss_bytes": rss,
            "rss_growth_after_warmup": (rss["end"] - rss["warm"]) / rss["warm"],
            "rss_max_bytes": max([s[1] for s in samples] or [rss["end"]]),
            "health_polls": len(health_ms), "health_failures": dict(health_bad),
            "health_ms_max": max(health_ms or [float("nan")]), "slots": state.get("slots"),
            "busy_at_end": state.get("busy"), "waiting_at_end": state.get("waiting"), "stuck_threads": stuck}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--serve-args", default="--method int4-rtn --activations int8 --native-step --slots 4 "
                                           "--context 1024",
                   help="the rest of the serve command line (default: the int4 a8 native step, 4 slots)")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    serve_args = ["--model", args.model, *shlex.split(args.serve_args)]
    print(f"starting: infer-tune serve {shlex.join(serve_args)} --port 0", flush=True)
    t0 = time.monotonic()
    process, base = start_server(serve_args, env=env)
    print(f"ready in {time.monotonic() - t0:.1f} s at {base}; soaking {args.minutes:g} min with {args.clients} "
          f"clients ({', '.join(KINDS)})", flush=True)
    try:
        report = soak(base, process.pid, args.minutes * 60, clients=args.clients, warmup_s=args.warmup_s,
                      seed=args.seed, log=lambda line: print(line, flush=True))
    finally:
        code, log = stop_server(process)
    mib = {k: round(v / 2**20, 1) for k, v in report["rss_bytes"].items()}
    print(f"RSS MiB: before load {mib['before']}, after warm-up ({args.warmup_s:g} s) {mib['warm']}, "
          f"end {mib['end']}, max {report['rss_max_bytes'] / 2**20:.1f}; growth after warm-up "
          f"{100 * report['rss_growth_after_warmup']:+.2f}%")
    print(f"requests served {report['served']}, hang-ups {report['hangups']}, failures by reason "
          f"{report['failures'] or '{}'}")
    print(f"slots free at end: {report['slots'] - report['busy_at_end'] if report['slots'] is not None else '?'}"
          f" of {report['slots']} (waiting {report['waiting_at_end']})")
    print(f"/health: {report['health_polls']} polls, failures {report['health_failures'] or '{}'}, latency max "
          f"{report['health_ms_max']:.1f} ms")
    tracebacks = log.count("Traceback")
    warnings = [line for line in log.splitlines() if line.startswith("warning:")]
    print(f"server exit {code} on SIGTERM; tracebacks in its log: {tracebacks}; warning lines: {len(warnings)}")
    for line in warnings[:5]:
        print(f"  {line}")
    ok = (report["rss_growth_after_warmup"] <= 0.05 and not report["failures"] and report["busy_at_end"] == 0
          and not report["health_failures"] and tracebacks == 0 and code == 0)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
