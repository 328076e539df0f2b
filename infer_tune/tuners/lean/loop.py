"""The lean greedy decode loop: a static KV cache, the decode step compiled once, nothing else per token.

What `generate()` does per step and this loop does not: logits-processor and stopping-criteria
lists, cache bookkeeping objects, streamer calls, `model_kwargs` updates, attention-mask growth.
What it keeps: the same model forward on the same cache layout (asked for the last position's logits
only, as `generate()` asks), fp32 logits of that position,
end-of-sequence suppressed exactly as the generation runner pins length (the step where greedy would
have stopped is recorded), argmax. Greedy output is therefore bit-identical to `generate()` with a
static cache on the same weights (tests/test_tune.py checks it).

Batch size 1, no padding: one sequence, positions from `cache_position`.

How the compiled step runs (`CapturedStep`): `torch.compile` puts a guard check (~10,000 guards on a
30-layer model: every parameter, cache tensor and module attribute) and a Python wrapper around every
call, about 1 ms of each decode step on SmolLM2 (measured with the profiler: "TorchDynamo Cache
Lookup" 1.1 ms/step). The step is instead captured once by dynamo as one graph, checked to be the
same graph at the next position (a cache that keeps per-step Python state, such as a sliding-window
counter, fails this and the step falls back to plain `torch.compile`), int4 matmuls that read the same
input merged into one (fuse.py), compiled by inductor (inside the capture's tracing context, so that inductor's FX
graph cache keys the graph: an identical graph compiled earlier, by this process or another, is loaded, not
compiled again), and then
called directly with the new token: the parameters and cache tensors it reads are the same objects
every step, mutated in place. Measured on SmolLM2 int4 layers (2 threads, 64 tokens after a 173-token
prompt, one-off scripts): with an int4 head, guarded `torch.compile` 6.85 ms/token, captured 6.35;
with the int8 head and the int4 matmuls merged, captured 6.04. Inductor's C++ wrapper (`cpp_wrapper=True`) compiles for 66-115 s instead of about
20 s; interleaved in one process with the Python wrapper it decoded at 177.8 against 165.5 tok/s in one
run and 151.7 against 165.4 in another: an option, off by default, that `tune` measures.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import time
import types
from collections.abc import Sequence

import torch

from infer_tune.runners.prepared import RunCounters

_STEP_IDS = itertools.count()
# inductor's per-call input checks, off in a captured step (its inputs are fixed once captured): about 300 checks
# per SmolLM2 step; `bench/decode_profile.py --ab-checks N` measures what dropping them gains (docs/tune.md)
CHECKED_ONCE = {"size_asserts": False, "alignment_asserts": False}
CACHE_BUCKET = 128  # static caches are sized to multiples of this: one compiled graph per size a run needs


def bucket(needed: int) -> int:
    """The static cache size that holds `needed` positions."""
    return -(-needed // CACHE_BUCKET) * CACHE_BUCKET


class LeanDecoder:
    """Owns the static cache and the compiled decode step of one model."""

    def __init__(self, model: torch.nn.Module, *, compile: bool = True, cpp_wrapper: bool = False,
                 counters: RunCounters | None = None, facts: dict | None = None,
                 compile_prefill: bool = False, native_attention: bool = True, native_step: bool = False,
                 kv_dtype: str = "fp32") -> None:
        self.model = model
        self.kv_dtype = kv_dtype  # the native step's cache: fp32, or int8 (prefilled by the native step too)
        self.compile = compile
        self.native_attention = native_attention
        self.cpp_wrapper = cpp_wrapper
        self.counters = counters if counters is not None else RunCounters()
        self.facts = facts if facts is not None else {}  # how the step ran (`lean_step`), for the result
        self.cache = None
        self._step = None
        self._buckets: dict[int, tuple] = {}  # static cache size -> (cache, its decode step)
        self._reserved = 0  # the most positions a run said it needs (`reserve`)
        # the whole step in one native call (infer_tune/native/step.py) where the model is one it runs exactly;
        # else the compiled (or eager) step, and why not
        self._native_parts = None
        if native_step:
            from infer_tune.native.step import recognize

            self._native_parts, why = recognize(model)
            if self._native_parts is None:
                self.facts["lean_native_fallback"] = why
        if kv_dtype != "fp32" and self._native_parts is None:
            from infer_tune.errors import ConfigError

            raise ConfigError(f"the native step's {kv_dtype} KV cache needs the native step"
                              + (f", which does not run this model ({self.facts['lean_native_fallback']})"
                                 if native_step else " (native_step: true)"))
        # only the last position's logits: the prompt's other positions would cost a head matmul each
        forward_params = inspect.signature(model.forward).parameters
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in forward_params else {}
        # prompts prefill through compiled length buckets (prefill.py) when asked; default eager (docs/tune.md)
        self._prefill = None
        if compile_prefill:
            from infer_tune.tuners.lean.prefill import CompiledPrefill

            self._prefill = CompiledPrefill(model, logits_to_keep=bool(self._extra), facts=self.facts)
        else:
            self.facts["lean_prefill"] = "eager"

    @functools.cached_property
    def one_cache(self) -> bool:
        """Whether every prompt decodes in one cache of the run's largest size (one compile, not one per size).

        True when the compiled step will attend with the native decode attention (the model attends with
        SDPA in fp32 and the kernels build here): it neither reads nor exponentiates the positions the mask
        hides, so a 33-token prompt in a 640-position cache costs what it costs in a 128-position one. Else
        attention reads the whole static cache (masked), so each size a run needs gets its own cache and step.
        """
        if self._native_parts is not None:  # step.cpp attends with the native decode attention
            return True
        if not (self.compile and self.native_attention):
            return False
        from infer_tune.native.attention import register

        config = getattr(self.model, "config", None)
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), None)
        return getattr(config, "_attn_implementation", None) == "sdpa" and dtype == torch.float32 \
            and register() is not None

    def reserve(self, needed: int) -> None:
        """Say the most positions (prompt + new tokens) any request of the run needs: with `one_cache`, the
        first cache is made that large, so the step compiles once for the whole run."""
        self._reserved = max(self._reserved, needed)

    def _ensure_cache(self, needed: int, device: torch.device) -> None:
        """The cache (and compiled step) for `needed` positions: with `one_cache`, the run's one cache (the
        largest reserved or needed so far); else the smallest bucket that holds them (attention reads the
        whole static cache there, so a 33-token prompt decoding in a 640-position cache would pay for 640)."""
        from transformers import StaticCache

        if self.one_cache:
            held = [size for size in self._buckets if size >= needed]
            size = max(held) if held else bucket(max(needed, self._reserved))
        else:
            size = bucket(needed)
        entry = self._buckets.get(size)
        if entry is None:
            cache = StaticCache(config=self.model.config, max_cache_len=size) if self.kv_dtype == "fp32" else None
            if self._native_parts is not None and self.kv_dtype != "fp32":  # a cache only step.cpp reads and writes
                from infer_tune.native.step import NativeCache, NativeCachedStep

                cache = NativeCache(self._native_parts, 1, size, self.kv_dtype)
                step = NativeCachedStep(self.model, cache, self._native_parts)
                self.facts["lean_step"], self.facts["lean_prefill"] = "native", "native rows"
                self.facts["kv_dtype"], self.facts["kv_cache_bytes"] = self.kv_dtype, cache.nbytes
            elif self._native_parts is not None:
                from infer_tune.native.attention import NAME
                from infer_tune.native.step import NativeStep, plain_cache

                cache = plain_cache(self.model.config, size)  # sliding layers full length (masked by position)
                step = NativeStep(self.model, cache, self._native_parts)
                self.facts["lean_step"], self.facts["lean_attention"] = "native", NAME  # step.cpp attends natively
            elif self.compile:
                step = CapturedStep(self.model, cache, self._extra, self.cpp_wrapper, self.facts,
                                    native_attention=self.native_attention)
            else:
                step = _call_model(self.model, cache, self._extra)
                self.facts["lean_step"] = "eager"
            entry = self._buckets[size] = (cache, step)
        elif hasattr(entry[0], "reset"):  # a NativeCache needs none: a position's rows are rewritten before read
            entry[0].reset()
        self.cache, self._step = entry
        self.facts["lean_cache_buckets"] = sorted(self._buckets)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_ids: Sequence[int], *,
                 pin_length: bool = True) -> tuple[int, list[int], list[int], int | None]:
        """Greedy-decode `max_new_tokens` after `input_ids` [1, P].

        Returns (submit_ns, token_ns per token, token ids, natural length or None): with `pin_length`,
        end-of-sequence is suppressed and the step where greedy would have picked it is the natural
        length; without, decoding stops after the first end-of-sequence token.
        """
        prompt_len = input_ids.shape[1]
        self._ensure_cache(prompt_len + max_new_tokens, input_ids.device)
        eos_set = set(eos_ids)
        eos = torch.tensor(sorted(eos_set), dtype=torch.long, device=input_ids.device)
        tokens: list[int] = []
        token_ns: list[int] = []
        natural = None
        forward_ns = 0
        submit_ns = time.perf_counter_ns()
        own_prefill = getattr(self._step, "prefill", None)  # the native step's own cache: its own prefill
        if own_prefill is not None:
            logits = own_prefill(input_ids)
        else:
            logits = self._prefill(input_ids, self.cache) if self._prefill is not None else None
        if logits is None:
            logits = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True,
                                cache_position=torch.arange(prompt_len, device=input_ids.device), **self._extra).logits
        position = torch.tensor([prompt_len], device=input_ids.device)
        for step in range(max_new_tokens):
            scores = logits[:, -1, :].to(dtype=torch.float32)  # as generate() takes them
            token = scores.argmax(-1)  # [1]
            token_id = int(token)
            if token_id in eos_set and pin_length:
                # greedy would stop here: recorded, then end-of-sequence suppressed. Only when the argmax is an
                # end-of-sequence id does suppressing them change it, so the other steps take one argmax.
                if natural is None:
                    natural = step
                scores = scores.clone()
                scores[:, eos] = -float("inf")
                token = scores.argmax(-1)
                token_id = int(token)
            token_ns.append(time.perf_counter_ns())
            tokens.append(token_id)
            if not pin_length and token_id in eos_set:
                break
            if step + 1 == max_new_tokens:
                break
            started = time.perf_counter_ns()
            logits = self._step(token[:, None], position)
            forward_ns += time.perf_counter_ns() - started
            position = position + 1
        decode_steps = max(len(tokens) - 1, 0)
        if decode_steps:
            loop_ns = (token_ns[-1] - token_ns[0]) - forward_ns
            self.counters.add("lean_decode_steps", decode_steps)
            self.counters.add("lean_forward_ms", forward_ns / 1e6)
            self.counters.add("lean_loop_overhead_ms", loop_ns / 1e6)
        return submit_ns, token_ns, tokens, natural


def _call_model(model, cache, extra: dict):
    """The decode step as a function of (token ids, positions) on `cache`: `model` eager or compiled."""
    def step(input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids, past_key_values=cache, use_cache=True, cache_position=cache_position,
                     **extra).logits
    return step


class CapturedStep:
    """The compiled decode step of one model and one static cache, called without dynamo's guards.

    Calls 1 and 2 run through `torch.compile(fullgraph=True)` with a backend that only records the graph
    (eager speed); if dynamo needed one graph for both positions, that graph is compiled by inductor and
    every later call runs it directly. Otherwise (a graph break, or per-step Python state), the step
    is plain guarded `torch.compile` from then on. `facts["lean_step"]` says which ran:
    `captured+cpp` / `captured` / `guarded` (and `lean_step_fallback` why).
    """

    def __init__(self, model: torch.nn.Module, cache, extra: dict, cpp_wrapper: bool, facts: dict,
                 forward=None, native_attention: bool = True) -> None:
        self.model, self.cache, self.extra, self.cpp_wrapper, self.facts = model, cache, extra, cpp_wrapper, facts
        self.native_attention = native_attention
        self.calls = 0
        self.graphs: list = []
        self._current: tuple | None = None
        self._compiled = None
        self._user_slots: tuple[int | None, int | None] = (None, None)
        self._args: list | None = None
        # `forward(input_ids, cache_position) -> logits` on `cache` (default: the model's own forward; the
        # batched slot step of tuners/batch/slots.py passes its own, with per-row positions and mask)
        self._custom = forward is not None
        forward = forward if forward is not None else _call_model(model, cache, extra)
        self._forward = forward
        # dynamo keeps compiled entries per code object (8 at most): each step gets its own
        code = forward.__code__.replace(co_name=f"lean_step_{next(_STEP_IDS)}")
        forward = types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)
        self._capture = torch.compile(forward, backend=self._record, fullgraph=True, dynamic=False)
        self._guarded = None

    def _record(self, gm: torch.fx.GraphModule, example_inputs: list):
        ids, position = self._current
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

        def slot(tensor: torch.Tensor, name: str) -> int | None:
            found = next((i for i, t in enumerate(example_inputs) if t is tensor), None)
            return found if found is not None else next((i for i, n in enumerate(names) if n == name), None)
        slots = (slot(ids, "l_input_ids_"), slot(position, "l_cache_position_"))
        # dynamo's tracing context (its fake tensors and shape env): inductor's FX graph cache keys a graph with it,
        # and bypasses the cache without it ("No shape env"), so the graph is compiled inside it (`_compile`)
        self.graphs.append((gm, list(example_inputs), slots, torch._guards.TracingContext.try_get()))
        return gm.forward

    def __call__(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        if self._compiled is not None:
            args = self._args
            ids_slot, position_slot = self._user_slots
            args[ids_slot] = input_ids
            if position_slot is not None:
                args[position_slot] = cache_position
            out = self._compiled(*args)
            return out[0] if isinstance(out, (list, tuple)) else out
        if self._guarded is not None:
            return self._guarded(input_ids, cache_position)
        self.calls += 1
        self._current = (input_ids, cache_position)
        try:
            from infer_tune.native.attention import attending

            with attending(self.model, self.native_attention) as used:  # traced into the graph (attention.py)
                logits = self._capture(input_ids, cache_position)
            self.facts["lean_attention"] = used
        except Exception as exc:  # a graph break (fullgraph) or a capture failure: the guarded path
            return self._fall_back(f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
                                   input_ids, cache_position)
        if self.calls == 2:
            if len(self.graphs) != 1 or self.graphs[0][2][0] is None:
                self._fall_back("the step's graph changes with the position (per-step Python state)")
            else:
                self._compile()
        return logits

    def _compile(self) -> None:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        from infer_tune.tuners.lean.fuse import fuse_int4_siblings

        gm, example_inputs, slots, context = self.graphs[0]
        example_inputs, fused = fuse_int4_siblings(gm, example_inputs)
        self.facts["lean_fused_int4_calls"] = fused
        modes = [True, False] if self.cpp_wrapper else [False]
        for cpp in modes:
            try:
                # CHECKED_ONCE: every call passes the same tensors (parameters, cache) but the token and position
                # of fixed shapes, so the per-call shape/stride/alignment asserts inductor emits are dropped
                # inside the capture's tracing context: an identical graph (same code, input shapes, settings) compiled
                # earlier, in this process or another, is loaded from inductor's cache instead of compiled again
                with torch._guards.tracing(context), inductor_config.patch(cpp_wrapper=cpp, **CHECKED_ONCE):
                    self._compiled = compile_fx(gm, example_inputs)
            except Exception as exc:  # e.g. no C++ toolchain for the wrapper: try the Python wrapper
                self.facts["lean_step_fallback"] = f"cpp_wrapper={cpp}: {type(exc).__name__}"
                continue
            self._args, self._user_slots = list(example_inputs), slots
            self.facts["lean_step"] = "captured+cpp" if cpp else "captured"
            self.graphs = []
            return
        self._fall_back("inductor could not compile the captured graph")

    def _fall_back(self, why: str, *call) -> torch.Tensor | None:
        self.facts["lean_step"], self.facts["lean_step_fallback"] = "guarded", why
        self.facts["lean_attention"] = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        self.graphs = []
        # dynamic=None (automatic dynamic): an int that changes every step (a sliding-window cache's length) is
        # specialized once, then made symbolic on its first recompile. dynamic=False compiled a new graph for
        # every position of a Gemma 3 step until dynamo's recompile limit (8) and then ran the step eagerly
        # (docs/techniques.md, "lean")
        self._guarded = torch.compile(self._forward, dynamic=None, fullgraph=False) if self._custom else \
            _call_model(torch.compile(self.model, dynamic=None, fullgraph=False), self.cache, self.extra)
        if call:
            return self(*call)
        return None


class LeanCounters(RunCounters):
    """Adds per-token figures: forward time and the loop's own time per decode step."""

    def snapshot(self) -> dict:
        values = super().snapshot()
        steps = values.get("lean_decode_steps") or 0
        if steps:
            values["lean_forward_ms_per_token"] = values["lean_forward_ms"] / steps
            values["lean_overhead_ms_per_token"] = values["lean_loop_overhead_ms"] / steps
        return values
