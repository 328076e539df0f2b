"""The endpoint client at 1 to 1,024 concurrent streams against a server of known timing (docs/endpoint.md).

Starts the paced loopback server (infer_tune.endpoint.paced: first token 120 ms after the request arrived at
its socket, by the kernel's receive timestamp, then one every 15 ms, 16 tokens; it records its own achieved
send times) in its own process. At each load
N, N requests arrive at once (`endpoint sim --rates inf --requests N --concurrency N`), replayed by the
multi-process load generator and by the single-loop client (workers = 1, after one warmup request as
`endpoint sim` sends); each reported TTFT / TPOT p50
is set beside the server's truth for the same requests, with the client's saturation readings. Requests
are paired with the server's records by prompt, which splits the reported TTFT into the server's time
(arrival at its socket -> first token written: the truth) and the client's own delay (scheduled arrival
-> sent -> at the server's socket, plus first token written -> seen); the server's read delay (arrival
at its socket -> read: its own backlog when it shares the cores) is shown beside, no longer inside the
truth's interval.

    flock /tmp/infer-tune-cpu.lock python bench/endpoint_loadgen.py --loads 1,64,256,1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import urllib.request

from infer_tune.endpoint import loadgen
from infer_tune.endpoint import replay as rp
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.paced import truth_summary
from infer_tune.runners.trace import TraceRequest


def measure(url: str, n: int, workers: int, tokens: int) -> dict:
    config = EndpointConfig(url=url, served_model="paced", concurrency=n, stream_usage=True, timeout_s=120,
                            workers=workers)
    trace = [TraceRequest(i, 0.0, tokens) for i in range(n)]
    prompts = [f"prompt {i}" for i in range(n)]
    single_loop = workers == 1
    if not single_loop:
        result, client = loadgen.replay_workers(config, trace, prompts, tokens, workers=workers)
        readings, workers = client["worker_readings"], client["workers"]
    else:
        async def single():  # as `endpoint sim` runs it: one warmup request on the pool first
            async with rp.client_session(config) as session:
                await rp.replay(session, config, trace[:1], prompts, tokens, closed_loop=True)
                with urllib.request.urlopen(url.removesuffix("/v1") + "/truth", timeout=30):
                    pass  # the warmup is not part of the truth
                return await loadgen.monitored(rp.replay(session, config, trace, prompts, tokens))

        result, reading = asyncio.run(single())
        readings = [reading]
    with urllib.request.urlopen(url.removesuffix("/v1") + "/truth", timeout=30) as answer:
        served = json.load(answer)["requests"]
    truth = truth_summary(served)
    origin = result.origin_ns
    sent = statistics.median((t.start_ns - origin) / 1e6 for t in result.timings) if result.timings else None
    read = statistics.median((r["read_ns"] - origin) / 1e6 for r in served) if served else None
    # per request (paired by prompt): the client's own delay = scheduled arrival -> at the server's socket
    # (send lateness + the wire) + first token written -> seen; the server's read delay = at its socket -> read
    by_prompt = {r["prompt"]: r for r in served}
    own, queue = [], []
    for t in result.timings:
        r = by_prompt.get(prompts[t.prompt_index])
        if r and r["send_ns"]:
            own.append(((r["arrival_ns"] - t.submit_ns) + (t.token_ns[0] - r["send_ns"][0])) / 1e6)
            queue.append((r["read_ns"] - r["arrival_ns"]) / 1e6)
    ttft = [t.ttft_ms for t in result.timings]
    tpot = [(t.e2e_ms - t.ttft_ms) / (len(t.token_ns) - 1) for t in result.timings if len(t.token_ns) > 1]
    verdict = loadgen.saturation(readings, result.lateness_ms)
    return {"n": n, "workers": workers, "single": single_loop, "ok": len(result.timings), "failed": len(result.failures),
            "ttft": statistics.median(ttft) if ttft else None, "tpot": statistics.median(tpot) if tpot else None,
            "truth_ttft": truth["ttft_ms_p50"], "truth_tpot": truth["tpot_ms_p50"], "truth_n": truth["requests"],
            "truth_from_kernel": truth["from_kernel"], "sender": readings[0].get("sender", "aiohttp"),
            "sent_late_ms_p50": statistics.median(result.lateness_ms) if result.lateness_ms else None,
            "lag_p50": max((r["loop_lag_ms_p50"] or 0) for r in readings),
            "lag_p99": max((r["loop_lag_ms_p99"] or 0) for r in readings),
            "cpu": max((r["cpu_share"] or 0) for r in readings), "sent_ms_p50": sent, "read_ms_p50": read,
            "client_own_ms_p50": statistics.median(own) if own else None,
            "server_queue_ms_p50": statistics.median(queue) if queue else None, "paired": len(own),
            **verdict}


def err(row: dict, key: str) -> str:
    got, truth = row[key], row[f"truth_{key}"]
    if got is None or truth is None:
        return "-"
    within = abs(got - truth) <= max(2.0, 0.05 * truth)
    return f"{got:.1f} vs {truth:.1f} ({100 * (got / truth - 1):+.1f}%{'' if within else ' !'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--loads", default="1,64,256,1024")
    parser.add_argument("--workers", type=int, default=None, help="load-generator processes (default: chosen per load)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, "-m", "infer_tune.endpoint.paced", "--port", "0", "--tokens",
                               str(args.tokens)], stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        line = server.stdout.readline().split()
        if not line or line[0] != "READY":
            raise SystemExit("the paced server did not start")
        url = f"http://127.0.0.1:{line[1]}/v1"
        for n in (int(v) for v in args.loads.split(",")):
            workers = args.workers or max(2, loadgen.default_workers(n))  # at least 2: the process path
            for w in (workers, 1):
                rows.append(measure(url, n, w, args.tokens))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(10)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"cores: {loadgen.cores()}; server: first token 120 ms after the request arrived at its socket, then "
          f"15 ms/token, {args.tokens} tokens (p50 reported vs the server's achieved p50; '!' = outside 5% / 2 ms)")
    print("| streams | client | TTFT p50 ms (vs truth) | TPOT p50 ms (vs truth) | client's own delay p50 ms "
          "| sent late p50 ms | server read delay p50 ms (not in TTFT) | loop lag p50 / p99 ms | CPU/core "
          "| client_saturated |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        who = "single loop" if r["single"] else f"{r['workers']} worker process(es), {r['sender']}"
        flag = f"yes: {r['client_saturation_reason']}" if r["client_saturated"] else "no"
        late = "-" if r["sent_late_ms_p50"] is None else f"{r['sent_late_ms_p50']:.1f}"
        print(f"| {r['n']} | {who} | {err(r, 'ttft')} | {err(r, 'tpot')} | {r['client_own_ms_p50']:.1f} | {late} "
              f"| {r['server_queue_ms_p50']:.1f} | {r['lag_p50']:.2f} / {r['lag_p99']:.2f} "
              f"| {100 * r['cpu']:.0f}% | {flag} |")
    kernel = sum(r["truth_from_kernel"] for r in rows)
    print(f"server arrivals from kernel receive timestamps: {kernel} of {sum(r['truth_n'] for r in rows)}")


if __name__ == "__main__":
    main()
