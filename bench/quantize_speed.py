"""Decode tok/s of fp32 vs each quantization method/backend on SmolLM2-135M, in one process, same prompts.

Backs the claim "int8-dynamic decode speedup vs fp32 >= 2.0x with perplexity change <= 5%" and the
`--backend auto` choice. Not a test (timing is noisy on a shared machine): run it by hand.

    .venv/bin/python bench/quantize_speed.py --tokens 64 --prompts 2 --threads 2 \
        --methods int8-dynamic:torch,int8-static:torch,int4-weight:torch,int8-dynamic:quanto,bf16:torch
"""

from __future__ import annotations

import argparse
import copy
import math
import time
import warnings

import torch


def decode_tok_s(model, batches, tokens: int, pad_id: int) -> float:
    """Greedy decode of `tokens` pinned new tokens per prompt; tok/s over the timed (second) pass."""
    kwargs = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False, "pad_token_id": pad_id}
    with torch.inference_mode():
        model.generate(**batches[0], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warmup
        start = time.perf_counter()
        for batch in batches:
            model.generate(**batch, **kwargs)
        return tokens * len(batches) / (time.perf_counter() - start)


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        return math.exp(float(model(input_ids=ids, labels=ids).loss))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", default="int8-dynamic:torch,int8-static:torch,int4-weight:torch,int4-rtn:torch,"
                                             "bf16:torch,int8-dynamic:quanto")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)

    from infer_tune import models
    from infer_tune.suites import SuiteSpec, load_suite
    from infer_tune.tuners.quantize import QuantizeConfig
    from infer_tune.tuners.quantize.calibrate import calibration_batches
    from infer_tune.tuners.quantize.pipeline import bytes_16bit, quantize_in_memory

    loaded = models.load(args.model)
    tok = loaded.tokenizer
    prompts = [p.text for p in load_suite(SuiteSpec(name="chat", limit=args.prompts))]
    batches = [dict(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)) for t in prompts]
    held = tok(" ".join(p.text for p in load_suite(SuiteSpec(name="chat", seed=7, limit=8))),
               return_tensors="pt")["input_ids"][:, :512]
    calib = calibration_batches(tok, "chat", 8)
    base_bytes16 = bytes_16bit(loaded.model)
    fp32 = decode_tok_s(loaded.model, batches, args.tokens, tok.pad_token_id)
    fp32_ppl = perplexity(loaded.model, held)
    print(f"threads={args.threads} tokens={args.tokens} prompts={len(batches)}")
    print(f"{'method:backend':<22} {'tok/s':>7} {'vs fp32':>8} {'ppl':>8} {'ppl d%':>7} {'bytes/16bit':>11}")
    print(f"{'fp32':<22} {fp32:7.1f} {1.0:8.2f} {fp32_ppl:8.2f} {0.0:7.2f} {models.model_bytes(loaded.model) / base_bytes16:11.2f}")
    for spec in args.methods.split(","):
        method, backend = spec.split(":")
        model = copy.deepcopy(loaded.model)
        quantize_in_memory(model, QuantizeConfig(method=method, backend=backend), backend, calib)
        rate = decode_tok_s(model, batches, args.tokens, tok.pad_token_id)
        ppl = perplexity(model, held)
        print(f"{spec:<22} {rate:7.1f} {rate / fp32:8.2f} {ppl:8.2f} {100 * (ppl - fp32_ppl) / fp32_ppl:7.2f} "
              f"{models.model_bytes(model) / base_bytes16:11.2f}", flush=True)
        del model


if __name__ == "__main__":
    main()
