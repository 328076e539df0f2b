"""Perplexity of a real model through the native decode step against its eager int4 path and float.

On `--model` (default gemma3-270m, provisioned by `infer-tune models pull gemma3-270m`), three ways on the
same text:

- float: the model as loaded, eager, teacher-forced (one forward per sequence: metrics/perplexity.py);
- int4 eager: int4-rtn a8 (groups of 32, int8 head: recipes/int4-native.yaml's weights), the same forward
  (with `--bf16-row`, also int4-rtn with its default bf16 activations: what the int8 activations cost);
- int4 native: the same quantized weights, each sequence's context prefilled eagerly and every later target
  predicted by the native step (native/perplexity.py), where `recognize` runs the model (else it exits, with
  the reason: what the lean path records as `lean_native_fallback`);
- with `--window-row`, the native step with every layer's window set to 0 (a wrong step: full attention on the
  sliding layers), on the long sequence only: how much the window moves the figure the check compares.

Text: `chat`, the suite's first `--limit` prompts scored as a result's `ppl` is (the first 128 reference tokens
given the rendered prompt); `long`, one sequence of `--long` tokens (BOS, then the same prompts and references
joined), scored from its second token on, so the native step attends past a sliding window (Gemma 3: 512
positions on 5 of every 6 layers) for every position beyond it.

    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/native_ppl.py --threads 2 --limit 8 --long 1024

Not a test: read the numbers of one run (tests/test_integration_gemma3.py checks a shorter run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def texts(loaded, limit: int, long: int):
    """(chat sequences, the long sequence or None, its length in tokens) of the chat suite's first prompts."""
    from infer_tune.metrics.perplexity import reference_sequences
    from infer_tune.workload import Workload, prepare_inputs

    inputs = prepare_inputs(loaded, Workload(suite="chat", limit=limit, max_new_tokens=1))
    tokenizer = loaded.tokenizer
    chat = reference_sequences(tokenizer, inputs.rendered, [p.reference for p in inputs.prompts])
    joined = "\n\n".join(f"{p.text}\n\n{p.reference}" for p in inputs.prompts if p.reference)
    ids = [tokenizer.bos_token_id] + tokenizer(joined, add_special_tokens=False)["input_ids"]
    ids = ids[:long]
    return chat, ([(ids[:1], ids[1:])] if long and len(ids) > 1 else []), len(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--limit", type=int, default=8, help="chat prompts")
    p.add_argument("--long", type=int, default=1024, help="tokens of the long sequence (0: none)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--bf16-row", action="store_true", help="also int4-rtn with bf16 activations (the default), "
                   "eager: what the int8 activations cost")
    p.add_argument("--window-row", action="store_true", help="also the native step told that no layer slides "
                   "(a wrong step, on the long sequence): what the window changes there")
    args = p.parse_args()
    from infer_tune import models
    from infer_tune.metrics.perplexity import perplexity, sequence_nll
    from infer_tune.native.perplexity import native_sequence_nll
    from infer_tune.native.step import recognize
    from infer_tune.scenarios.common import setup_threads
    from infer_tune.tuners.quantize import QuantizeConfig
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    threads = setup_threads(args.threads)
    loaded = models.load(args.model)
    model = loaded.model
    config = model.config
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or []
    chat, long, long_tokens = texts(loaded, args.limit, args.long)
    print(f"{args.model}: {type(model).__name__}, {loaded.params / 1e6:.1f}M parameters, {threads} threads; "
          f"{sum(k == 'sliding_attention' for k in kinds)} of {len(kinds)} layers slide (window {window}); "
          f"chat: {len(chat)} prompts, {sum(len(t) for _, t in chat)} scored tokens, longest sequence "
          f"{max(len(c) + len(t) for c, t in chat)} tokens; long: {long_tokens} tokens", flush=True)
    rows = {}
    started = time.perf_counter()
    rows["float"] = {name: sequence_nll(model, seqs) for name, seqs in (("chat", chat), ("long", long))}
    print(f"float eager: {time.perf_counter() - started:.1f} s", flush=True)
    if args.bf16_row:
        import copy

        other = copy.deepcopy(model)
        quantize_in_memory(other, QuantizeConfig(method="int4-rtn"), "torch")
        rows["int4 bf16-act"] = {name: sequence_nll(other, seqs) for name, seqs in (("chat", chat), ("long", long))}
        del other
    quantize_in_memory(model, QuantizeConfig(method="int4-rtn", activations="int8"), "torch")
    parts, why = recognize(model)
    if parts is None:
        raise SystemExit(f"{args.model}: the native step does not run this model ({why})")
    started = time.perf_counter()
    rows["int4 eager"] = {name: sequence_nll(model, seqs) for name, seqs in (("chat", chat), ("long", long))}
    print(f"int4 eager: {time.perf_counter() - started:.1f} s", flush=True)
    started = time.perf_counter()
    rows["int4 native"] = {name: native_sequence_nll(model, parts, seqs) for name, seqs in (("chat", chat), ("long", long))}
    print(f"int4 native: {time.perf_counter() - started:.1f} s (windows per layer {parts['windows']})", flush=True)
    if args.window_row and long:
        ints = list(parts["ints"])
        ints[10::2] = [0] * len(parts["windows"])  # each layer's (window, rotary table): every window 0
        rows["no window"] = {"chat": (0.0, 0), "long": native_sequence_nll(model, dict(parts, ints=ints), long)}
    print(f"{'':12} {'chat ppl':>10} {'long ppl':>10}   (native vs int4 eager)")
    eager = {name: perplexity(*value) for name, value in rows["int4 eager"].items()}
    for label, row in rows.items():
        ppl = {name: perplexity(*value) for name, value in row.items()}
        cells = " ".join(f"{ppl[n]:10.4f}" if ppl[n] is not None else f"{'-':>10}" for n in ("chat", "long"))
        vs = "  ".join(f"{n} {100 * (ppl[n] / eager[n] - 1):+.3f}%" for n in ("chat", "long")
                       if ppl[n] is not None and label in ("int4 native", "no window"))
        print(f"{label:12} {cells}   {vs}")


if __name__ == "__main__":
    main()
