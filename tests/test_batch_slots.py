"""Batch `engine: lean` (infer_tune/tuners/batch/slots.py): int4 weights stacked with the slot engine
reproduce single-request greedy outputs under both schedulers, on tiny random models of two
architectures; the compiled prefill and batched step are compiled before the trace starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer_tune import env as envinfo
from infer_tune import models
from infer_tune.errors import ConfigError
from infer_tune.sweep import measure_prepared, prepare_inputs
from infer_tune.tuners import RunContext, apply
from infer_tune.tuners.batch import BatchConfig
from infer_tune.tuners.batch import slots as slots_module
from infer_tune.tuners.batch.slots import rows_for, step_buckets
from infer_tune.tuners.quantize import QuantizeConfig
from infer_tune.tuners.stack import StackConfig
from infer_tune.workload import Workload, encode_batches
from tests.test_batch import ONCE, _greedy_alone
from tests.test_batch import mixed_suite as mixed_suite  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from tests.conftest import build_tiny_tokenizer
    from tests.test_quantize_families import tiny

    tok = build_tiny_tokenizer()
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model = tiny("qwen3", tok)
    model.config.max_position_embeddings = 1024  # the mixed suite's longest prompt is ~390 tokens
    model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _saved_family(tmp_path_factory, arch: str, window: int) -> Path:
    """A tiny `arch` model with sliding window `window` (shorter than most of the mixed suite's prompts), saved."""
    from tests.conftest import build_tiny_tokenizer
    from tests.test_native_step import tiny_family

    tok = build_tiny_tokenizer()
    path = tmp_path_factory.mktemp(f"tiny-{arch}")
    model = tiny_family(tok, arch, sliding_window=window, max_position_embeddings=1024)
    model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    """A tiny Gemma 3 whose sliding window (32) is shorter than most of the mixed suite's prompts."""
    return _saved_family(tmp_path_factory, "gemma3", 32)


def test_step_buckets():
    assert step_buckets(1) == [1] and step_buckets(4) == [1, 2, 4] and step_buckets(6) == [1, 2, 4, 6]
    assert [rows_for(i, 6) for i in range(6)] == [1, 2, 4, 4, 6, 6]
    with pytest.raises(ConfigError, match="engine"):
        BatchConfig(scheduler="continuous", rate=1.0, engine="magic")
    with pytest.raises(ConfigError, match="sweep"):
        BatchConfig(scheduler="sweep", engine="lean")
    assert BatchConfig(scheduler="static", rate=2.0, batch_size=4, engine="lean").label() == "static-b4-r2-lean"


@pytest.mark.parametrize("arch,scheduler,compiled,every", [("llama", "continuous", True, True),
                                                            ("qwen3", "static", False, True),
                                                            ("qwen3", "continuous", False, True),
                                                            ("llama", "continuous", False, False)])
def test_int4_slots_equal_single_request_greedy(arch, scheduler, compiled, every, tiny_model_dir, qwen3_dir,
                                                mixed_suite, tmp_path, monkeypatch):
    """`every` False: one step graph over every slot (`step_buckets: full`), the references included."""
    if not compiled:  # the same engine with its prefill and step eager (fast): the slot logic alone
        monkeypatch.setattr(slots_module.SlotBatcher.__init__, "__kwdefaults__",
                            {"timeout_ms": None, "compile": False, "compile_prefill": False, "every_bucket": every,
                             "shared": None})
    loaded = models.load(str(tiny_model_dir if arch == "llama" else qwen3_dir))
    # compiled: 2 slots and 2 prompts of different lengths in one prefill bucket (27 and 30 tokens: bucket 32; the
    # second with pad tokens inside), so the graphs compiled are that bucket and the step buckets 1 and 2
    size = 2 if compiled else 3
    suite = mixed_suite
    if compiled:
        rows = mixed_suite.read_text().splitlines()
        suite = tmp_path / "two.jsonl"
        suite.write_text(rows[0] + "\n" + rows[-1] + "\n")
    workload = Workload(suite=str(suite), limit=2 if compiled else 8, max_new_tokens=10, chat_template=False)
    inputs = prepare_inputs(loaded, workload)
    config = StackConfig(configs=[
        QuantizeConfig(method="int4-rtn", backend="torch", decode_kernel="int4pack", prefill_kernel="int4pack"),
        BatchConfig(scheduler=scheduler, batch_size=size, rate=200.0, requests=10, allow_repeat=True, engine="lean",
                    compile_prefill=compiled, step_buckets="all" if every else "full")])
    ctx = RunContext(env=envinfo.collect_env(1), out_dir=tmp_path)
    prepared = apply(loaded, config, ctx)
    doc, _ = measure_prepared(loaded, prepared, inputs, workload, ONCE, technique="stack", config=config.to_dict(),
                              env=ctx.env, runner="trace", measure_ppl=False)
    sched = prepared.runner_options["scheduler"]
    m = doc["metrics"]
    assert m["output_mismatches"] == 0 and m["output_mismatches_vs_generate"] == 0, m
    assert m["scheduler"] == f"{scheduler}-lean" and m["ttft_ms"]["n"] == 10
    # an independent reference: the same int4 model decoding each prompt alone through generate()
    encoded = encode_batches(loaded.tokenizer, inputs.rendered, 1, add_special_tokens=True)
    eos = loaded.tokenizer.eos_token_id
    quantized = type(loaded)(model=prepared.model, tokenizer=loaded.tokenizer, ref=loaded.ref, path=loaded.path)
    for timing, output in zip(sched.timings, sched.outputs):
        expected = _greedy_alone(quantized, encoded[timing.prompt_index], 10)
        assert output.token_ids + ([eos] if output.hit_eos else []) == expected
        assert len(timing.token_ns) == len(expected)
    assert m["mean_batch_size"] > 1 and m["slot_decode_kernel_rows"] == size
    if compiled:
        assert m["lean_prefill"] == "compiled" and m["lean_step"] == "captured", m
        assert m["slot_step_buckets"] == [1, 2] and m["scheduler_setup_s"] > 0
    else:
        assert m["lean_step"] == "eager"
    if not every:
        assert m["slot_step_buckets"] == [size]


def test_decode_rows_only_where_rows_are_independent(tiny_loaded):
    import copy

    from infer_tune.tuners.quantize.modules import LINEAR_KINDS
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    model = copy.deepcopy(tiny_loaded.model)
    quantize_in_memory(model, QuantizeConfig(method="int8-dynamic", backend="torch", decode_kernel="fbgemm"), "torch")
    facts = slots_module.prepare_model(model, 4)
    linears = [m for m in model.modules() if isinstance(m, tuple(LINEAR_KINDS.values()))]
    assert linears and all(m.decode_rows == 4 and m.decode_kernel != "fbgemm" for m in linears)
    assert facts["slot_kernel_swaps"]["int8-dynamic"]["decode"][0] == "fbgemm"
    x = torch.randn(4, linears[0].in_features)
    with torch.no_grad():  # rows computed together equal rows computed alone
        together = linears[0](x)
        alone = torch.cat([linears[0](x[i:i + 1]) for i in range(4)])
    assert torch.equal(together, alone)


def test_tune_throughput_objective_plans_batched_stacks():
    """`tune --objective throughput` measures int4 + continuous batching on the slot engine first; the
    decode objective plans none (one request at a time is what it measures)."""
    from infer_tune.scenarios.tune_plan import Candidate, TuneSpec, stack_candidates
    from infer_tune.tuners.batch import BURST_RATE

    cand = Candidate(QuantizeConfig(method="int4-rtn"), lossless=False, method="int4-rtn")
    stacks = stack_candidates(TuneSpec(objective="throughput"), [cand])
    batched = [c for c in stacks if "batch" in c.config.techniques()]
    assert [c.config.configs[1].batch_size for c in batched] == [4, 8] and stacks[:2] == batched
    assert all(c.config.configs[1].engine == "lean" and c.config.configs[1].rate == BURST_RATE for c in batched)
    assert not [c for c in stack_candidates(TuneSpec(objective="decode"), [cand]) if "batch" in c.config.techniques()]
    assert not [c for c in stack_candidates(TuneSpec(objective="throughput", compile=False), [cand])
                if "batch" in c.config.techniques()]


def test_fbgemm_rows_kernel_rows_alone_equal_rows_together():
    """`fbgemm_rows` puts each row on its own grid: an outlier row changes nothing for the others (plain
    fbgemm's one grid per call would), and it stays close to the fp32 product of the int8 weight."""
    from infer_tune.tuners.quantize.kernel_choice import sample_module

    module = sample_module("int8-dynamic", 64, 96, 32)
    module.set_kernels("fbgemm_rows", "fbgemm_rows")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    x[2] *= 50  # an outlier token
    with torch.no_grad():
        together = module(x)
        alone = torch.cat([module(x[i:i + 1]) for i in range(5)])
        reference = torch.nn.functional.linear(x, module._weight_t().t().float() * module.weight_scale[:, None])
    assert torch.equal(together, alone)
    assert ((together - reference).norm(dim=1) / reference.norm(dim=1)).max() < 0.05


def test_length_buckets_attend_over_the_used_cache_only(tiny_loaded):
    """A step over a shorter length bucket gives the logits of the full-cache step (masked keys add zeros)."""
    assert slots_module.length_buckets(512) == [128, 256, 512] and slots_module.length_buckets(100) == [100]
    engine = slots_module.SlotEngine(tiny_loaded.model, 2, 512, compile=False)
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.inference_mode():
        engine.admit(0, ids)
        engine.admit(1, ids[:, :4])
        assert engine.length_for(2) == 128
        short = engine.step(2, torch.tensor([3, 4]), 128)
        engine.positions -= 1  # the same step again, over the whole cache
        full = engine.step(2, torch.tensor([3, 4]), 512)
    assert torch.allclose(short, full, atol=1e-5) and torch.equal(short.argmax(-1), full.argmax(-1))
    assert engine.facts["slot_length_buckets"] == [128, 512]


@pytest.mark.parametrize("separated,expected", [(True, "int_mm"), (False, "fbgemm_rows")])
def test_slot_kernel_swap_is_taken_from_a_separated_screen(separated, expected, tiny_loaded, monkeypatch):
    """fbgemm leaves the batched step for the kernel the screen separated as fastest; when the screen did
    not separate them, for the first row-independent kernel (the finer grid), never for a lower median alone."""
    import copy

    from infer_tune.tuners.quantize import kernel_choice, kernels, screen
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    def fake(shapes, rows, kind, candidates=None, **_):
        return screen.Screen(samples={screen.FP32: [2.0] * 5, "fbgemm_rows": [1.2] * 5, "int_mm": [1.0] * 5},
                             rounds=5, separated=separated, stopped="separated" if separated else "time budget")

    monkeypatch.setattr(kernel_choice, "screen_kernels", fake)
    monkeypatch.setattr(kernels, "excluded", lambda kind, regime: {})  # both candidates, whatever this host's probe
    model = copy.deepcopy(tiny_loaded.model)
    quantize_in_memory(model, QuantizeConfig(method="int8-dynamic", backend="torch", decode_kernel="fbgemm"), "torch")
    facts = slots_module.prepare_model(model, 4)
    assert facts["slot_kernel_swaps"]["int8-dynamic"]["decode"] == ("fbgemm", expected)
    assert facts["slot_kernel_screen"]["int8-dynamic"]["chosen"] == expected


def _int4_a8_batch_metrics(loaded, batch: BatchConfig, inputs, workload, tmp_path) -> dict:
    """One trace row of int4 a8 weights stacked with `batch`, measured once: its metrics."""
    config = StackConfig(configs=[QuantizeConfig(method="int4-rtn", backend="torch", activations="int8"), batch])
    ctx = RunContext(env=envinfo.collect_env(1), out_dir=tmp_path)
    prepared = apply(loaded, config, ctx)
    doc, _ = measure_prepared(loaded, prepared, inputs, workload, ONCE, technique="stack", config=config.to_dict(),
                              env=ctx.env, runner="trace", measure_ppl=False)
    return doc["metrics"]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_native_slot_step_serves_as_each_request_alone(arch, native_kernels, tiny_model_dir, qwen3_dir, gemma3_dir,
                                                       mixed_suite, tmp_path):
    """The slot engine's native step (int4 a8 Llama, Qwen3, Gemma 3: infer_tune/native/step.py): rows 1 and 2 of one
    step give each request the tokens of the one-row step serving it alone, 0 mismatches, no step compiled (Gemma 3's
    prompts longer than its window admitted whole)."""
    loaded = models.load(str({"llama": tiny_model_dir, "qwen3": qwen3_dir, "gemma3": gemma3_dir}[arch]))
    workload = Workload(suite=str(mixed_suite), limit=6, max_new_tokens=10, chat_template=False)
    inputs = prepare_inputs(loaded, workload)
    batch = BatchConfig(scheduler="continuous", batch_size=3, rate=200.0, requests=10, allow_repeat=True,
                        engine="lean", native_step=True)
    assert batch.label() == "continuous-b3-r200-lean-native"
    m = _int4_a8_batch_metrics(loaded, batch, inputs, workload, tmp_path)
    assert m["lean_step"] == "native" and "lean_native_fallback" not in m, m
    assert m["output_mismatches"] == 0 and m["ttft_ms"]["n"] == 10, m
    assert m["mean_batch_size"] > 1 and m["slot_step_buckets"] == [1, 2, 3]


def test_continuous_native_with_lookup_drafts_replays_through_serves_loop(native_kernels, tiny_model_dir, mixed_suite,
                                                                          tmp_path):
    """batch speculate (int4 a8, the native step, continuous): the trace replayed through serve's loop with each
    decoding slot's prompt-lookup drafts verified in the same steps: 0 mismatches against each request alone,
    drafts counted and accepted."""
    loaded = models.load(str(tiny_model_dir))
    workload = Workload(suite=str(mixed_suite), limit=6, max_new_tokens=24, chat_template=False)
    inputs = prepare_inputs(loaded, workload)
    batch = BatchConfig(scheduler="continuous", batch_size=3, rate=50.0, requests=8, allow_repeat=True,
                        engine="lean", native_step=True, speculate=4)
    assert batch.label() == "continuous-b3-r50-lean-native-lookup-k4"
    with pytest.raises(ConfigError, match="needs engine lean, native_step true and scheduler continuous"):
        BatchConfig(scheduler="static", batch_size=3, rate=50.0, engine="lean", native_step=True, speculate=4)
    m = _int4_a8_batch_metrics(loaded, batch, inputs, workload, tmp_path)
    assert m["lean_step"] == "native" and m["output_mismatches"] == 0 and m["ttft_ms"]["n"] == 8, m
    assert m["spec_drafted"] > 0 and m["spec_accepted"] > 0 and m["spec_draft_tokens"] == 4, m
    assert 0 < m["spec_acceptance"] <= 1 and m["forward_steps"] > 0


@pytest.mark.parametrize("native_step", [True, False])
def test_stack_rows_through_bench_recipe_report_no_mismatches(native_step, tiny_model_dir, mixed_suite, tmp_path):
    """The demo's batching stage (recipes/quick.yaml: int4 a8 + the slot engine, a static and a continuous row
    sharing one engine) through `bench --recipe`, in interleaved rounds after a baseline: every request of every
    row decodes as it would alone (0 mismatches against the engine's references and against generate())."""
    import json

    from typer.testing import CliRunner

    from infer_tune import native
    from infer_tune.cli import app
    from infer_tune.report import display

    if native_step and not native.available()[0]:
        pytest.skip(native.available()[1])
    # without the native step the slot engine compiles its step: one graph over every slot (`step_buckets: full`;
    # the bucketed step graphs are test_int4_slots_equal_single_request_greedy's), not three more compiles
    step = "native_step: true" if native_step else "native_step: false, step_buckets: full"
    rows = "".join(
        f"  - {{technique: stack, configs: [{{technique: quantize, method: int4-rtn, activations: int8}},\n"
        f"      {{technique: batch, scheduler: {s}, batch_size: 3, rate: 200.0, requests: 6, engine: lean,"
        f" {step}}}]}}\n" for s in ("static", "continuous"))
    recipe = tmp_path / "batching.yaml"
    recipe.write_text("protocol: {warmup: 1, min_iterations: 1, min_duration_s: 0, max_rounds: 3}\nconfigs:\n" + rows)
    result = CliRunner().invoke(app, ["bench", "--recipe", str(recipe), "--model", str(tiny_model_dir), "--suite",
                                      str(mixed_suite), "--limit", "6", "--max-new-tokens", "8", "--no-chat-template",
                                      "--out", str(tmp_path / "runs"), "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    docs = [d for d in json.loads(result.stdout) if d["technique"] == "stack"]
    assert len(docs) == 2
    for doc in docs:
        m = doc["metrics"]
        assert m["output_mismatches"] == 0 and m["output_mismatches_vs_generate"] == 0, m
        # the comparison with the fp32 baseline's outputs is kept apart, and is what the verdict reads
        assert isinstance(m["output_mismatches_vs_baseline"], int), m
        assert display.verdict({**m, "technique": "stack"}) == (
            "lossless" if m["output_mismatches_vs_baseline"] == 0 else "lossy")


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    """A tiny Mistral (every layer slides, window 24: shorter than most of the mixed suite's prompts)."""
    return _saved_family(tmp_path_factory, "mistral", 24)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_slot_step_applies_sliding_windows(arch, mistral_dir, gemma3_dir, mixed_suite, tmp_path, monkeypatch):
    """The slot engine's own (non-native) step on models with sliding-window layers, prompts and decoding past the
    window: each request gets generate()'s tokens on the same weights (transformers' own per-layer masks), 0
    mismatches. A step mask without the window (every key visible on every layer) differs."""
    monkeypatch.setattr(slots_module.SlotBatcher.__init__, "__kwdefaults__",
                        {"timeout_ms": None, "compile": False, "compile_prefill": False, "every_bucket": True,
                         "shared": None, "native_step": False})
    loaded = models.load(str({"mistral": mistral_dir, "gemma3": gemma3_dir}[arch]))
    workload = Workload(suite=str(mixed_suite), limit=6, max_new_tokens=12, chat_template=False)
    inputs = prepare_inputs(loaded, workload)
    window = loaded.model.config.sliding_window
    assert sum(int(e["input_ids"].shape[1]) > window for e in
               encode_batches(loaded.tokenizer, inputs.rendered, 1, add_special_tokens=True)) >= 4
    config = StackConfig(configs=[
        QuantizeConfig(method="int4-rtn", backend="torch", decode_kernel="int4pack", prefill_kernel="int4pack"),
        BatchConfig(scheduler="continuous", batch_size=3, rate=200.0, requests=8, allow_repeat=True, engine="lean")])
    ctx = RunContext(env=envinfo.collect_env(1), out_dir=tmp_path)
    prepared = apply(loaded, config, ctx)
    doc, _ = measure_prepared(loaded, prepared, inputs, workload, ONCE, technique="stack", config=config.to_dict(),
                              env=ctx.env, runner="trace", measure_ppl=False)
    m = doc["metrics"]
    assert m["lean_step"] == "eager" and m["mean_batch_size"] > 1, m
    assert m["output_mismatches_vs_generate"] == 0 and m["output_mismatches"] == 0, m
    masks = slots_module.step_masks(loaded.model.config)(torch.arange(40), torch.tensor([30, 10]))
    sliding = masks if arch == "mistral" else masks["sliding_attention"]
    assert sliding[0, 0, 0].tolist() == [30 - window < j <= 30 for j in range(40)]
    assert sliding[1, 0, 0].tolist() == [j <= 10 for j in range(40)]
