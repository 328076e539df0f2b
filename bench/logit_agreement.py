"""Quality on both sides of the equal-bytes comparison: each engine's quantized model against its own 16-bit
model's logits, on the same text, the same chunks and the same scored positions.

    python bench/logit_agreement.py --model llama-3.2-1b --group-size 64 \\
        --formats q4_0,q4_0-default,q4_k_m,q4_k_m-default --context 512 --chunks 6 --out /tmp/agree-1b.json

- The text: ShareGPT's first turns (prompt and reply) in the package's order, joined, cut to `--chunks` chunks of
  `--context` tokens (the checkpoint's tokenizer; the random-weight checkpoints carry SmolLM2's).
- llama.cpp: `llama-perplexity` on the checkpoint's f16 GGUF with `--kl-divergence-base` (its log-probabilities
  saved), then on each quantized GGUF with `--kl-divergence`: mean KL(f16 || quantized), the share of positions
  whose top-1 token is the f16's ("same top p") and both perplexities, as llama.cpp computes them (the second
  half of each chunk scored).
- Ours: the checkpoint in bf16 (transformers, eager) against our int4-rtn a8 model in groups of `--group-size`
  built from the same checkpoint layer by layer (bench/scaling.py's `build_int4`, the model the scaling rows
  decode), both run on the same chunks; the same statistics over the same positions (the second half of each
  chunk, from position context/2 to context-2, as llama-perplexity scores them).

Random weights have no quality of their own to lose, but their quantized logits still agree with their own bf16
model more or less, and that does not depend on a prior 4-bit grid (SmolLM2's weights come from a Q4_1 GGUF,
which flatters group 32). One JSON document per run (`--out`), every figure measured.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scaling import build_int4, checkpoint_dir, phase  # noqa: E402

KLD = re.compile(r"Mean\s+KLD:\s+([-\d.]+)\s+±\s+([-\d.]+)")
SAME_TOP = re.compile(r"Same top p:\s+([-\d.]+)\s+±\s+([-\d.]+)\s*%")
PPL_Q = re.compile(r"Mean PPL\(Q\)\s*:\s*([-\d.]+)")
PPL_BASE = re.compile(r"Mean PPL\(base\)\s*:\s*([-\d.]+)")


def text_file(tokenizer, context: int, chunks: int, folder: Path) -> tuple[Path, list[int]]:
    """The scored text as a file for llama-perplexity and its token ids (at least `chunks` x `context`)."""
    from infer_tune.suites import _sharegpt_pairs

    need, parts, ids = context * chunks, [], []
    for row in _sharegpt_pairs():
        if row.get("lang") != "en":
            continue
        parts.append(row["prompt"] + "\n\n" + row["reference"])
        if len(parts) % 8 == 0:
            ids = tokenizer("\n\n".join(parts), add_special_tokens=False)["input_ids"]
            if len(ids) >= need + context:  # some slack: llama.cpp's tokenizer may cut differently
                break
    text = "\n\n".join(parts)
    path = folder / "agreement-text.txt"
    path.write_text(text, encoding="utf-8")
    return path, tokenizer(text, add_special_tokens=False)["input_ids"]


def parse_kld(out: str) -> dict:
    found = {}
    for key, pattern in (("kld", KLD), ("same_top1", SAME_TOP)):
        match = pattern.search(out)
        if match:
            found[key], found[key + "_pm"] = float(match.group(1)), float(match.group(2))
    for key, pattern in (("ppl", PPL_Q), ("ppl_base", PPL_BASE)):
        match = pattern.search(out)
        if match:
            found[key] = float(match.group(1))
    if "same_top1" in found:
        found["same_top1"] /= 100.0
        found["same_top1_pm"] /= 100.0
    if "kld" not in found:
        raise RuntimeError("llama-perplexity printed no KL divergence: " + " | ".join(out.strip().splitlines()[-5:]))
    return found


def llama_side(folder: Path, formats: list[str], text: Path, context: int, chunks: int, threads: int,
               keep_f16: bool) -> dict:
    from infer_tune.engines import llamacpp

    perplexity = str(llamacpp.require("llama-perplexity"))
    f16 = llamacpp.gguf(folder, "f16", threads=threads)
    common = ["-f", str(text), "-c", str(context), "-b", str(context), "--chunks", str(chunks), "-t", str(threads)]
    rows = {}
    with tempfile.TemporaryDirectory(dir=f16.parent) as tmp:
        base = Path(tmp) / "f16.kld"
        started = time.monotonic()
        proc = subprocess.run([perplexity, "-m", str(f16), *common, "--kl-divergence-base", str(base)],
                              capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise RuntimeError("llama-perplexity (base) failed: " + (proc.stdout + proc.stderr)[-600:])
        phase(f"llama.cpp f16 base logits saved ({time.monotonic() - started:.0f} s)")
        for fmt in formats:
            path = llamacpp.gguf(folder, fmt, threads=threads)
            proc = subprocess.run([perplexity, "-m", str(path), *common, "--kl-divergence-base", str(base),
                                   "--kl-divergence"], capture_output=True, text=True, check=False,
                                  stdin=subprocess.DEVNULL)
            if proc.returncode != 0:
                raise RuntimeError(f"llama-perplexity ({fmt}) failed: " + (proc.stdout + proc.stderr)[-600:])
            rows[fmt] = {**parse_kld(proc.stdout + proc.stderr), "bytes": path.stat().st_size,
                         "head": llamacpp.gguf_facts(path).get("head", "q8_0")}
            phase(f"llama.cpp {fmt}: KLD {rows[fmt]['kld']:.5f}, same top-1 {rows[fmt].get('same_top1')}")
    if not keep_f16:
        f16.unlink(missing_ok=True)  # the disk's largest file: made again when next needed
    return rows


def our_side(name: str, folder: Path, seed: int, group: int, ids: list[int], context: int, chunks: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    started = time.monotonic()
    base = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16, trust_remote_code=False,
                                                use_safetensors=True).eval()
    _, ours, *_ = build_int4(name, seed, set(), group)
    phase(f"ours: bf16 and int4 g{group} a8 models built ({time.monotonic() - started:.0f} s)")
    first = context // 2
    kl_sum = same = count = 0
    nll_q = nll_base = 0.0
    with torch.inference_mode():
        for c in range(chunks):
            chunk = torch.tensor([ids[c * context:(c + 1) * context]])
            logp_base = torch.log_softmax(base(input_ids=chunk).logits[0, first:context - 1].float(), -1)
            logp_q = torch.log_softmax(ours(input_ids=chunk).logits[0, first:context - 1].float(), -1)
            target = chunk[0, first + 1:context]
            kl_sum += float((logp_base.exp() * (logp_base - logp_q)).sum())
            same += int((logp_base.argmax(-1) == logp_q.argmax(-1)).sum())
            nll_q -= float(logp_q.gather(1, target[:, None]).sum())
            nll_base -= float(logp_base.gather(1, target[:, None]).sum())
            count += target.numel()
            phase(f"ours chunk {c + 1}/{chunks}: KLD so far {kl_sum / count:.5f}, same top-1 {same / count:.4f}")
    import math

    return {f"g{group}": {"kld": kl_sum / count, "same_top1": same / count, "ppl": math.exp(nll_q / count),
                          "ppl_base": math.exp(nll_base / count), "positions": count,
                          "bits_a_weight": 4 + 32 / group}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="smollm2-135m, or a preset of bench/scaling.py's checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--formats", default="q4_0,q4_0-default,q4_k_m,q4_k_m-default")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep-f16", action="store_true", help="keep the f16 GGUF (else removed after: disk)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from transformers import AutoTokenizer

    from infer_tune import atomic, models
    from infer_tune.scenarios.common import setup_threads

    setup_threads(args.threads)
    folder = Path(models.resolve(args.model)) if args.model in models.BUILTINS else checkpoint_dir(args.model, args.seed)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"no checkpoint at {folder}: run bench/scaling.py --prepare --models {args.model} first")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with tempfile.TemporaryDirectory() as tmp:
        text, ids = text_file(tokenizer, args.context, args.chunks, Path(tmp))
        if len(ids) < args.context * args.chunks:
            raise SystemExit(f"the text has {len(ids)} tokens, fewer than {args.context} x {args.chunks}")
        formats = [f for f in args.formats.split(",") if f]
        theirs = llama_side(folder, formats, text, args.context, args.chunks, args.threads, args.keep_f16)
    ours = our_side(args.model, folder, args.seed, args.group_size, ids, args.context, args.chunks)
    doc = {"model": args.model, "checkpoint": str(folder), "context": args.context, "chunks": args.chunks,
           "time_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "ours": ours, "llama_cpp": theirs,
           "command": " ".join(sys.argv)}
    print(f"{'side':<26}{'KL(16-bit || q)':>16}{'same top-1':>12}{'ppl q / 16-bit':>16}")
    for side, rows in (("ours", ours), ("llama.cpp", theirs)):
        for key, r in rows.items():
            ratio = r["ppl"] / r["ppl_base"] if r.get("ppl_base") else float("nan")
            print(f"{side + ' ' + key:<26}{r['kld']:>16.5f}{r.get('same_top1', float('nan')):>12.4f}{ratio:>16.4f}")
    if args.out:
        atomic.write_json(args.out, doc)


if __name__ == "__main__":
    main()
