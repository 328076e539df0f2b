"""Batch `engine: lean`: the lean path (docs/tune.md) for a batch of slots, under the static or
continuous scheduler of an arrival trace.

- One static KV cache of `batch_size` rows (slots) x `max_cache_len` positions, sized to the trace
  before it starts. Every row keeps its own position: a decode step writes each row's new key and
  value at that row's position (`SlotLayer.update`) and attends under a per-row mask (key j visible
  to row b iff j <= position[b]), passed to the model as a ready 4-D mask.
- A request is admitted into a free slot by a batch-1 prefill (eager, or with `compile_prefill` the
  lean compiled prefill, tuners/lean/prefill.py), whose cache rows are copied into the slot's row.
- With `native_step` (Llama, Mistral, Qwen2, Qwen3, Gemma 3 models with int4 a8 layers:
  infer_tune/native/step.py), the decode step of rows 0..R-1 is one native call for any R and any length
  (its attention skips the hidden positions); any other model gets the compiled step below, and
  `lean_native_fallback` says why.
- The decode step of the active slots runs as one batched forward, captured and compiled once per
  shape bucket (1, 2, 4 ... `batch_size` rows: the lowest rows up to the highest busy slot; free
  slots are always the lowest free ones) by the lean `CapturedStep` (no guards, int4 siblings
  merged). Every bucket the trace can reach, and every prompt's prefill bucket, is compiled and run
  in `setup`, before the trace starts (`scheduler_setup_s`), never inside a timed request.

Policies: `continuous` admits waiting requests into free slots before every step (prefill first);
`static` admits a batch only when every slot is free, when `batch_size` requests wait or the oldest
waited `timeout_ms`, and runs it until its longest request ends. Each request decodes greedily
until end-of-sequence or its trace length. Single-request greedy, the reference of `output_mismatches`
and of the trace's output lengths, is this engine serving each prompt alone (one slot, the one-row
step: `own_references`), so the check isolates what batching changes; `output_mismatches_vs_generate`
counts the requests that differ from `generate()` on the same weights (compiled kernels round
differently from eager ones, docs/tune.md).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from infer_tune.engines.base import LEAN
from infer_tune.runners.base import RequestTiming
from infer_tune.runners.generation import eos_ids
from infer_tune.runners.trace import wait_until
from infer_tune.tuners.batch.common import count_mismatches, make_output

# prompt tokens a native step takes at most (a prompt's chunk, or the chunks of several), beside its decode rows
PREFILL_CHUNK = 128

IMPL = "infer-tune lean slots (static per-slot KV cache, compiled prefill buckets, compiled batched decode step)"


def step_buckets(batch_size: int, every: bool = True) -> list[int]:
    """Row counts a decode step is compiled for: powers of two below `batch_size`, and `batch_size`
    (`every` False: `batch_size` alone, one graph, every step computes every slot)."""
    if not every:
        return [batch_size]
    sizes, k = [], 1
    while k < batch_size:
        sizes.append(k)
        k *= 2
    return sizes + [batch_size]


def length_buckets(max_cache_len: int, smallest: int = 128) -> list[int]:
    """Cache lengths a decode step attends over: powers of two from `smallest` below `max_cache_len`, and
    `max_cache_len`. A step attends over the smallest one past every row's position, so a short
    conversation no longer pays attention over the whole cache (masked keys add exact zeros)."""
    sizes, k = [], smallest
    while k < max_cache_len:
        sizes.append(k)
        k *= 2
    return sizes + [max_cache_len]


def rows_for(highest_busy: int, batch_size: int, every: bool = True) -> int:
    """The smallest step bucket holding slots 0..highest_busy."""
    return next(k for k in step_buckets(batch_size, every) if k > highest_busy)


def prepare_model(model: torch.nn.Module, batch_size: int) -> dict:
    """Quantized Linears run their decode kernel on a whole batched step (up to `batch_size` rows), with
    rows computed independently, so a request decodes as it would alone. Called when the technique is
    prepared, before the single-request greedy references are computed, so both use the same kernels.

    - fbgemm kernels leave (their one activation scale per call would couple the requests, and the
      int8-static one breaks a compiled graph): the row-independent candidates (int8-dynamic:
      `fbgemm_rows`, each row on its own grid, and `int_mm`, per-token scales; int8-static: `int_mm`;
      `dequant` where neither runs) are timed on the model's shapes at `batch_size` rows in interleaved rounds
      (kernel_choice.screen_kernels) and the one `kernels.choose` picks replaces them when the screen
      separated it, else the first of ROW_KERNELS (the finer grid); its screen is kept in the facts;
    - int4 (bf16 activations per row) and int_mm / dequant kernels treat rows independently.
    """
    from collections import Counter

    from infer_tune.tuners.quantize.kernel_choice import screen_kernels, unpack_timing
    from infer_tune.tuners.quantize.kernels import choose, excluded
    from infer_tune.tuners.quantize.modules import LINEAR_KINDS

    linears = [m for m in model.modules() if isinstance(m, tuple(LINEAR_KINDS.values()))]
    coupled: dict[str, Counter] = {}
    for module in linears:
        if module.decode_kernel == "fbgemm":
            coupled.setdefault(module.kind, Counter())[(module.in_features, module.out_features)] += 1
    swaps: dict = {}
    screens: dict = {}
    for kind, shapes in coupled.items():
        kernels = LINEAR_KINDS[kind].KERNELS
        usable = tuple(k for k in ROW_KERNELS if k in kernels and k not in excluded(kind, "decode")) or ("dequant",)
        new = usable[0]
        if len(usable) > 1:
            kernel_ms, fp32_ms, record = unpack_timing(screen_kernels(shapes, batch_size, kind, candidates=usable))
            timed = {k: v for k, v in kernel_ms.items() if k in usable and v is not None}
            if timed:
                picked = choose(timed, fp32_ms, vs_fp32=(record or {}).get("vs_fp32_ci95"),
                                unseparated=usable[0] if record is not None and not record.get("separated") else None)
                new = picked["chosen"]
                screens[kind] = {"rows": batch_size, **(record or {}), "median_ms": timed, "chosen": new,
                                 "why": picked["why"]}
        swaps[kind] = {"decode": ("fbgemm", new)}
    for module in linears:
        if module.decode_kernel == "fbgemm":
            new = swaps[module.kind]["decode"][1]
            module.set_kernels(new, module.prefill_kernel if module.prefill_kernel != "fbgemm" else new)
        module.decode_rows = batch_size
    facts = {"slot_decode_kernel_rows": batch_size if linears else 1}
    if swaps:
        facts["slot_kernel_swaps"] = swaps
    if screens:
        facts["slot_kernel_screen"] = screens
    return facts


# kernels whose rows give bit-identical results alone or together (integer GEMMs); `dequant` (an fp32
# GEMM, whose blocking may change with the row count) only when neither runs here
ROW_KERNELS = ("fbgemm_rows", "int_mm")


def _slot_layer_class():
    from transformers.cache_utils import StaticLayer

    class SlotLayer(StaticLayer):
        """A static layer whose rows write at their own positions (`positions`, [rows], set before each step)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, length: int) -> None:
            super().__init__(max_cache_len=keys.shape[2])
            self.keys, self.values, self.positions, self.length = keys, values, positions, length
            self.device, self.batch_size, self.num_heads = keys.device, keys.shape[0], keys.shape[1]
            self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
            self.is_initialized = True
            self.rows = torch.arange(keys.shape[0], device=keys.device)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            # key_states [rows, heads, 1, head_dim]: one new token per row, at that row's position. Written as an
            # index_put_ (row b, every head, position[b]): compiled, it stores the new entries in place, where a
            # scatter_ was compiled to a copy of the whole cache every step (measured: a 2048-position cache
            # took 49-56 ms a 4-row step, a 256-position one 16-21 ms)
            self.keys[self.rows, :, self.positions] = key_states[:, :, 0]
            self.values[self.rows, :, self.positions] = value_states[:, :, 0]
            return self.keys[:, :, :self.length], self.values[:, :, :self.length]

    return SlotLayer


class SlotEngine:
    """The slot cache, the compiled prefill and one compiled decode step per row bucket."""

    def __init__(self, model: torch.nn.Module, batch_size: int, max_cache_len: int, *, compile: bool = True,
                 compile_prefill: bool = False, every_bucket: bool = True, native_step: bool = False,
                 prefill_chunk: int = PREFILL_CHUNK, kv_dtype: str = "fp32") -> None:
        from infer_tune.native.step import KV_DTYPES
        from infer_tune.tuners.lean.prefill import CompiledPrefill

        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got '{kv_dtype}'")
        self.prefill_chunk = prefill_chunk
        self.model, self.batch_size, self.max_cache_len, self.compile = model, batch_size, max_cache_len, compile
        self.facts: dict = {}
        # the step of every row bucket in one native call (infer_tune/native/step.py) where the model is one it
        # runs exactly; else compiled, and why not
        self._native_parts, self._native = None, None
        if native_step:
            from infer_tune.native.step import recognize

            self._native_parts, why = recognize(model)
            if self._native_parts is None:
                self.facts["lean_native_fallback"] = why
        # an int8 cache is the native step's (step.cpp): the compiled step attends over fp32 caches only
        if kv_dtype != "fp32" and self._native_parts is None:
            raise ValueError(f"a {kv_dtype} KV cache needs the native step"
                             + (f" ({self.facts['lean_native_fallback']})" if native_step else " (native_step)"))
        self.kv_dtype = kv_dtype
        self.cache = None  # the native engine's NativeCache
        self.every_bucket = every_bucket
        self.prefill = CompiledPrefill(model, logits_to_keep=True, facts=self.facts) if compile and compile_prefill \
            else None
        if self.native:
            self.facts["lean_prefill"] = "native rows"
        elif self.prefill is None:
            self.facts["lean_prefill"] = "eager"
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions = torch.zeros(batch_size, dtype=torch.long)
        self.ids = torch.zeros((batch_size, 1), dtype=torch.long)
        # one view per row bucket, the same object in the cache layers and as the step's argument
        self._views = {rows: (self.ids[:rows], self.positions[:rows]) for rows in step_buckets(batch_size, every_bucket)}
        self.lengths = length_buckets(max_cache_len)
        self._steps: dict[tuple[int, int], object] = {}

    # ------------------------------------------------------------------ prefill into a slot
    def admit(self, slot: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Prefill one prompt [1, P] into `slot`; returns the logits of its last position [V]. The native
        engine runs the prompt through its own step (`mixed` with no decode rows, `prefill_chunk` rows a
        step), so a prompt's cache and first token are the same alone and inside a mixed step."""
        from infer_tune.native.step import plain_cache

        length = input_ids.shape[1]
        if self.native:
            if length > self.max_cache_len:
                raise ValueError(f"a prompt of {length} tokens does not fit a cache of {self.max_cache_len}")
            ids = input_ids[0]
            self.positions[slot] = 0
            logits = None
            for start in range(0, length, self.prefill_chunk):
                chunk = ids[start:start + self.prefill_chunk]
                _, firsts = self.mixed(0, None, [], [(slot, chunk, start + len(chunk) == length)])
                logits = firsts.get(slot, logits)
            return logits
        # every layer full length (a sliding-window layer's rolling buffer would hold only its window)
        scratch = plain_cache(self.model.config, length)
        logits = self.prefill(input_ids, scratch) if self.prefill is not None else None
        if logits is None:
            logits = self.model(input_ids=input_ids, past_key_values=scratch, use_cache=True,
                                logits_to_keep=1).logits
        if not self.keys:  # the slot cache, shaped like the model's own cache rows
            for layer in scratch.layers:
                self.keys.append(torch.zeros((self.batch_size, *layer.keys.shape[1:2], self.max_cache_len,
                                              layer.keys.shape[-1]), dtype=layer.keys.dtype))
                self.values.append(torch.zeros((self.batch_size, *layer.values.shape[1:2], self.max_cache_len,
                                                layer.values.shape[-1]), dtype=layer.values.dtype))
        for layer, keys, values in zip(scratch.layers, self.keys, self.values):
            keys[slot, :, :length].copy_(layer.keys[0, :, :length])
            values[slot, :, :length].copy_(layer.values[0, :, :length])
        self.positions[slot] = length
        return logits[0, -1]

    def _native_cache(self):
        """The slot cache of the native engine, shaped from the parts it runs (every layer full length), fp32 or
        int8 (`kv_dtype`)."""
        if self.cache is None:
            from infer_tune.native.step import NativeCache

            self.cache = NativeCache(self._native_parts, self.batch_size, self.max_cache_len, self.kv_dtype)
            self.keys, self.values = self.cache.keys, self.cache.values
            self.facts["kv_dtype"], self.facts["kv_cache_bytes"] = self.kv_dtype, self.cache.nbytes
        return self.cache

    # ------------------------------------------------------------------ one mixed step (native)
    def mixed(self, rows: int, tokens: torch.Tensor | None, active: list[int], chunks: list[tuple[int, torch.Tensor, bool]],
              verify: list[tuple[int, torch.Tensor]] = ()) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """One native step of decode rows and prompt rows together, the weights read once for all of them
        (step.cpp's `step_mixed`): slots 0..rows-1 decode `tokens` [rows] at their positions (the slots in
        `active` advance by one; another row writes harmlessly at its slot's position, which a prompt chunk of
        that slot, run after it, overwrites), and each chunk (slot, ids [n], last) prefills `n` prompt tokens of
        `slot` from its position on. Returns the decode rows' logits [rows, V] (None without decode rows) and,
        per chunk that ends its prompt, its slot's logits of the last prompt token [V].
        Each `verify` (slot, ids [n]: the slot's last token and its drafts) runs `n` rows of `slot` from its
        position on, like a chunk, and every row's logits come back ([n, V] under the slot's key): a speculative
        verify pass. Its position is not moved: the caller keeps the rows it accepts."""
        if not self.native:
            raise RuntimeError("mixed steps need the native step")
        self._native_cache()
        step = self._step_for(max(rows, 1), self.lengths[0])
        slots = list(range(rows))
        positions = self.positions[:rows].tolist()
        pieces = [tokens[:rows]] if rows else []
        keep = list(range(rows))
        ends = []

        def add(slot: int, ids: torch.Tensor) -> int:
            """`ids` as rows of `slot` from its position on; the index of their first row."""
            start = int(self.positions[slot])
            if start + len(ids) > self.max_cache_len:
                raise ValueError(f"slot {slot}: {start + len(ids)} positions do not fit a cache of {self.max_cache_len}")
            first = len(slots)
            slots.extend([slot] * len(ids))
            positions.extend(range(start, start + len(ids)))
            pieces.append(ids)
            return first

        for slot, ids, last in chunks:
            first = add(slot, ids)
            if last:
                ends.append(slot)
                keep.append(first + len(ids) - 1)
        checked = []
        for slot, ids in verify:
            first = add(slot, ids)
            checked.append((slot, len(keep), len(ids)))
            keep += range(first, first + len(ids))
        if len(keep) == 0:  # a middle chunk alone: its last row's logits, unused
            keep.append(len(slots) - 1)
        logits = step.mixed(torch.cat(pieces).to(torch.long), torch.tensor(slots), torch.tensor(positions), rows,
                            torch.tensor(keep))
        for slot in active:
            self.positions[slot] += 1
        for slot, ids, _ in chunks:
            self.positions[slot] += len(ids)
        self.facts["slot_mixed_steps"] = self.facts.get("slot_mixed_steps", 0) + (1 if rows and chunks else 0)
        firsts = {slot: logits[rows + i] for i, slot in enumerate(ends)}
        for slot, at, n in checked:
            firsts[slot] = logits[at:at + n]
        return (logits[:rows] if rows else None), firsts

    # ------------------------------------------------------------------ one batched decode step
    def _step_for(self, rows: int, length: int):
        step = self._steps.get((rows, length))
        if step is not None:
            return step
        if self._native_parts is not None:  # one native step for every bucket: it reads rows 0..R-1 of the slot cache
            from infer_tune.native.step import NativeSlotStep

            if self._native is None:
                self._native = NativeSlotStep(self.model, self._native_cache(), self._native_parts)
            self._steps[(rows, length)] = self._native
            self.facts["lean_step"] = "native"
            self.facts["slot_step_buckets"] = sorted({r for r, _ in self._steps})
            return self._native
        from transformers.cache_utils import Cache

        from infer_tune.tuners.lean.loop import CapturedStep

        layer_class = _slot_layer_class()
        positions = self._views[rows][1]
        cache = Cache(layers=[layer_class(k[:rows], v[:rows], positions, length) for k, v in zip(self.keys, self.values)])
        span = torch.arange(length)
        model = self.model
        masks = step_masks(model.config)

        def forward(input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
            mask = masks(span, cache_position)
            return model(input_ids=input_ids, attention_mask=mask, position_ids=cache_position.view(-1, 1),
                         past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        if self.compile:
            step = CapturedStep(model, cache, {}, False, self.facts, forward=forward)
        else:
            step, self.facts["lean_step"] = forward, "eager"
        self._steps[(rows, length)] = step
        self.facts["slot_step_buckets"] = sorted({r for r, _ in self._steps})
        self.facts["slot_length_buckets"] = sorted({n for _, n in self._steps})
        return step

    @property
    def native(self) -> bool:
        """Whether the decode step is the native one (one object for every row and length bucket)."""
        return self._native_parts is not None

    def length_for(self, rows: int) -> int:
        """The smallest length bucket past every position of slots 0..rows-1."""
        need = int(self.positions[:rows].max()) + 1
        return next((n for n in self.lengths if n >= need), self.lengths[-1])

    def step(self, rows: int, tokens: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """Decode one token for slots 0..rows-1 (`tokens` [rows]); returns the next greedy logits [rows, V].
        Every row's position advances by one (free rows compute and write harmlessly at their own).
        Attends over `length` cache positions (default: `length_for(rows)`)."""
        ids, positions = self._views[rows]
        ids[:, 0] = tokens
        logits = self._step_for(rows, length or self.length_for(rows))(ids, positions)
        positions += 1
        return logits[:, -1]


def step_masks(config):
    """The decode step's attention mask(s) from the cache span [L] and each row's position [rows]: key j visible to
    row b iff j <= position[b], and on a sliding-window layer also j > position[b] - window (transformers'
    sliding overlay). transformers uses a ready 4-D mask as given on every layer, so a model with sliding layers
    gets one mask per layer type (Gemma 3, Qwen2/Qwen3 with `layer_types`: a dict "full_attention" /
    "sliding_attention", which their forward takes as the per-layer masks), and a Mistral (every layer sliding,
    no `layer_types`) the windowed mask; a model without a window the causal one alone."""
    window = getattr(config, "sliding_window", None)
    types = set(getattr(config, "layer_types", None) or ())

    def causal(span: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return span.view(1, 1, 1, -1) <= positions.view(-1, 1, 1, 1)  # [rows, 1, 1, L]

    def sliding(span: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return causal(span, positions) & (span.view(1, 1, 1, -1) > positions.view(-1, 1, 1, 1) - window)

    if window is None or (types and "sliding_attention" not in types):
        return causal
    if not types:  # Mistral: every layer slides
        return sliding
    return lambda span, positions: {kind: (sliding if kind == "sliding_attention" else causal)(span, positions)
                                    for kind in types}


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Next tokens from [rows, V] logits, in fp32 as `generate()` takes them."""
    return logits.to(dtype=torch.float32).argmax(-1)


class SlotBatcher:
    """Serves a trace on a `SlotEngine` with the `continuous` or `static` policy (module docstring)."""

    def __init__(self, batch_size: int, policy: str, *, timeout_ms: float | None = None, compile: bool = True,
                 compile_prefill: bool = False, every_bucket: bool = True, shared: dict | None = None,
                 native_step: bool = False, kv_dtype: str = "fp32") -> None:
        self.batch_size, self.policy, self.compile = batch_size, policy, compile
        self.kv_dtype = kv_dtype
        self.compile_prefill, self.every_bucket, self.native_step = compile_prefill, every_bucket, native_step
        self.shared = shared  # the run's cache: configs with the same weights and shapes share one engine
        self.name = f"{policy}-lean"
        self.timeout_ns = int((timeout_ms or 0.0) * 1e6)
        self.references: dict[int, list[int]] = {}
        self.generate_references: dict[int, list[int]] = {}
        self.engine: SlotEngine | None = None
        self.timings: list[RequestTiming] = []
        self.outputs: list = []
        self._stats: dict = {}

    def setup(self, prepared, trace, encoded, max_new_tokens) -> None:
        """Size the slot cache to the trace; compile and run every prefill bucket and step bucket it needs."""
        longest = max(int(encoded[r.prompt_index]["input_ids"].shape[1]) + (r.max_new_tokens or max_new_tokens)
                      for r in trace)
        self._build(prepared, [encoded[i] for i in sorted({r.prompt_index for r in trace})], longest)

    def _build(self, prepared, prompts: list[dict], longest: int) -> None:
        """The engine for caches of `longest` positions (or one shared by an earlier config of the run that
        holds them), every prefill bucket of `prompts` and every step bucket compiled and run once."""
        from infer_tune.tuners.batch.common import weights_key
        from infer_tune.tuners.lean.loop import bucket

        started = time.perf_counter()
        size = bucket(longest + 1)
        if self.engine is None or self.engine.max_cache_len < size:
            key = ("slot-engine", weights_key(prepared), self.batch_size, size, self.compile, self.compile_prefill,
                   self.every_bucket, self.native_step, self.kv_dtype)
            shared = self.shared if self.shared is not None else {}
            if key in shared:  # compiled for another config of this run (same weights, slots, cache): reused
                self.engine = shared[key]
                self.engine.facts["slot_engine_reused"] = True
            else:
                self.engine = shared[key] = SlotEngine(prepared.model, self.batch_size, size, compile=self.compile,
                                                       compile_prefill=self.compile_prefill,
                                                       every_bucket=self.every_bucket, native_step=self.native_step,
                                                       kv_dtype=self.kv_dtype)
        engine = self.engine
        with torch.inference_mode():
            for ids in sorted(prompts, key=lambda e: e["input_ids"].shape[1]):
                engine.admit(0, ids["input_ids"].to(prepared.device))
            # compiled: capture, capture again (same graph?), then compiled, per (rows, length) bucket; the native
            # step is one object for every bucket, built and run once
            lengths, calls = (engine.lengths[:1], 1) if engine.native else (engine.lengths, 3)
            for rows in step_buckets(self.batch_size, self.every_bucket):
                for length in lengths:
                    for _ in range(calls):
                        engine.step(rows, torch.zeros(rows, dtype=torch.long), length)
        engine.positions.zero_()
        engine.facts["slot_engine_build_s"] = engine.facts.get("slot_engine_build_s", 0.0) + time.perf_counter() - started

    def own_references(self, prepared, encoded: list[dict], indices: list[int], max_new_tokens: int,
                       cache: dict | None = None, progress=None) -> dict[int, list[int]]:
        """Prompt index -> the tokens this engine decodes for it alone (slot 0 of the smallest step bucket:
        the one-row step, or every slot's step when `step_buckets` is `full`, the other rows idle), up to
        and including end-of-sequence, at most `max_new_tokens`: what batching must not change.
        `progress(stage, done, total)` hears the engine build start and each prompt done."""
        from infer_tune.tuners.batch.common import weights_key

        unique = sorted(set(indices))
        if progress:
            progress("slot engine: building (compiles on first use)", 0, len(unique))
        self._build(prepared, [encoded[i] for i in unique],
                    max(int(encoded[i]["input_ids"].shape[1]) for i in unique) + max_new_tokens)
        eos = set(eos_ids(prepared.model, prepared.tokenizer))
        cache = {} if cache is None else cache
        out: dict[int, list[int]] = {}
        rows = rows_for(0, self.batch_size, self.every_bucket)  # one row, or every slot when one graph is all
        with torch.inference_mode():
            for i in unique:
                ids = encoded[i]["input_ids"].to(prepared.device)
                key = ("slot-greedy", weights_key(prepared), self.batch_size, self.every_bucket, tuple(ids[0].tolist()), max_new_tokens)
                if key not in cache:
                    self.engine.positions.zero_()  # idle rows of a wider step start from 0 for each prompt
                    tokens = [int(greedy(self.engine.admit(0, ids)[None])[0])]
                    step_in = torch.zeros(rows, dtype=torch.long)
                    while tokens[-1] not in eos and len(tokens) < max_new_tokens:
                        step_in[0] = tokens[-1]
                        tokens.append(int(greedy(self.engine.step(rows, step_in))[0]))
                    cache[key] = tokens
                out[i] = list(cache[key])
                if progress:
                    progress("slot engine: single-request references", len(out), len(unique))
        self.engine.positions.zero_()
        return out

    def serve(self, prepared, trace, encoded, max_new_tokens, origin_ns, progress=None):
        with torch.inference_mode():
            return self._serve(prepared, trace, encoded, max_new_tokens, origin_ns, progress)

    def _serve(self, prepared, trace, encoded, max_new_tokens, origin_ns, progress):
        if self.engine is None:
            self.setup(prepared, trace, encoded, max_new_tokens)
        engine, size = self.engine, self.batch_size
        eos = set(eos_ids(prepared.model, prepared.tokenizer))
        n = len(trace)
        order = sorted(range(n), key=lambda k: trace[k].arrival_s)
        arrival_ns = [origin_ns + int(r.arrival_s * 1e9) for r in trace]
        limit = [r.max_new_tokens or max_new_tokens for r in trace]
        tokens: list[list[int]] = [[] for _ in range(n)]
        stamps: list[list[int]] = [[] for _ in range(n)]
        start_ns = [0] * n
        slots: list[int | None] = [None] * size  # slot -> trace index
        nxt = torch.zeros(size, dtype=torch.long)  # each slot's next input token
        queue: deque[int] = deque()
        arrived = done = steps = busy_rows = computed_rows = 0
        lag = 0

        def emit(slot: int, k: int, token: int, stamp: int) -> None:
            nonlocal done
            tokens[k].append(token)
            stamps[k].append(stamp)
            if token in eos or len(tokens[k]) >= limit[k]:
                slots[slot] = None
                done += 1
                if progress:
                    progress("requests", done, n)
            else:
                nxt[slot] = token

        while done < n:
            now = time.perf_counter_ns()
            while arrived < n and arrival_ns[order[arrived]] <= now:
                lag = max(lag, now - arrival_ns[order[arrived]])
                queue.append(order[arrived])
                arrived += 1
            idle = all(s is None for s in slots)
            if queue and (self.policy == "continuous" or idle):
                if self.policy == "static" and len(queue) < size and arrived < n \
                        and now < arrival_ns[queue[0]] + self.timeout_ns:
                    wait_until(min(arrival_ns[queue[0]] + self.timeout_ns, arrival_ns[order[arrived]]))
                    continue
                for slot in range(size):
                    if slots[slot] is None and queue:
                        k = queue.popleft()
                        slots[slot] = k
                        start_ns[k] = time.perf_counter_ns()
                        logits = engine.admit(slot, encoded[trace[k].prompt_index]["input_ids"].to(prepared.device))
                        emit(slot, k, int(greedy(logits[None])[0]), time.perf_counter_ns())
            busy = [s for s in range(size) if slots[s] is not None]
            if not busy:
                if arrived < n and not queue:
                    wait_until(arrival_ns[order[arrived]])
                continue
            rows = rows_for(busy[-1], size, self.every_bucket)
            picks = greedy(engine.step(rows, nxt[:rows])).tolist()
            stamp = time.perf_counter_ns()
            steps += 1
            busy_rows += len(busy)
            computed_rows += rows
            for slot in busy:
                emit(slot, slots[slot], picks[slot], stamp)
            free = [slot for slot in range(rows) if slots[slot] is None]
            if free:  # a free row's write position stays inside its row (it writes harmlessly at 0)
                engine.positions[free] = 0
        return self._finish(prepared, trace, encoded, eos, arrival_ns, start_ns, stamps, tokens, {
            "forward_steps": steps, "mean_batch_size": busy_rows / steps if steps else None,
            "padding_share": 1 - busy_rows / computed_rows if computed_rows else None, "max_submit_lag_ms": lag / 1e6})

    def _finish(self, prepared, trace, encoded, eos: set[int], arrival_ns, start_ns, stamps, tokens, stats: dict):
        """A replay's timings and outputs per request (trace order), its counters with the mismatches against the
        engine's own single-request references and against generate()'s."""
        timings, outputs = [], []
        for k, request in enumerate(trace):
            prompt_tokens = int(encoded[request.prompt_index]["input_ids"].shape[1])
            timings.append(RequestTiming(request.prompt_index, 0, prompt_tokens, arrival_ns[k], stamps[k],
                                         start_ns=start_ns[k]))
            outputs.append(make_output(prepared.tokenizer, eos, request.prompt_index, prompt_tokens, tokens[k]))
        self._stats = {**stats, "output_mismatches": count_mismatches(outputs, self.references, eos),
                       "output_mismatches_vs_generate": count_mismatches(outputs, self.generate_references, eos)}
        self.timings, self.outputs = timings, outputs
        return timings, outputs

    def run_counters(self) -> dict:
        """Scheduler facts of the last replay (merged into the result's metrics)."""
        facts = dict(self.engine.facts) if self.engine is not None else {}
        return {**self._stats, **facts, "batch_engine": LEAN, "batch_impl": IMPL, "max_batch_size": self.batch_size,
                "kv_cache_tokens": self.engine.max_cache_len * self.batch_size if self.engine else None}
