"""Peak memory of load + decode of a saved quantized model, in a process of its own (the issue's memory parity:
load plus serve against llama-server's VmHWM). Each measurement is a fresh `python bench/load_memory.py --child`
process, so its VmHWM is that of one load and one decode only.

    python bench/load_memory.py --make llama-3.2-1b --group-size 128 --save /tmp/int4-1b   # once
    python bench/load_memory.py --model /tmp/int4-1b --gguf PATH/q4_0.gguf --new-tokens 64 --repeats 3

`--make PRESET` writes the saved int4-rtn a8 checkpoint (`quantize --save`'s format, serialize.save_quantized) of
the scaling bench's random checkpoint of PRESET (bench/scaling.py --prepare), built layer by layer (no float
model), and measures nothing. A measurement prints, per repeat: seconds to load, decode tok/s of the lean native
step, VmHWM (peak RSS) after the load and after the decode, VmRSS after the decode, the checkpoint's bytes on disk;
with `--gguf`, llama-server's VmHWM on that GGUF after one completion of the same prompt and length (its own
process, started after ours has exited); then the medians and ours / llama-server's."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = [1] + list(range(100, 163))  # 64 prompt tokens


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
    ids = torch.tensor([PROMPT])
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


def make(preset: str, group: int, seed: int, target: Path) -> None:
    """The saved int4-rtn a8 checkpoint of `preset`'s random checkpoint (bench/scaling.py), as `quantize --save`
    writes it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.scaling import build_int4, checkpoint_dir
    from infer_tune.tuners.quantize import serialize
    from infer_tune.tuners.quantize.pipeline import _config_fields

    tokenizer, model, summary, qconfig, source, build_s = build_int4(preset, seed, set(), group)
    manifest = {"method": qconfig.method, "backend": "torch", "config": _config_fields(qconfig),
                "source_model": str(checkpoint_dir(preset, seed)), "summary": summary}
    serialize.save_quantized(model, tokenizer, target, manifest)
    size = sum(p.stat().st_size for p in target.iterdir() if p.is_file())
    print(f"{preset} g{group} ({source}): built in {build_s:.0f} s, saved to {target} ({size / 2**30:.2f} GiB)")


def server_hwm(gguf: str, model: str, new_tokens: int, threads: int | None) -> dict:
    """llama-server's VmHWM on `gguf` after one completion of the child's prompt, `new_tokens` long."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from transformers import AutoTokenizer

    from bench.lean_prefill import server_completion
    from bench.scaling import hwm_bytes
    from infer_tune.endpoint.servers import local_server

    text = AutoTokenizer.from_pretrained(model).decode(PROMPT)
    with local_server("llama.cpp", gguf, threads=threads) as server:
        answer, _ = server_completion(server.url, text, new_tokens)
        peak = hwm_bytes(server.process.pid)
    return {"server_vmhwm_gib": None if peak is None else peak / 2**30,
            "server_decode_tok_s": answer["timings"]["predicted_per_second"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a saved quantized checkpoint (or any model ref) to measure")
    p.add_argument("--gguf", help="also measure llama-server's VmHWM on this GGUF")
    p.add_argument("--make", metavar="PRESET", help="write the saved int4 a8 checkpoint of PRESET's random "
                                                    "checkpoint to --save, measure nothing")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", type=Path)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make:
        if not args.save:
            sys.exit("--make needs --save DIR")
        make(args.make, args.group_size, args.seed, args.save)
        return
    if not args.model:
        sys.exit("--model is required (or --make)")
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
        if args.gguf:
            runs[-1].update(server_hwm(args.gguf, args.model, args.new_tokens, args.threads))
        print(json.dumps(runs[-1]), flush=True)
    keys = ["load_s", "decode_tok_s", "vmhwm_after_load_gib", "vmhwm_gib", "vmrss_gib"]
    keys += ["server_vmhwm_gib", "server_decode_tok_s"] if args.gguf else []
    for key in keys:
        values = [r[key] for r in runs]
        print(f"{key}: median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f}, n {len(values)})")
    if args.gguf:
        ratios = [r["vmhwm_gib"] / r["server_vmhwm_gib"] for r in runs]
        print(f"peak RSS ours / llama-server: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f}, n {len(ratios)})")


if __name__ == "__main__":
    main()
