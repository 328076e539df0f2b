"""The native kernels as they are against the same kernels at an earlier git revision, interleaved in one process.

Builds the revision's `infer_tune/native/` C++ sources into a library of their own (op
namespace `ab_native`, `-O3 -march=native -fopenmp` like `infer_tune/native`), then times, in `--rounds`
interleaved rounds (order alternating), on SmolLM2-135M's shapes with random data:

- `w4a8_mm` over one model's 120 int4 layers (q|k|v, o, gate|up, down x 30, each layer its own weights, so
  they stream from memory as in a decode step) at 1 and 4 rows, each side's weights packed by its own
  revision's `pack_w4a8` (the layout may differ), after checking both give the same values;
- `w8a8_mm` as SmolLM2's int8 head (576 -> 49152, 28 MB) at 1 and 4 rows, after the same check;
- `decode_attention` over 30 layers' caches (9 query heads, 3 kv heads of 64) at 64, 512 and 1024
  positions, and 240 seen of a 512-position cache (a run's one cache), 1 and 4 rows;
- with `--parts prefill`, `w4a8_mm` over one layer's four matrices at a prompt's rows (`--prefill-rows`,
  default 16, 40 and 500), after checking both give the same values bit for bit;
- with `--ttft-tokens N`, only the lean path's TTFT (eager prefill, int4-rtn a8) at a prompt of about N
  tokens, the int4 layers on each revision's `w4a8_mm` in turn;
- with `--step`, only the native decode step (LlamaStep) of both revisions on the model's int4 a8 weights.

Prints each side's median and the 95% interval of the per-round time ratio (now / then).

    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/native_ab.py --against HEAD~1 --threads 2

Not a test: read the ratios of one run.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import parser  # noqa: E402


def at_revision(rev: str, path: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True,
                          check=True).stdout


def build_then(rev: str, folder: Path) -> None:
    from torch.utils import cpp_extension

    sources = []
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "infer_tune/native/"],
                            capture_output=True, text=True, check=True).stdout.split()
    for path in listed:  # every C++ source and header of the revision
        name = Path(path).name
        if not name.endswith((".cpp", ".h")):
            continue
        target = folder / name
        # its own op namespace, and its own C++ class names (a class is registered by its C++ type)
        target.write_text(at_revision(rev, path).replace("infer_tune_native", "ab_native").replace("LlamaStep", "AbLlamaStep"))
        if name.endswith(".cpp"):
            sources.append(str(target))
    cpp_extension.load(name="ab_native", sources=sources, build_directory=str(folder), is_python_module=False,
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])


def pack_then(rev: str):
    """The revision's pack_w4a8 (and what it calls from its module)."""
    source = at_revision(rev, "infer_tune/tuners/quantize/modules.py")
    namespace: dict = {}
    exec(compile(source, f"{rev}:modules.py", "exec"), namespace)  # noqa: S102 - this repository's own source
    return namespace["pack_w4a8"]


def interleaved(now, then, rounds: int) -> tuple[float, float, dict]:
    from infer_tune.metrics.stats import log_ratio_interval

    now(), then()  # once each before timing: scratch buffers, threads, first touches
    a, b = [], []
    for r in range(rounds):
        pair = [(a, now), (b, then)]
        for out, fn in (pair if r % 2 == 0 else pair[::-1]):
            started = time.perf_counter_ns()
            fn()
            out.append((time.perf_counter_ns() - started) / 1e6)
    return statistics.median(a), statistics.median(b), log_ratio_interval([x / y for x, y in zip(a, b)])


def llama_only(parts: dict) -> dict:
    """`recognize`'s parts of a Llama model in the step's earlier arguments (9 tensors a layer: input norm, q, k,
    v, o, post-attention norm, gate, up, down; 8 ints; eps, scale, rotary scale; one rotary table)."""
    from infer_tune.native.step import PER_LAYER

    layers, tensors = parts["ints"][0], parts["tensors"]
    if any(t.numel() for layer in range(layers) for t in tensors[layer * PER_LAYER + 9:(layer + 1) * PER_LAYER]):
        raise SystemExit("the earlier revision's step runs Llama only (no biases, head norms or post norms)")
    old = [tensors[layer * PER_LAYER + i] for layer in range(layers) for i in (0, 1, 2, 3, 4, 8, 5, 6, 7)]
    floats = parts["floats"]
    return {**parts, "tensors": old + tensors[layers * PER_LAYER:], "inv_freq": parts["inv_freq"][0],
            "ints": parts["ints"][:8], "floats": [floats[0], floats[1], floats[3]]}


def step_rounds(args):
    """Both revisions' LlamaStep on the same quantized weights, each on its own copy of a prefilled cache."""
    import copy

    from transformers import StaticCache

    from infer_tune import models
    from infer_tune.native.step import llama_step, recognize
    from infer_tune.tuners.quantize import QuantizeConfig, kernel_choice
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    loaded = models.load(args.model)
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Write quicksort in Python."}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    model = copy.deepcopy(loaded.model)
    quantize_in_memory(model, QuantizeConfig(method="int4-rtn", activations="int8"), "torch")
    kernel_choice.choose_for_model(model, "int4-rtn", prefill_rows=64, activations="int8")
    parts, why = recognize(model)
    if parts is None:
        raise SystemExit(f"no native step for {args.model}: {why}")
    prompt = ids.shape[1]

    def built(cls, parts=parts):
        cache = StaticCache(config=model.config, max_cache_len=512)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(prompt))
        return llama_step(parts, [c.keys for c in cache.layers], [c.values for c in cache.layers],
                          [c.cumulative_length for c in cache.layers], cls=cls)
    now = built(torch.classes.infer_tune_native.LlamaStep)
    try:
        then = built(torch.classes.ab_native.AbLlamaStep)
    except RuntimeError:  # a revision from before the step ran other families: its Llama-only arguments
        then = built(torch.classes.ab_native.AbLlamaStep, llama_only(parts))
    x = model.get_input_embeddings()(torch.tensor([[42]])).reshape(1, -1)
    same = float((now.step(x, prompt) - then.step(x, prompt)).abs().max())
    print(f"largest logit difference at the first step: {same:.3g}", flush=True)
    steps = 128

    def decode(step):
        return lambda: [step.step(x, prompt + 1 + i) for i in range(steps)]
    now_ms, then_ms, ratio = interleaved(decode(now), decode(then), args.rounds)
    return now_ms / steps, then_ms / steps, ratio


def ttft_rounds(args):
    """The lean path's eager prefill of a prompt of about `--ttft-tokens` tokens (int4-rtn a8, generating one
    token: TTFT) with each revision's w4a8_mm in the int4 layers; everything else is the working tree's."""
    import warnings

    from bench.lean_prefill import prompts
    from infer_tune import models
    from infer_tune.runners.generation import eos_ids
    from infer_tune.tuners.lean.loop import LeanDecoder
    from infer_tune.tuners.quantize import QuantizeConfig, kernel_choice
    from infer_tune.tuners.quantize.modules import Int4A8Linear
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    warnings.filterwarnings("ignore")
    loaded = models.load(args.model)
    model = loaded.model
    quantize_in_memory(model, QuantizeConfig(method="int4-rtn", activations="int8"), "torch")
    kernel_choice.make_traceable(model, kernel_choice.choose_for_model(model, "int4-rtn", prefill_rows=64,
                                                                       activations="int8"))
    eos = eos_ids(model, loaded.tokenizer)
    ids = prompts(loaded.tokenizer, 20, args.ttft_tokens)["long"]
    decoder = LeanDecoder(model, compile=False, compile_prefill=False)
    original = Int4A8Linear._run_w4a8

    def with_op(op):
        def run(self, rows):
            y = op(rows.float().contiguous(), self._w4a8, self.group_size)
            return y if y.shape[1] == self.out_features else y[:, :self.out_features]

        def ttft():
            Int4A8Linear._run_w4a8 = run
            try:
                return decoder.generate(ids, 1, eos)[2]
            finally:
                Int4A8Linear._run_w4a8 = original
        return ttft
    now, then = with_op(torch.ops.infer_tune_native.w4a8_mm), with_op(torch.ops.ab_native.w4a8_mm)
    assert now() == then(), "the two revisions' w4a8 give different first tokens"
    print(f"TTFT of {ids.shape[1]} tokens (lean eager prefill, {args.model} int4-rtn a8, one token generated)")
    return interleaved(now, then, args.rounds)


def show(what: str, result) -> None:
    now, then, ratio = result
    print(f"{what}: now {now:.3f} ms, then {then:.3f} ms; now/then {ratio['point']:.3f} "
          f"[{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}]", flush=True)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--against", default="HEAD~1", help="the git revision to compare with")
    p.add_argument("--step", action="store_true",
                   help="only the native decode step (LlamaStep, both revisions must have it) on the model's int4 a8 "
                        "weights: 128 steps after a short prompt per round")
    p.add_argument("--parts", default="w4a8,w8a8,attention",
                   help="which kernels to time (comma-separated: w4a8, w8a8, attention, attention-prompt, prefill)")
    p.add_argument("--attention-prompt", default="128@2048",
                   help="with --parts attention-prompt: a prompt chunk's rows over its slot's cache (ROWS@POSITION: "
                        "rows at positions POSITION.., one cache shared by the rows), fp32 and int8 caches")
    p.add_argument("--prefill-rows", default="16,40,500",
                   help="with --parts prefill: the row counts of w4a8_mm over one layer's matrices (a prompt's rows)")
    p.add_argument("--ttft-tokens", type=int, default=0,
                   help="only the lean path's TTFT at a prompt of about this many tokens (eager prefill, int4-rtn a8), "
                        "the int4 layers on each revision's w4a8_mm")
    p.set_defaults(rounds=30)
    args = p.parse_args()
    from infer_tune import native
    from infer_tune.scenarios.common import setup_threads
    from infer_tune.tuners.quantize.modules import pack_nibbles, pack_w4a8, pack_w8a8

    setup_threads(args.threads)
    native.w4a8()
    build_then(args.against, Path(tempfile.mkdtemp(prefix="infer-tune-ab-")))
    if args.ttft_tokens:
        show("TTFT", ttft_rounds(args))
        return
    if args.step:
        show(f"native decode step (LlamaStep), {args.model} int4-rtn a8, per step", step_rounds(args))
        return
    now, then = torch.ops.infer_tune_native, torch.ops.ab_native
    print(f"{args.against} against the working tree, {torch.get_num_threads()} threads, {args.rounds} rounds")

    parts = set(args.parts.split(","))
    g, gen = 32, torch.Generator().manual_seed(0)
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    old_pack = pack_then(args.against)
    packed = []
    for k, n in shapes:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        scale, zero = torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3, torch.randn(n, k // g, generator=gen) * 0.01
        nibbles = pack_nibbles(q)
        packed.append((k, pack_w4a8(nibbles, scale, zero, g), old_pack(nibbles, scale, zero, g)))
    first = list(packed)
    packed += [(k, a.clone(), b.clone()) for _ in range(29) for k, a, b in first]  # 30 layers' own weights (67 MB)
    for rows in (1, 4) if "w4a8" in parts else ():
        xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        for k, new_w, old_w in first:
            same = torch.allclose(now.w4a8_mm(xs[k], new_w, g), then.w4a8_mm(xs[k], old_w, g), rtol=1e-5, atol=1e-5)
            assert same, "the two revisions' w4a8 give different values"
        show(f"w4a8_mm, 120 layers, {rows} row(s)", interleaved(
            lambda xs=xs: [now.w4a8_mm(xs[k], w, g) for k, w, _ in packed],
            lambda xs=xs: [then.w4a8_mm(xs[k], w, g) for k, _, w in packed], args.rounds))

    for rows in (int(r) for r in args.prefill_rows.split(",")) if "prefill" in parts else ():
        # one layer's four matrices (q|k|v, o, gate|up, down) at a prompt's rows: compute-bound, so one layer
        xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        for k, new_w, old_w in first:
            assert torch.equal(now.w4a8_mm(xs[k], new_w, g), then.w4a8_mm(xs[k], old_w, g)), \
                "the two revisions' w4a8 give different values"
        show(f"w4a8_mm, one layer's 4 matrices, {rows} rows (prefill)", interleaved(
            lambda xs=xs: [now.w4a8_mm(xs[k], w, g) for k, w, _ in first],
            lambda xs=xs: [then.w4a8_mm(xs[k], w, g) for k, _, w in first], args.rounds))

    head = pack_w8a8(torch.randint(-127, 128, (49152, 576), dtype=torch.int8, generator=gen))
    head_scale = torch.rand(49152, generator=gen) * 0.01
    for rows in (1, 4) if "w8a8" in parts else ():
        x = torch.randn(rows, 576, generator=gen)
        assert torch.equal(now.w8a8_mm(x, head, head_scale), then.w8a8_mm(x, head, head_scale)), \
            "the two revisions' w8a8 give different values"
        show(f"w8a8_mm, the head (576 -> 49152), {rows} row(s)", interleaved(
            lambda x=x: now.w8a8_mm(x, head, head_scale), lambda x=x: then.w8a8_mm(x, head, head_scale), args.rounds))

    for rows in (1, 4) if "attention" in parts else ():
        for length, seen in ((64, 64), (512, 512), (1024, 1024), (512, 240)):  # 240 of 512: one cache per run
            keys = [torch.randn(rows, 3, 1024, 64, generator=gen)[:, :, :length] for _ in range(30)]
            values = [torch.randn(rows, 3, 1024, 64, generator=gen)[:, :, :length] for _ in range(30)]
            q = torch.randn(rows, 9, 1, 64, generator=gen)
            last = torch.tensor([seen - 1, seen // 2, 5, seen - 3][:rows])
            mask = torch.arange(length).view(1, 1, 1, -1) <= last.view(-1, 1, 1, 1)
            assert torch.allclose(now.decode_attention(q, keys[0], values[0], mask, 0.125),
                                  then.decode_attention(q, keys[0], values[0], mask, 0.125), atol=1e-5)
            show(f"decode_attention, 30 layers, {rows} row(s), {seen} of {length} positions", interleaved(
                lambda q=q, mask=mask, kv=list(zip(keys, values)): [now.decode_attention(q, k, v, mask, 0.125) for k, v in kv],
                lambda q=q, mask=mask, kv=list(zip(keys, values)): [then.decode_attention(q, k, v, mask, 0.125) for k, v in kv], args.rounds))

    if "attention-prompt" in parts:  # a prompt chunk's rows in one call, as the native step's prefill makes it
        rows, start = (int(x) for x in args.attention_prompt.split("@"))
        length = start + rows
        k, v = torch.randn(1, 3, length, 64, generator=gen), torch.randn(1, 3, length, 64, generator=gen)
        k8 = torch.randint(-127, 128, (1, 3, length, 64), dtype=torch.int8, generator=gen)
        v8 = torch.randint(-127, 128, (1, 3, length, 64), dtype=torch.int8, generator=gen)
        ks, vs = torch.rand(1, 3, length, generator=gen), torch.rand(1, 3, length, generator=gen)
        q = torch.randn(rows, 9, 1, 64, generator=gen)
        mask = (torch.arange(length).view(1, -1) <= start + torch.arange(rows).view(-1, 1)).view(rows, 1, 1, length)
        e = lambda t: t.expand(rows, *t.shape[1:])  # noqa: E731 - the slot's cache, one for every row
        for kind, one in (("fp32", lambda ops: ops.decode_attention(q, e(k), e(v), mask, 0.125)),
                          ("int8", lambda ops: ops.decode_attention_q8(q, e(k8), e(ks), e(v8), e(vs), mask, 0.125))):
            assert torch.equal(one(now), one(then)), "the two revisions' attention gives different values"
            show(f"decode_attention ({kind} cache), 30 layers, a prompt's {rows} rows at {start}..{length - 1}",
                 interleaved(lambda one=one: [one(now) for _ in range(30)],
                             lambda one=one: [one(then) for _ in range(30)], args.rounds))


if __name__ == "__main__":
    main()
