"""Peak memory of load + decode of a saved quantized model, in a process of its own (the issue's memory parity:
load plus serve against llama-server's VmHWM). Each measurement is a fresh `python bench/load_memory.py --child`
process, so its VmHWM is that of one load and one decode only.

    python bench/load_memory.py --model /path/to/saved-int4-a8 --new-tokens 64 --repeats 3

Prints, per repeat: seconds to load, decode tok/s of the lean native step, VmHWM (peak RSS) and VmRSS after the
decode, the checkpoint's bytes on disk; then the medians."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(model: str, new_tokens: int, threads: int | None) -> dict:
    from infer_tune import models
    from infer_tune.scenarios.common import setup_threads
    from infer_tune.tuners.lean.loop import LeanDecoder

    setup_threads(threads)
    import torch

    start = time.perf_counter()
    loaded = models.load(model)
    load_s = time.perf_counter() - start
    after_load = status_kib("VmHWM")
    decoder = LeanDecoder(loaded.model, compile=False, native_step=True)
    ids = torch.tensor([[1] + list(range(100, 163))])  # 64 prompt tokens
    with torch.inference_mode():
        decoder.generate(ids, 4, [], pin_length=True)  # warm
        begin = time.perf_counter()
        _, token_ns, _, _ = decoder.generate(ids, new_tokens, [], pin_length=True)
        decode_s = time.perf_counter() - begin
    return {"load_s": load_s, "decode_tok_s": new_tokens / decode_s, "step": decoder.facts.get("lean_step"),
            "fallback": decoder.facts.get("lean_native_fallback"), "vmhwm_after_load_gib": after_load / 2**20,
            "vmhwm_gib": status_kib("VmHWM") / 2**20, "vmrss_gib": status_kib("VmRSS") / 2**20,
            "disk_gib": sum(p.stat().st_size for p in Path(model).rglob("*") if p.is_file()) / 2**30
            if Path(model).is_dir() else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.new_tokens, args.threads)))
        return
    runs = []
    for i in range(args.repeats):
        cmd = [sys.executable, __file__, "--child", "--model", args.model, "--new-tokens", str(args.new_tokens)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            sys.exit(f"repeat {i + 1} failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]))
    for key in ("load_s", "decode_tok_s", "vmhwm_after_load_gib", "vmhwm_gib", "vmrss_gib"):
        values = [r[key] for r in runs]
        print(f"{key}: median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f}, n {len(values)})")


if __name__ == "__main__":
    main()
