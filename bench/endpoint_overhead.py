"""Client overhead of the endpoint runner: TTFT added by infer-tune's HTTP client, target < 1 ms p50.

Starts the loopback server (infer_tune.endpoint.loopback, answers at once) in its own process,
then alternates the endpoint client and a bare-socket yardstick on warm keep-alive connections
(infer_tune.endpoint.overhead). Overhead = median over rounds of (client TTFT - bare TTFT).

    flock /tmp/infer-tune-cpu.lock python bench/endpoint_overhead.py --rounds 300
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.overhead import measure_client_overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=8, help="content events per response")
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, "-m", "infer_tune.endpoint.loopback", "--port", "0",
                               "--chunks", str(args.chunks)], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline().split()
        if not line or line[0] != "READY":
            raise SystemExit("the loopback server did not start")
        config = EndpointConfig(url=f"http://127.0.0.1:{line[1]}/v1", served_model="loopback", stream_usage=True)
        result = measure_client_overhead(config, rounds=args.rounds, max_tokens=args.chunks)
    finally:
        server.terminate()
        server.wait(10)
    for key in ("client_ttft_ms", "bare_ttft_ms", "overhead_ms"):
        s = result[key]
        print(f"{key:<16} p50 {s['p50']:.3f}  p90 {s['p90']:.3f}  p99 {s['p99']:.3f}  mean {s['mean']:.3f}  n {s['n']}")
    verdict = "met" if result["overhead_ms_p50"] < 1.0 else "NOT met"
    print(f"client overhead on TTFT, p50 of paired differences: {result['overhead_ms_p50']:.3f} ms "
          f"(target < 1 ms: {verdict})")


if __name__ == "__main__":
    main()
