"""The native decode step on the layer shapes of the families it runs, random weights (no download).

Per shape (`SHAPES`: a real model's hidden size, heads, kv heads, head size, MLP width, window; a few layers
and a 4096-token vocabulary unless `--full`), int4-rtn a8 (group 32), the step against the eager forward
from the same cache for `--steps` steps after a `--prompt`-token prompt (past Gemma 3's 512-position window):
each step's largest |native - eager| over the largest |eager| logit. fp32 rounding leaves about 3e-7; an
int8 activation that the two round to neighbouring levels now and then leaves ~1e-2 (the `llama-as-*`
shapes show the Llama step, unchanged by the other families, doing the same at the same shapes).

With `--speed`, the lean loop with the native step against its compiled (captured) step on the same weights,
`--rounds` interleaved rounds of `--tokens` greedy tokens (order alternating), ms per step.

    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/native_families.py --threads 2 qwen3-1.7b gemma3-270m
    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/native_families.py --threads 2 --speed --full gemma3-270m

Not a test: read the numbers of one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # name: (config class, its arguments, layers kept)
    # Gemma-3-270M: hidden 640, 4 heads and 1 kv head of 256, MLP 2048, window 512, 5 sliding layers to 1 full
    "gemma3-270m": ("Gemma3TextConfig", dict(hidden_size=640, intermediate_size=2048, num_attention_heads=4,
                                             num_key_value_heads=1, head_dim=256, sliding_window=512,
                                             query_pre_attn_scalar=256, vocab_size=262144), 18),
    "qwen3-1.7b": ("Qwen3Config", dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                                       num_key_value_heads=8, head_dim=128, vocab_size=151936), 28),
    "qwen2.5-1.5b": ("Qwen2Config", dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                         num_key_value_heads=2, vocab_size=151936), 28),
    # Mistral-7B v0.1's attention (8 kv heads of 128) at a quarter of its hidden size, a 256-position window
    "mistral": ("MistralConfig", dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=128, sliding_window=256, vocab_size=32000), 8),
    "llama-as-qwen3-1.7b": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                                                num_key_value_heads=8, head_dim=128, vocab_size=151936), 28),
    "llama-as-qwen2.5-1.5b": ("LlamaConfig", dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                                  num_key_value_heads=2, vocab_size=151936), 28),
}


def build(name: str, full: bool):
    import transformers
    from transformers import AutoModelForCausalLM

    from infer_tune.tuners.quantize import QuantizeConfig
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    cls, kwargs, layers = SHAPES[name]
    kwargs = dict(kwargs)
    if not full:
        layers, kwargs["vocab_size"] = (6 if name.startswith("gemma3") else 2), 4096  # gemma: one full layer
    torch.manual_seed(0)
    config = getattr(transformers, cls)(num_hidden_layers=layers, max_position_embeddings=4096, **kwargs)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases and norm weights off their initial zeros / ones, as trained ones are
        for key, param in model.named_parameters():
            if key.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.5)
            elif key.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.3)
    quantize_in_memory(model, QuantizeConfig(method="int4-rtn", activations="int8"), "torch")
    return model


def check(name: str, model, prompt: int, steps: int) -> None:
    from infer_tune.native.step import NativeStep, plain_cache, recognize

    parts, why = recognize(model)
    if parts is None:
        raise SystemExit(f"{name}: no native step ({why})")
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, prompt), generator=torch.Generator().manual_seed(1))
    caches = [plain_cache(model.config, prompt + steps + 64) for _ in range(2)]
    rels = []
    with torch.no_grad():
        for cache in caches:
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(prompt)).logits
        step = NativeStep(model, caches[1], parts)
        token = logits[:, -1].argmax(-1, keepdim=True)
        for position in range(prompt, prompt + steps):
            for a, b in zip(caches[0].layers, caches[1].layers):
                b.keys.copy_(a.keys), b.values.copy_(a.values), b.cumulative_length.copy_(a.cumulative_length)
            at = torch.tensor([position])
            want = model(input_ids=token, past_key_values=caches[0], use_cache=True, cache_position=at,
                         logits_to_keep=1).logits
            rels.append(float((step(token, at) - want).abs().max() / want.abs().max()))
            token = want[:, -1].argmax(-1, keepdim=True)
    print(f"{name}: windows {sorted(set(parts['windows']))}, {steps} steps after {prompt} tokens: "
          f"largest {max(rels):.2e}, median {statistics.median(rels):.1e}, over 1e-4 at {sum(r > 1e-4 for r in rels)} "
          f"steps", flush=True)


def speed(name: str, model, prompt: int, tokens: int, rounds: int) -> None:
    from infer_tune.tuners.lean.loop import LeanDecoder

    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(2))
    eos = [model.config.eos_token_id]
    native = LeanDecoder(model, compile=True, native_step=True)
    compiled = LeanDecoder(model, compile=True, native_step=False)
    for decoder in (native, compiled):
        decoder.reserve(prompt + tokens)
        started = time.perf_counter()
        decoder.generate(ids, tokens, eos)  # warm: the compiled step captures and compiles here
        print(f"{name}: {decoder.facts['lean_step']} warm-up {time.perf_counter() - started:.1f} s", flush=True)
    per_step = {"native": [], "compiled": []}
    for r in range(rounds):
        order = [("native", native), ("compiled", compiled)]
        for label, decoder in (order if r % 2 == 0 else order[::-1]):
            _, token_ns, _, _ = decoder.generate(ids, tokens, eos)
            per_step[label].append((token_ns[-1] - token_ns[0]) / 1e6 / (len(token_ns) - 1))
    ratios = sorted(a / b for a, b in zip(per_step["native"], per_step["compiled"]))
    print(f"{name}: native {statistics.median(per_step['native']):.2f} ms, compiled "
          f"{statistics.median(per_step['compiled']):.2f} ms per step (median of {rounds}); native / compiled per round "
          f"{' '.join(f'{x:.3f}' for x in ratios)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    p.add_argument("--full", action="store_true", help="every layer and the real vocabulary")
    p.add_argument("--prompt", type=int, default=600)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--speed", action="store_true")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    from infer_tune.scenarios.common import setup_threads

    setup_threads(args.threads)
    for name in args.shapes:
        model = build(name, args.full)
        if args.speed:
            speed(name, model, 40, args.tokens, args.rounds)
        else:
            check(name, model, args.prompt, args.steps)


if __name__ == "__main__":
    main()
