"""The scaling table: infer-tune's int4 a8 lean path with the native decode step against llama.cpp's fastest
format made from the same weights, per model size, side by side in one run.

Sizes (`--models`): SmolLM2-135M (the built-in, real weights), and architecture presets with seeded random weights
(`--weights random`: speed does not depend on the values of the weights): llama-3.2-1b, qwen3-1.7b,
llama-3.2-3b, qwen3-4b, llama-3.1-8b. `--prepare` makes, once, what the timed run reads (outside the timed run,
a build is not what it measures):

- each preset's random checkpoint, saved as bf16 safetensors with the SmolLM2 tokenizer the prompts use
  (`$INFER_TUNE_HOME/models/random-<preset>-seed<seed>`), written shard by shard (`make_checkpoint`: 2 GiB
  shards and their index, never the whole model in memory: the 8B checkpoint, 16 GB, was written with the
  host's memory use peaking at 4.4 GiB);
- llama.cpp's GGUFs of that checkpoint: `convert_hf_to_gguf.py` to f16, `llama-quantize` to the `--formats`
  (default Q4_0, Q4_K_M and Q8_0; infer_tune/engines/llamacpp.py), the f16 file removed afterwards (disk)
  unless `--formats` lists `f16`. At 8B the steps fit one lock hold each: `--formats f16` (checkpoint and
  conversion, 171 s), then `--formats q4_0,q4_k_m` (426 s; the f16 removed after).

Models listed in `--ours-only` (none by default) get no checkpoint and no llama.cpp row; their weights are
drawn directly (weights.RandomWeights).

The timed run measures each model in its own process (its peak RSS is its own): the int4-rtn a8 model built
layer by layer from the checkpoint's tensors (tuners/quantize/apply.quantize_layerwise: no float copy of the
model) at each `--group-size` (32: a bf16 scale and zero per 32 weights, 5.0 bits a weight; 64: 4.5, Q4_0's;
128: 4.25), kernels chosen as `quantize` chooses them (its screen; `--no-screen`: the kernels' defaults, w4a8
and w8a8, what the screen chose at 4B, without its two minutes at 8B), the lean loop with the native step
(infer_tune/native/step.py; its fallback reason if it falls back); llama-bench times the GGUFs of `--formats`
at these prompt lengths and decode length (llama.cpp's own figures, a column of the table; its pick, decode + the
prefills: `e2e`, is what `--served fastest` serves), and llama-server serves every format of `--formats`
(`--served all`, the default), all of them up before the first round. Several groups give one row each against
the same llama.cpp measurement (the peak RSS is then the process's, every build included). Then `--rounds`
rounds, each timing ours at every group and every served format, the order reversed every other round: TTFT of
the ~40-token and the ~500-token prompt (ours: submit to the first token; llama-server: its own
`timings.prompt_ms`, no HTTP in it), and a `--decode-tokens` single-stream decode after the short prompt (ours:
tokens / time between the first and last token; llama-server: `predicted_per_second`, end-of-sequence ignored);
then `--decode-rounds` more rounds of the decode alone. Each metric is compared with the served format at its
best for that metric (the highest median decode, the lowest median TTFT): the ratio ours / theirs is taken per
round (both measured in that round: the host's drift cancels), and the row gives their geometric mean, its 95%
t-interval (metrics/stats.log_ratio_interval) and the verdict on the target (decode >= 1.1x, TTFT <= 1.0x): met
or missed when the interval lies on one side of the line, else inconclusive. Picking the reference on the same
rounds favours llama.cpp, never ours; and since the pick rests on medians, the verdict shown is the worst of the
verdicts against every served format (`by_format`: met only when met against each). `roofline_fraction` as the result documents define it
(metrics/roofline.py): decode tok/s over the ceiling of the weights' bytes plus the KV cache read at the mean
context at the host's measured bandwidth (a cached copy reading: on a shared host it moves by half within
minutes, so the column can read above 1). Beside it, the decode's read against a plain read in the same minutes:
right after ours' decode in each round, a plain read of the step's own integer weights (a sum over each, the
faster of two) gives the GB/s the memory gives a read then; the step's bytes x its tok/s over that rate, per
round, with its 95% t-interval. Peak RSS: ours the process's `ru_maxrss` (the build included), llama-server's
`VmHWM` (the larger of the served formats').

    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/scaling.py --prepare --models llama-3.2-1b
    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/scaling.py --threads 2 --rounds 3 --out scaling.json
    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/scaling.py --models qwen3-1.7b --group-size 64,128 \
        --formats q4_0,q4_k_m --out scaling-1.7b.json
    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/scaling.py --models qwen3-4b --group-size 128 \
        --formats q4_0,q4_k_m --rounds 3 --decode-rounds 9 --no-screen --out scaling-4b.json
    flock /tmp/infer-tune-cpu.lock .venv/bin/python bench/scaling.py --models llama-3.1-8b --group-size 128 \
        --formats q4_k_m --bench-repeats 1 --no-screen --out scaling-8b.json

Not a test: read the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = ("smollm2-135m", "llama-3.2-1b", "qwen3-1.7b", "llama-3.2-3b", "qwen3-4b", "llama-3.1-8b")
OURS_ONLY: tuple[str, ...] = ()  # `--ours-only`: models measured without a llama.cpp row
FORMATS = ("q4_0", "q4_k_m", "q8_0")


def checkpoint_dir(preset: str, seed: int) -> Path:
    from infer_tune import paths

    return paths.models_dir() / f"random-{preset}-seed{seed}"


SHARD_BYTES = 2 << 30  # a checkpoint shard: the most bytes of tensors `make_checkpoint` holds at once


def checkpoint_plan(model, shard_bytes: int = SHARD_BYTES) -> list[list[tuple[str, object]]]:
    """The tensors `save_pretrained` would save of a skeleton (`weights.skeleton`: matrices on the meta device),
    in its order, cut into shards of at most `shard_bytes` (a larger tensor alone in its own): per shard
    [(name, the skeleton's tensor)]. Tied tensors once, under their first owner's name (the embedding, as a
    state dict without its tied head); persistent buffers included."""
    entries, seen = [], set()
    for name, param in model.named_parameters():  # remove_duplicate: a tied head's weight is its embedding's
        if id(param) not in seen:
            seen.add(id(param))
            entries.append((name, param))
    for prefix, module in model.named_modules():
        for key, buf in module._buffers.items():
            if buf is not None and key not in module._non_persistent_buffers_set:
                entries.append((f"{prefix}.{key}" if prefix else key, buf))
    shards, size = [[]], 0
    for name, tensor in entries:
        n = tensor.numel() * tensor.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += n
    return shards


def make_checkpoint(preset: str, seed: int, shard_bytes: int = SHARD_BYTES) -> Path:
    """The preset with seeded random weights saved as a bf16 safetensors checkpoint with the SmolLM2 tokenizer;
    made once. Written shard by shard (`checkpoint_plan`), never the whole model in memory: the skeleton's
    matrices stay on the meta device, each shard's tensors are drawn (weights.random_values: the values
    `RandomWeights.build` gives, one tensor at a time), saved as `model-0000i-of-0000n.safetensors` and
    dropped before the next; `model.safetensors.index.json` maps every tensor to its shard, as
    `save_pretrained` writes a sharded checkpoint. At most one shard (2 GiB) and one tensor's fp32 draw are in
    memory: an 8B checkpoint (16 GB) is written in about 5 GiB."""
    import torch
    from safetensors.torch import save_file

    from infer_tune import atomic, models, weights

    target = checkpoint_dir(preset, seed)
    if (target / "config.json").is_file():
        return target
    config, source = weights.architecture_config(preset)
    tokenizer, name = models.random_tokenizer(weights.vocab_size(config))
    spec = weights.RandomWeights(config=config, seed=seed, dtype=torch.bfloat16, source=source, tokenizer=name)
    model = spec.skeleton()
    values = spec.values()
    plan = checkpoint_plan(model, shard_bytes)
    weight_map, total = {}, 0
    with atomic.staged_dir(target, exists="keep") as staging:
        for i, shard in enumerate(plan):
            file = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
            tensors = {}
            for key, tensor in shard:
                made = values(key, tensor.shape, torch.bfloat16) if tensor.is_meta else tensor.detach().clone()
                tensors[key] = made.contiguous()
                weight_map[key] = file
                total += made.numel() * made.element_size()
            save_file(tensors, str(staging / file), metadata={"format": "pt"})
            del tensors
        atomic.write_json(staging / "model.safetensors.index.json",
                          {"metadata": {"total_size": total}, "weight_map": weight_map})
        model.config.save_pretrained(staging)
        if model.can_generate() and model.generation_config is not None:
            model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        atomic.write_json(staging / "infer_tune_source.json",
                          {"random_weights": spec.describe(), "dtype": "bfloat16", "shards": len(plan)})
    return target


def prepare(names: list[str], seed: int, ours_only: set[str], threads: int, formats=FORMATS) -> None:
    from infer_tune import models
    from infer_tune.engines import llamacpp

    for name in names:
        if name in ours_only:
            print(f"{name}: ours only (no checkpoint, no GGUF)")
            continue
        started = time.monotonic()
        folder = Path(models.resolve(name)) if name in models.BUILTINS else make_checkpoint(name, seed)
        made = [llamacpp.gguf(folder, fmt, threads=threads) for fmt in formats]
        f16 = made[0].parent / "f16.gguf"
        if f16.is_file() and "f16" not in formats:
            f16.unlink()  # only the quantized formats are timed; the conversion is the disk's largest file
        print(f"{name}: {folder}, {', '.join(f'{p.name} {p.stat().st_size / 2**30:.2f} GiB' for p in made)} "
              f"({time.monotonic() - started:.0f} s)", flush=True)


# --------------------------------------------------------------------------- one model, in its own process
def refuse(line: str) -> None:
    """Bad input: one line, exit 2."""
    print(f"scaling: {line}", file=sys.stderr)
    raise SystemExit(2)


def group_sizes(text: str) -> list[int]:
    """`--group-size`: comma-separated int4 groups, each a multiple of 32 the quantizer takes (config.INT4_GROUP_SIZES)."""
    from infer_tune.tuners.quantize.config import INT4_GROUP_SIZES

    words = [g.strip() for g in text.split(",") if g.strip()]
    groups = [int(g) for g in words] if all(g.isdigit() for g in words) else []
    if not groups or any(g not in INT4_GROUP_SIZES for g in groups) or len(set(groups)) != len(groups):
        refuse(f"--group-size takes distinct values of {', '.join(map(str, INT4_GROUP_SIZES))} separated by "
               f"commas; got {text!r}")
    return groups


def build_int4(name: str, seed: int, ours_only: set[str], group: int = 32):
    """(tokenizer, int4 a8 model in groups of `group`, quantize's summary, its config, the weights' source,
    seconds): built layer by layer from the checkpoint's tensors (or the seed's), kernels at their defaults."""
    import torch

    from infer_tune import models, weights
    from infer_tune.tuners.quantize import QuantizeConfig, apply

    qconfig = QuantizeConfig(method="int4-rtn", activations="int8", group_size=group)
    if name in models.BUILTINS:
        folder = Path(models.resolve(name))
        config, _ = weights.architecture_config(str(folder))
        values = weights.safetensors_values(folder)
        from transformers import AutoTokenizer

        tokenizer, source = AutoTokenizer.from_pretrained(folder), f"{name} (real weights)"
    else:
        config, _ = weights.architecture_config(name)
        tokenizer, _ = models.random_tokenizer(weights.vocab_size(config))
        if name in ours_only:
            values, source = weights.random_values(seed, float(config.initializer_range)), f"random:{seed} (drawn)"
        else:
            folder = checkpoint_dir(name, seed)
            values, source = weights.safetensors_values(folder), f"random:{seed} ({folder.name}, bf16)"
    started = time.monotonic()
    model = weights.skeleton(config, torch.float32, seed)
    if name in models.BUILTINS or name not in ours_only:  # the checkpoint's vectors (norms), not the constructor's
        with torch.no_grad():
            for key, param in model.named_parameters():
                if not param.is_meta:
                    try:
                        param.copy_(values(key, param.shape, param.dtype))
                    except models.ModelError:
                        pass  # not in the checkpoint: the constructor's value is the saved one
    summary = apply.quantize_layerwise(model, weights.Filler(model, values), qconfig)
    return tokenizer, model.eval(), summary, qconfig, source, time.monotonic() - started


def build_ours(name: str, seed: int, ours_only: set[str], group: int = 32, screen: bool = True):
    """(tokenizer, int4 a8 model in groups of `group`, facts): `build_int4`; kernels chosen by quantize's screen
    (`screen`), else left at their default (w4a8 where the native kernels build: what the screen chose at every
    size measured here)."""
    from infer_tune import weights
    from infer_tune.tuners.quantize import kernel_choice

    tokenizer, model, _, _, source, build_s = build_int4(name, seed, ours_only, group)
    started = time.monotonic()
    if screen:
        record = kernel_choice.choose_for_model(model, "int4-rtn", prefill_rows=64, group_size=group,
                                                activations="int8")
        kernels = {k: (v or {}).get("chosen") for k, v in record.items() if isinstance(v, dict)}
    else:
        kernels = sorted({f"{type(m).__name__}: {m.decode_kernel} / {m.prefill_kernel} (default, not screened)"
                          for m in model.modules() if hasattr(m, "decode_kernel")})
    return tokenizer, model, {"weights": source, "group_size": group, "build_s": round(build_s, 1),
                              "screen_s": round(time.monotonic() - started, 1) if screen else None,
                              "params": weights.count_params(model.config), "kernels": kernels}


def phase(line: str) -> None:
    """The child's progress on stderr (a run stopped by its time limit still shows how far it got)."""
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def hwm_bytes(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((x for x in text.splitlines() if x.startswith("VmHWM:")), None)
    return int(line.split()[1]) * 1024 if line else None


METRICS = ("ttft_short", "ttft_long", "decode")
TARGETS = {"decode": (">=", 1.1), "ttft_short": ("<=", 1.0), "ttft_long": ("<=", 1.0)}  # issue "Real sizes"


def best_served(theirs: dict[str, dict[str, list[float]]], metric: str) -> str:
    """The served format at its best for `metric`: the highest median decode, the lowest median TTFT."""
    pick = max if metric == "decode" else min
    return pick(theirs, key=lambda f: statistics.median(theirs[f][metric]))


def ratio(ours: list[float], theirs: list[float], metric: str, against: str) -> dict:
    """ours / theirs per round (each pair measured in the same round), their geometric mean and its 95%
    t-interval (metrics/stats.log_ratio_interval), and the verdict on the metric's target: met when the interval
    lies on the target's side, missed when it lies on the other, else inconclusive."""
    from infer_tune.metrics.stats import log_ratio_interval

    per_round = [o / t for o, t in zip(ours, theirs) if o and t]
    out = {"against": against, "per_round": per_round, **(log_ratio_interval(per_round) or {})}
    side, line = TARGETS[metric]
    low, high = out.get("ci95") or (None, None)
    if low is None:
        out["verdict"] = "inconclusive (fewer than 2 rounds)"
    elif (low >= line) if side == ">=" else (high <= line):
        out["verdict"] = "met"
    elif (high < line) if side == ">=" else (low > line):
        out["verdict"] = "missed"
    else:
        out["verdict"] = "inconclusive"
    out["target"] = f"{side} {line}"
    return out


def read_probe(model) -> tuple[list, int]:
    """(the native step's integer weight tensors, the bytes the step reads a token): what the probe after each decode reads (env.read_gb_s)."""
    import torch

    from infer_tune.native.step import recognize

    parts, _ = recognize(model)
    tensors = [t for t in (parts or {}).get("tensors", []) if t.numel()]
    return [t for t in tensors if t.dtype in (torch.uint8, torch.int8)], sum(t.numel() * t.element_size() for t in tensors)


SEVERITY = ("met", "inconclusive", "missed")  # a verdict against every served format: the worst of them


def judged(ours: list[float], theirs: dict[str, dict[str, list[float]]], metric: str, against: str) -> dict:
    """`ratio` against the format at its best for `metric` (the one shown), whose verdict is the worst of the
    verdicts against every served format (`by_format`): which format is best is read from medians, so the
    verdict does not rest on that pick."""
    shown = ratio(ours, theirs[against][metric], metric, against)
    by_format = {f: ratio(ours, t[metric], metric, f) for f, t in theirs.items()}
    shown["by_format"] = {f: {k: r.get(k) for k in ("point", "ci95", "verdict")} for f, r in by_format.items()}

    def severity(r: dict) -> int:  # "inconclusive (fewer than 2 rounds)" is an inconclusive
        return SEVERITY.index(r["verdict"].split(" ")[0])

    worst = max(by_format.values(), key=severity)
    if severity(worst) > severity(shown):
        shown["verdict"] = f"{worst['verdict']} (against {worst['against'].upper()})"
    return shown


def measure_one(args) -> list[dict]:
    """One model's rows, one per `--group-size`, against one llama.cpp measurement."""
    import torch

    from bench.lean_prefill import prompts, roofline_line, server_completion
    from infer_tune import models
    from infer_tune.endpoint.servers import local_server
    from infer_tune.engines import llamacpp
    from infer_tune.env import bandwidth_reading, read_gb_s
    from infer_tune.metrics import kv, roofline
    from infer_tune.runners.generation import eos_ids
    from infer_tune.scenarios.common import setup_threads
    from infer_tune.tuners.lean.loop import LeanDecoder

    warnings.filterwarnings("ignore")
    setup_threads(args.threads)
    name, ours_only = args.one, set(args.ours_only)
    groups = group_sizes(args.group_size)
    built = []  # (model, facts, decoder) per group
    for group in groups:
        tokenizer, model, facts = build_ours(name, args.seed, ours_only, group, screen=not args.no_screen)
        cases = prompts(tokenizer, args.short, args.long)
        eos = eos_ids(model, tokenizer)
        decoder = LeanDecoder(model, compile=False, native_step=True)
        decoder.reserve(max(ids.shape[1] for ids in cases.values()) + args.decode_tokens)
        for ids in cases.values():
            decoder.generate(ids, 4, eos)  # first calls (the native step's cache, the kernels' buffers)
        facts.update({k: decoder.facts.get(k) for k in ("lean_step", "lean_native_fallback", "lean_prefill")})
        built.append((model, facts, decoder))
        phase(f"{name} g{group}: built in {facts['build_s']} s (screen {facts['screen_s']} s), warmed")
    common = {"prompt_tokens": {c: int(ids.shape[1]) for c, ids in cases.items()},
              "threads": torch.get_num_threads(), "rounds": args.rounds, "decode_rounds": args.decode_rounds,
              "decode_tokens": args.decode_tokens}
    ours = [{m: [] for m in METRICS} for _ in built]
    probe_tensors, step_bytes = zip(*(read_probe(model) for model, _, _ in built))
    probes: list[list[float | None]] = [[] for _ in built]
    theirs: dict[str, dict[str, list[float]]] = {}  # format -> metric -> one sample a round
    reference, servers = None, {}
    with contextlib_exit() as stack:
        if name not in ours_only:
            folder = Path(models.resolve(name)) if name in models.BUILTINS else checkpoint_dir(name, args.seed)
            lengths = [int(ids.shape[1]) for ids in cases.values()]
            formats = [f for f in args.formats.split(",") if f]
            chosen = llamacpp.best(folder, lengths, args.decode_tokens, args.threads, repeats=args.bench_repeats,
                                   formats=formats)
            reference = {"fastest": chosen.format, "objective": chosen.objective,
                         "formats": {t.format: t.to_dict(args.decode_tokens) for t in chosen.timings},
                         "commit": chosen.llama_cpp.get("commit"), "build": chosen.llama_cpp.get("build_number"),
                         "served_formats": args.served}
            phase(f"llama-bench: {chosen.format} fastest ({chosen.objective})")
            serve = {t.format: t.gguf for t in chosen.timings} if args.served == "all" else {chosen.format: chosen.gguf}
            for fmt, path in serve.items():  # every server up before the rounds: each round times them all
                servers[fmt] = stack.enter_context(local_server("llama.cpp", str(path), threads=args.threads))
                theirs[fmt] = {m: [] for m in METRICS}
                for ids in cases.values():
                    server_completion(servers[fmt].url, tokenizer.decode(ids[0]), 4)  # warms the server
        short_text = tokenizer.decode(cases["short"][0])
        who_all = [*range(len(built)), *servers]
        for r in range(args.rounds + args.decode_rounds):
            ttft = r < args.rounds  # the --decode-rounds after them time the decode alone
            for who in (who_all if r % 2 == 0 else who_all[::-1]):  # who goes first alternates
                if isinstance(who, int):
                    decoder = built[who][2]
                    for case, ids in (cases.items() if ttft else ()):
                        submit, token_ns, _, _ = decoder.generate(ids, 1, eos)
                        ours[who][f"ttft_{case}"].append((token_ns[0] - submit) / 1e6)
                    _, token_ns, _, _ = decoder.generate(cases["short"], args.decode_tokens, eos)
                    ours[who]["decode"].append((len(token_ns) - 1) * 1e9 / (token_ns[-1] - token_ns[0]))
                    probes[who].append(read_gb_s(probe_tensors[who]))  # the same minute's read of its bytes
                else:
                    for case, ids in (cases.items() if ttft else ()):
                        answer, _ = server_completion(servers[who].url, tokenizer.decode(ids[0]), 1)
                        theirs[who][f"ttft_{case}"].append(answer["timings"]["prompt_ms"])
                    answer, _ = server_completion(servers[who].url, short_text, args.decode_tokens)
                    theirs[who]["decode"].append(answer["timings"]["predicted_per_second"])
            phase(f"round {r + 1} of {args.rounds + args.decode_rounds}{'' if ttft else ' (decode)'}: ours "
                  f"{[round(o['decode'][-1], 2) for o in ours]}, llama-server "
                  f"{ {f: round(t['decode'][-1], 2) for f, t in theirs.items()} } tok/s")
        if servers:
            reference["peak_rss_bytes"] = max(hwm_bytes(s.process.pid) or 0 for s in servers.values()) or None
            reference["served_all"] = {f: {m: statistics.median(v) for m, v in t.items()} for f, t in theirs.items()}
            reference["served_format"] = {m: best_served(theirs, m) for m in METRICS}
            reference["served"] = {m: reference["served_all"][f][m] for m, f in reference["served_format"].items()}
            reference["samples"] = theirs
    mean_context = cases["short"].shape[1] + args.decode_tokens / 2
    reading = bandwidth_reading()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = []
    for i, ((model, facts, _), samples) in enumerate(zip(built, ours)):
        row = {"model": name, **facts, **common, "ours": {k: statistics.median(v) for k, v in samples.items()},
               "ours_samples": samples}
        if reference is not None:
            row["llama_cpp"] = reference
            row["ratios"] = {m: judged(samples[m], theirs, m, f) for m, f in reference["served_format"].items()}
        row["roofline"] = roofline_line(model, mean_context, row["ours"]["decode"])
        # each round's decode over the ceiling of the read right after it; a mean above 1 is refused (roofline)
        by_round = roofline.by_round(probes[i], [1000.0 / tok_s for tok_s in samples["decode"]], step_bytes[i])
        row["read_fraction"] = {"step_bytes": step_bytes[i], "plain_read_gb_s": probes[i], **(by_round or {})}
        kv_read = kv.kv_bytes(kv.ModelShape.from_config(model.config), 1, 32) * mean_context
        row["model_bytes"] = models.model_bytes(model)
        row.update(roofline.roofline(reading["gb_s"], row["model_bytes"], kv_read, 1, 1000.0 / row["ours"]["decode"]))
        row["bandwidth"] = reading
        row["peak_rss_bytes"] = peak
        row["peak_rss_groups"] = groups  # the process's peak: every group's build included
        rows.append(row)
    return rows


def contextlib_exit():
    import contextlib

    return contextlib.ExitStack()


# --------------------------------------------------------------------------- the table
def gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def pair(row: dict, key: str, fmt: str) -> str:
    """`ours / theirs (x [low, high] vs FORMAT, verdict)`, or `ours / -` without a llama.cpp row."""
    ours, ref = row["ours"], (row.get("llama_cpp") or {})
    theirs = ref.get("served") or {}
    if not theirs:
        return f"{ours[key]:{fmt}} / -"
    r = (row.get("ratios") or {}).get(key) or {}
    if "ci95" not in r:
        return f"{ours[key]:{fmt}} / {theirs[key]:{fmt}} ({ours[key] / theirs[key]:.2f}x)"
    low, high = r["ci95"]
    return (f"{ours[key]:{fmt}} / {theirs[key]:{fmt}} ({r['point']:.2f}x [{low:.2f}, {high:.2f}] vs "
            f"{r['against'].upper()}, {r['verdict']})")


def fraction_cell(row: dict) -> str:
    """The row's roofline_fraction against the host's reading, or its refusal (above 1: not a result)."""
    if row.get("roofline_fraction") is None:
        return "refused (>1)" if row.get("roofline_refused") else "-"
    return f"{row['roofline_fraction']:.2f}"


def read_cell(read: dict) -> str:
    if read.get("roofline_refused"):
        return "refused (>1: the read was not the decode's ceiling)"
    if not read.get("roofline_fraction_ci95"):
        return "-"
    low, high = read["roofline_fraction_ci95"]
    return f"{read['roofline_fraction']:.2f} [{low:.2f}, {high:.2f}]"


def table(rows: list[dict]) -> str:
    head = ("| model | params | weights | int4 group | decode tok/s ours / llama-server (x [95%] vs its fastest) | "
            "TTFT ~40 tok ms ours / llama-server | TTFT ~500 tok ms ours / llama-server | roofline_fraction | "
            "decode's read / a plain read, same rounds [95%] | peak RSS ours / llama-server | llama-bench's fastest (e2e) |")
    out = [head, "|" + "---|" * 11]
    for row in rows:
        if "error" in row:
            out.append(f"| {row['model']} | - | - | - | failed: {row['error']} | | | | | | |")
            continue
        ref = row.get("llama_cpp") or {}
        tokens = row["prompt_tokens"]
        out.append(
            f"| {row['model']} | {row['params'] / 1e9:.2f}B | {row['weights']} | g{row.get('group_size', 32)} | "
            f"{pair(row, 'decode', '.1f')} | "
            f"{pair(row, 'ttft_short', '.1f')} ({tokens['short']} tok) | "
            f"{pair(row, 'ttft_long', '.0f')} ({tokens['long']} tok) | "
            f"{fraction_cell(row)} | {read_cell(row.get('read_fraction') or {})} | "
            f"{gib(row['peak_rss_bytes'])} / {gib(ref.get('peak_rss_bytes'))} | "
            f"{(ref.get('fastest') or 'not run').upper()} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--ours-only", default=",".join(OURS_ONLY),
                   help="models measured without a llama.cpp row (no checkpoint or GGUF made)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-rounds", type=int, default=0,
                   help="more rounds after --rounds that time the decode alone (a tighter decode interval)")
    p.add_argument("--served", choices=("all", "fastest"), default="all",
                   help="llama-server serves every format of --formats, each metric compared with its best "
                        "(all), or only llama-bench's fastest end to end (fastest)")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--short", type=int, default=40)
    p.add_argument("--long", type=int, default=500)
    p.add_argument("--bench-repeats", type=int, default=2, help="llama-bench -r when it picks the fastest format")
    p.add_argument("--group-size", default="32",
                   help="int4 groups of ours, comma-separated (32: 5.0 bits a weight, 64: 4.5, 128: 4.25); one row each")
    p.add_argument("--formats", default=",".join(FORMATS), help="the llama.cpp formats llama-bench picks the fastest of; q4_0-default etc.: llama-quantize's own head type (else Q8_0)")
    p.add_argument("--no-screen", action="store_true",
                   help="skip quantize's kernel screen (its minutes at 8B): the kernels' defaults (w4a8)")
    p.add_argument("--prepare", action="store_true", help="make the checkpoints and GGUFs, time nothing")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: one model, its row as JSON
    args = p.parse_args()
    args.ours_only = [m for m in args.ours_only.split(",") if m]
    names = [m for m in args.models.split(",") if m]
    groups = group_sizes(args.group_size)
    # --prepare also takes f16: the conversion kept for a later --prepare (one lock hold per step at 8B)
    # a format may end in -default: llama-quantize's own head and embedding types instead of Q8_0
    unknown = sorted(set(f for f in args.formats.split(",") if f) - set(FORMATS) - {f"{f}-default" for f in FORMATS}
                     - ({"f16"} if args.prepare else set()))
    if unknown or not args.formats.strip(","):
        refuse(f"--formats takes some of {', '.join(FORMATS)} (each may end in -default: llama-quantize's own "
               f"head type); got {args.formats!r}")
    if args.one:
        # SIGTERM (a `timeout` of the run) leaves through the context managers, as Ctrl-C does: llama-server (its own
        # session, not in this process group) is stopped, not left serving after the run (it was, once)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        for row in measure_one(args):
            print("ROW " + json.dumps(row), flush=True)
        return
    if args.prepare:
        prepare(names, args.seed, set(args.ours_only), args.threads, [f for f in args.formats.split(",") if f])
        return
    rows = []
    for name in names:
        started = time.monotonic()
        cmd = [sys.executable, __file__, "--one", name, "--ours-only", ",".join(args.ours_only) or ",",
               "--seed", str(args.seed), "--threads", str(args.threads), "--rounds", str(args.rounds),
               "--decode-rounds", str(args.decode_rounds), "--served", args.served,
               "--decode-tokens", str(args.decode_tokens), "--short", str(args.short), "--long", str(args.long),
               "--bench-repeats", str(args.bench_repeats), "--group-size", args.group_size, "--formats", args.formats,
               *(["--no-screen"] if args.no_screen else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=dict(os.environ))
        found = [x for x in proc.stdout.splitlines() if x.startswith("ROW ")]
        if proc.returncode != 0 or not found:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            made = [{"model": name, "error": f"exit {proc.returncode}: {tail[-300:]}"}]
        else:
            made = [json.loads(x[4:]) for x in found]
        for row in made:
            row["wall_s"] = round(time.monotonic() - started, 1)
        rows += made
        print(f"{name}: {made[0].get('error') or 'done'} ({made[0]['wall_s']} s)", file=sys.stderr, flush=True)
        if args.out:
            from infer_tune import atomic

            atomic.write_json(Path(args.out), rows)
        if len(rows) == 1 and "error" in rows[0]:
            break  # the first model failed: the others would fail the same way
    from infer_tune.env import bandwidth_reading

    reading = bandwidth_reading()
    served = (f"llama-server on each of {args.formats}, every metric against the format at its best for it"
              if args.served == "all" else f"llama-server on the format llama-bench found fastest of {args.formats}")
    print(f"{args.threads} threads, {args.rounds} rounds + {args.decode_rounds} decode-only (alternating who goes "
          f"first), decode {args.decode_tokens} tokens after the short prompt, bandwidth {reading['gb_s']:.1f} GB/s "
          f"({reading['source']}); ours: int4-rtn a8 {'/'.join(f'g{g}' for g in groups)}, lean + native step; "
          f"llama.cpp: {served}; intervals: 95% t on the per-round log ratios")
    print(table(rows))
    for row in rows:
        if "roofline" in row:
            print(f"{row['model']} g{row.get('group_size', 32)}: {row['roofline']}; build {row.get('build_s')} s, "
                  f"screen {row.get('screen_s')} s, kernels {row.get('kernels')}; step {row.get('lean_step')}"
                  + (f" (fallback: {row['lean_native_fallback']})" if row.get("lean_native_fallback") else "")
                  + ("; llama-bench: " + "; ".join(
                      f"{f} {t['decode_tok_s'] or 0:.1f} tok/s, "
                      + ", ".join(f"pp{n} {ms:.0f} ms" for n, ms in t["prefill_ms"].items())
                      for f, t in row["llama_cpp"]["formats"].items()) if row.get("llama_cpp") else ""))


if __name__ == "__main__":
    main()
