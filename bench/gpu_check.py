"""infer-tune's CUDA paths in a few minutes, run by bench/gpu_check.sh (which exits cleanly without CUDA).

One line per check (PASS / FAIL / SKIP), a summary, exit 1 if a check failed. Needs a CUDA device.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback

import torch

results = []
CHECKS = []


def later(name):
    """Register a check to run in order from main() (spawned nccl ranks import this file without running it)."""
    def wrap(fn):
        CHECKS.append((name, fn))
        return fn
    return wrap


def check(name):
    def wrap(fn):
        started = time.perf_counter()
        try:
            detail = fn() or ""
            status = "SKIP" if detail.startswith("skip") else "PASS"
        except Exception as exc:  # a failed check is reported, the others still run
            status, detail = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            traceback.print_exc(limit=3)
        results.append((name, status))
        print(f"[{status}] {name} ({time.perf_counter() - started:.1f} s) {detail}", flush=True)
        return fn
    return wrap


dev = torch.device("cuda") if torch.cuda.is_available() else None
props = torch.cuda.get_device_properties(0) if dev is not None else None


def header() -> None:
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s); "
          f"device 0: {props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}", flush=True)


@later("int4 weight-only matmul (aten._weight_int4pack_mm) vs dequantized fp32")
def int4_kernel():
    if props.major < 8:
        return "skip: the int4 CUDA kernel needs sm_80 or newer"
    n, k, group = 4096, 4096, 128
    torch.manual_seed(0)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=dev)
    scales = torch.rand(k // group, n, device=dev, dtype=torch.bfloat16) * 0.02 + 0.001
    zeros = torch.zeros(k // group, n, device=dev, dtype=torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    x = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
    out = torch.ops.aten._weight_int4pack_mm(x, packed, group, torch.stack([scales, zeros], -1).contiguous())
    # torch's int4 layout: value (q - 8) * scale + zero per group
    w = ((q.float() - 8) * scales.float().t().repeat_interleave(group, dim=1))  # [n, k]
    ref = x.float() @ w.t()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"relative error {err:.3g}"
    return f"relative error {err:.2e}"


@later("int8 x int8 -> int32 matmul (torch._int_mm) exact")
def int8_kernel():
    a = torch.randint(-127, 128, (32, 1024), dtype=torch.int8, device=dev)
    b = torch.randint(-127, 128, (1024, 2048), dtype=torch.int8, device=dev)
    out = torch._int_mm(a, b)
    assert torch.equal(out.cpu(), a.cpu().int() @ b.cpu().int()), "int32 results differ from the exact product"
    return "equal to the exact int32 product"


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    return LlamaForCausalLM(config).eval()


@later("infer-tune quantize pipeline on the device (bf16, int8-dynamic) keeps greedy top-1 close")
def project_quantize():
    from infer_tune.tuners.quantize import QuantizeConfig
    from infer_tune.tuners.quantize.config import resolve_backend
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    notes = []
    ids = torch.randint(0, 512, (2, 32), device=dev)
    for method in ("bf16", "int8-dynamic"):
        model = tiny_llama().to(dev)
        with torch.no_grad():
            ref = model(ids).logits.float()
        try:
            config = QuantizeConfig(method=method)
            quantize_in_memory(model, config, resolve_backend(config, "cuda"))
        except Exception as exc:  # e.g. the CUDA backend's package is not installed
            notes.append(f"{method}: not run ({type(exc).__name__}: {str(exc)[:80]})")
            continue
        with torch.no_grad():
            out = model(ids).logits.float()
        top1 = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert top1 >= 0.8, f"{method}: top-1 agreement {top1:.2f}"
        notes.append(f"{method}: top-1 {top1:.2f}")
    return "; ".join(notes)


@later("compiled lean step + compiled prefill on CUDA: tokens equal to the eager path, CUDA-event timing")
def compiled_step():
    from infer_tune.tuners.lean.loop import LeanDecoder

    model = tiny_llama().to(dev)
    ids = torch.randint(0, 512, (1, 20), device=dev)
    eager = LeanDecoder(model, compile=False).generate(ids, 32, [])[2]
    decoder = LeanDecoder(model, compile=True, compile_prefill=True)
    decoder.generate(ids, 32, [])  # compiles
    _, token_ns, tokens, _ = decoder.generate(ids, 32, [])
    assert tokens == eager, "compiled tokens differ from eager"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    host = time.perf_counter()
    start.record()
    decoder.generate(ids, 32, [])
    end.record()
    torch.cuda.synchronize()
    host_ms, event_ms = (time.perf_counter() - host) * 1e3, start.elapsed_time(end)
    assert 0 < event_ms <= host_ms * 1.05 + 1, f"CUDA events {event_ms:.2f} ms vs host {host_ms:.2f} ms"
    return (f"step {decoder.facts.get('lean_step')}, prefill {decoder.facts.get('lean_prefill')}; 32 tokens: "
            f"CUDA events {event_ms:.2f} ms, host {host_ms:.2f} ms, {(token_ns[-1] - token_ns[0]) / 31e6:.3f} ms/token")


def _rank(rank, world, port, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    x = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    queue.put((rank, float(x[0].item())))
    dist.destroy_process_group()


@later("nccl all_reduce across two ranks")
def nccl():
    if torch.cuda.device_count() < 2:
        return "skip: one device (nccl across ranks needs two)"
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    assert got == {0: 3.0, 1: 3.0}, got
    return "sum 3.0 on both ranks"


def main() -> int:
    if dev is None:
        print("gpu_check: no CUDA device visible to torch; nothing to check.")
        return 0
    header()
    for name, fn in CHECKS:
        check(name)(fn)
    failed = [n for n, s in results if s == "FAIL"]
    print(f"gpu_check: {sum(s == 'PASS' for _, s in results)} passed, {len(failed)} failed, "
          f"{sum(s == 'SKIP' for _, s in results)} skipped")
    return 1 if failed else 0


def summarize(path: str, model: str) -> int:
    """One line per row of a `quantize --json` sweep (check 6 of gpu_check.sh); exit 1 when a row failed."""
    import json

    def p50(metric):
        return (metric or {}).get("p50")

    status = 0
    for doc in json.load(open(path)):
        m, config = doc["metrics"], doc.get("config") or {}
        ratio, interval = m.get("speedup_vs_baseline"), m.get("speedup_vs_baseline_ci95")
        fields = [f"decode {m.get('decode_tok_s') or 0:.1f} tok/s", f"TTFT p50 {p50(m.get('ttft_ms')) or 0:.1f} ms",
                  f"TPOT p50 {p50(m.get('tpot_ms')) or 0:.2f} ms",
                  f"speedup {ratio:.2f}x {[round(x, 2) for x in interval] if interval else '(no interval)'}" if ratio else "reference",
                  f"backend {m.get('backend_resolved')}", f"layers {m.get('quantized_layers')}",
                  f"{(m.get('model_bytes') or 0) / 2**30:.2f} GiB ({m.get('bytes_ratio_vs_16bit') or 0:.2f}x 16-bit)",
                  f"GPU peak {(m.get('cuda_peak_bytes') or 0) / 2**30:.2f} GiB",
                  f"roofline {m.get('roofline_fraction')} of {m.get('roofline_bandwidth_gb_s')} GB/s "
                  f"({m.get('roofline_bandwidth_from')})"]
        bad = config.get("method") not in (None, "bf16") and not m.get("quantized_layers")
        status |= bad
        print(f"{'FAIL' if bad else 'PASS'} sizes {model} {config.get('method', doc.get('label'))}: " + ", ".join(fields))
    return status


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarize"]:
        sys.exit(summarize(*sys.argv[2:4]))
    sys.exit(main())
