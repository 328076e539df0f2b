"""tune and what it builds on: host-measured kernels and activation range, stacked configs, the lean decode
path, broken-result marking, the noise figure, and the search itself (tiny random models; no timing asserts)."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from infer_tune import results
from infer_tune.cli import app
from infer_tune.errors import ConfigError
from infer_tune.tuners.base import RunContext, apply
from infer_tune.tuners.quantize import QuantizeConfig, kernel_choice, kernels
from infer_tune.tuners.quantize.apply import STATIC_ERROR_BUDGET
from infer_tune.tuners.quantize.modules import Int4Linear, Int8DynamicLinear, int8_per_channel
from infer_tune.tuners.quantize.pipeline import quantize_in_memory

runner = CliRunner()


# --------------------------------------------------------------------------- kernels and numerics
def test_choice_takes_the_fastest_and_flags_a_path_slower_than_fp32():
    fast = kernels.choose({"fbgemm": 2.0, "int_mm": 1.0, "dequant": 9.0}, fp32_ms=1.5)
    assert fast["chosen"] == "int_mm" and not fast["slower_than_fp32"]
    avx2_like = kernels.choose({"int_mm": 354.0, "dequant": 9.0}, fp32_ms=7.8)  # the AVX2 prefill numbers
    assert avx2_like["chosen"] == "dequant" and avx2_like["slower_than_fp32"] and "slower than fp32" in avx2_like["why"]
    forced = kernels.choose({"fbgemm": 2.0, "int_mm": 1.0}, fp32_ms=1.5, forced="fbgemm")
    assert forced["chosen"] == "fbgemm" and forced["why"].startswith("forced by the config") and forced["slower_than_fp32"]


def test_injected_timings_decide_what_runs(tiny_loaded, monkeypatch):
    """A host where torch._int_mm is 40x slower than fp32 (the AVX2 report): prefill must not use it."""
    model = copy.deepcopy(tiny_loaded.model)
    quantize_in_memory(model, QuantizeConfig(method="int8-dynamic"), "torch")
    timings = {("int8-dynamic", "decode"): ({"fbgemm": 1.0, "int_mm": 3.0, "dequant": 5.0}, 2.0),
               ("int8-dynamic", "prefill"): ({"fbgemm": 1.0, "int_mm": 400.0, "dequant": 10.0}, 8.0)}
    record = kernel_choice.choose_for_model(model, "int8-dynamic", timings=timings)
    by_kind = record["by_kind"]["int8-dynamic"]
    assert by_kind["decode"]["chosen"] == "fbgemm"
    assert by_kind["prefill"]["chosen"] == "dequant"  # fbgemm excluded at prefill (per-tensor numerics)
    assert "fbgemm" in by_kind["prefill"]["excluded"] and record["prefill"]["slower_than_fp32"]
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape) or real(a, b))
    model(torch.tensor([[5, 6, 7, 8, 9]]))
    assert not calls  # the measured choice (dequant) ran, not int_mm
    kernel_choice.apply_kernels(model, "fbgemm", "int_mm")
    model(torch.tensor([[5, 6, 7, 8, 9]]))
    assert calls  # forcing the slow path really runs it


@pytest.mark.parametrize("kind,module_kernels", [("int8", ("fbgemm", "int_mm", "dequant")), ("int4", ("int4pack", "dequant"))])
def test_every_kernel_of_a_layer_computes_the_same_product(kind, module_kernels):
    torch.manual_seed(0)
    weight = torch.randn(48, 64) * 0.05
    x = torch.randn(7, 64)
    if kind == "int8":
        module = Int8DynamicLinear(*int8_per_channel(weight))
    else:
        from infer_tune.tuners.quantize.apply import int4_quantize

        t = int4_quantize(weight, 32, hqq=False)
        module = Int4Linear(t["qweight_int4"], t["scale"], t["zero"], 32)
    reference = x @ weight.t()
    for kernel in module_kernels:
        module.set_kernels(kernel, kernel)
        out = module(x)
        assert float((out - reference).norm() / reference.norm()) < 0.2, kernel


def test_compiled_paths_get_traceable_kernels_with_the_same_numerics(tiny_loaded, prompts_file):
    """fbgemm's prepacked ops break a torch.compile graph; the static int8 grid through torch._int_mm is exact."""
    from infer_tune.tuners.quantize.calibrate import calibration_batches
    from infer_tune.tuners.quantize.modules import Int8StaticLinear

    model = copy.deepcopy(tiny_loaded.model)
    calib = calibration_batches(tiny_loaded.tokenizer, str(prompts_file), 4)
    quantize_in_memory(model, QuantizeConfig(method="int8-static"), "torch", calib)
    layer = next((m for m in model.modules() if isinstance(m, Int8StaticLinear)), None)
    if layer is None:  # every layer fell back to dynamic int8 (7-bit activations on a saturating host): one of its own
        from infer_tune.tuners.quantize.modules import int8_per_channel

        layer = Int8StaticLinear(*int8_per_channel(torch.randn(16, 64)), None, None, 0.05, 64)
        model = torch.nn.Sequential(layer)
    x = torch.randn(3, layer.in_features)
    reference = layer(x)
    swaps = kernel_choice.make_traceable(model)
    assert swaps["int8-static"]["decode"] == ("fbgemm", "int_mm")
    assert all(m.decode_kernel in kernels.TRACEABLE[m.kind] and m.prefill_kernel in kernels.TRACEABLE[m.kind]
               for m in model.modules() if hasattr(m, "decode_kernel"))
    assert torch.equal(layer(x), reference)  # exact integer math on the same grid


def test_activation_range_follows_the_probe_or_the_override(monkeypatch):
    probe = kernels.saturation_probe()
    assert probe["exact"] == pytest.approx(255 * 127 * 64)
    monkeypatch.setattr(kernels, "saturation_probe", lambda: {"saturates": True, "int_mm_saturates": False})
    monkeypatch.delenv(kernels.FORCE_REDUCE_RANGE_ENV, raising=False)
    assert kernels.activation_range()["qmax"] == 127 and "saturate" in kernels.activation_range()["why"]
    monkeypatch.setattr(kernels, "saturation_probe", lambda: {"saturates": False, "int_mm_saturates": True})
    assert kernels.activation_qmax() == 255
    assert "int_mm" in kernels.excluded("int8-dynamic", "decode")  # a saturating _int_mm is never chosen
    monkeypatch.setenv(kernels.FORCE_REDUCE_RANGE_ENV, "1")
    assert kernels.activation_range()["reduce_range"] is True


def test_static_scales_stay_within_the_reduced_range(tiny_loaded, prompts_file, monkeypatch):
    from infer_tune.tuners.quantize.calibrate import calibration_batches
    from infer_tune.tuners.quantize.modules import Int8StaticLinear

    monkeypatch.setenv(kernels.FORCE_REDUCE_RANGE_ENV, "1")
    model = copy.deepcopy(tiny_loaded.model)
    calib = calibration_batches(tiny_loaded.tokenizer, str(prompts_file), 4)
    summary = quantize_in_memory(model, QuantizeConfig(method="int8-static"), "torch", calib)
    statics = [m for m in model.modules() if isinstance(m, Int8StaticLinear)]
    assert all(m.reduce_range and 0 <= m.act_zero_point <= 127 for m in statics)
    assert "dynamic_fallback_layers" in summary and summary["static_error_budget"] == STATIC_ERROR_BUDGET


# --------------------------------------------------------------------------- stacks
def test_stack_orders_parts_and_refuses_what_cannot_stack():
    from infer_tune.tuners.kv_cache import KVCacheConfig
    from infer_tune.tuners.lean import LeanConfig
    from infer_tune.tuners.stack import StackConfig

    stack = StackConfig(configs=[{"technique": "kv-cache", "impl": "static"}, {"technique": "quantize", "method": "int4-rtn"}])
    assert stack.techniques() == ["quantize", "kv-cache"] and stack.label() == "int4-rtn-auto-g32+static"
    assert stack.to_dict()["configs"][0]["technique"] == "quantize"
    for bad, fragment in ([[], "non-empty"], [[{"technique": "nope"}], "not one of"],
                          [[QuantizeConfig(), QuantizeConfig(method="bf16")], "appears 2 times"],
                          [[LeanConfig(), KVCacheConfig(impl="static")], "cannot stack"],
                          [[{"technique": "quantize", "bits": 3}], "unknown fields"]):
        with pytest.raises(ConfigError, match=fragment):
            StackConfig(configs=bad)


def test_stack_applies_every_part_on_the_previous_parts_model(tiny_loaded):
    from infer_tune.tuners.stack import StackConfig

    stack = StackConfig(configs=[{"technique": "kv-cache", "impl": "static"},
                                 {"technique": "quantize", "method": "int8-dynamic", "backend": "torch"}])
    prepared = apply(tiny_loaded, stack, RunContext())
    try:
        assert any(isinstance(m, Int8DynamicLinear) for m in prepared.model.modules())  # the weights part ran
        assert prepared.generate_kwargs["cache_implementation"] == "static"  # and the cache part
        assert [p["technique"] for p in prepared.metrics["stack"]] == ["quantize", "kv-cache"]
        assert prepared.runner == "generation" and "kernels" in prepared.metrics
    finally:
        if prepared.cleanup:
            prepared.cleanup()


def test_stack_in_a_recipe_measures_one_row(tiny_model_dir, prompts_file, tmp_path):
    recipe = tmp_path / "stack.yaml"
    recipe.write_text("configs:\n  - technique: stack\n    configs:\n      - {technique: quantize, method: int4-rtn}\n"
                      "      - {technique: lean, compile: false}\n")
    result = runner.invoke(app, ["bench", "--recipe", str(recipe), "--model", str(tiny_model_dir), "--suite",
                                 str(prompts_file), "--limit", "2", "--max-new-tokens", "4", "--min-iterations", "1",
                                 "--min-duration", "0", "--no-ppl", "--out", str(tmp_path / "runs"), "--json"])
    assert result.exit_code == 0, result.output
    base, doc = json.loads(result.stdout)
    assert doc["technique"] == "stack" and doc["runner"] == "lean" and doc["label"] == "int4-rtn-torch-g32+lean"
    assert doc["metrics"]["lean_decode_steps"] > 0 and doc["metrics"]["bytes_ratio_vs_16bit"] < 0.4
    assert base["technique"] == "baseline" and "noise" in doc["metrics"]


# --------------------------------------------------------------------------- lean decode path
@pytest.mark.parametrize("compile_step", [False, True])
def test_lean_is_bit_identical_to_generate(tiny_loaded, compile_step):
    from transformers import GenerationConfig

    from infer_tune.runners.generation import _PinLength, eos_ids
    from infer_tune.tuners.lean.loop import LeanDecoder

    model, tok = tiny_loaded.model, tiny_loaded.tokenizer
    ids = tok(["Question 3: what is 3 plus 3?"], return_tensors="pt")["input_ids"]
    eos = eos_ids(model, tok)
    decoder = LeanDecoder(model, compile=compile_step)
    for cache in ("static", "dynamic"):
        pin = _PinLength(eos, ids.shape[1], 1)
        config = GenerationConfig(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=eos,
                                  cache_implementation=cache if cache == "static" else None)
        with torch.inference_mode():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                       logits_processor=[pin], disable_compile=True)[:, ids.shape[1]:]
        reference = generated[0].tolist()
        _, token_ns, tokens, natural = decoder.generate(ids, 12, eos)
        assert tokens == reference and natural == pin.natural_lengths(generated)[0] and len(token_ns) == 12, cache
    assert decoder.counters.snapshot()["lean_decode_steps"] == 2 * 11
    # compiled: the step was captured once and runs without guards (not the guarded fallback)
    assert decoder.facts["lean_step"] == ("captured" if compile_step else "eager"), decoder.facts
    decoder.generate(ids, 150, eos)  # a 256-position cache of its own; then back to the 128 one
    _, _, again, _ = decoder.generate(ids, 12, eos)
    assert again == reference and decoder.facts["lean_cache_buckets"] == [128, 256]
    if compile_step and torch._inductor.config.fx_graph_cache:
        # the same graph captured again (another decoder of this model): loaded from inductor's FX graph cache, not
        # compiled a second time (tests/conftest.py shares that cache between the suite's processes)
        from torch._dynamo.utils import counters

        hits, bypassed = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_bypass"]
        second = LeanDecoder(model, compile=True)
        _, _, tokens, _ = second.generate(ids, 12, eos)
        assert tokens == reference and second.facts["lean_step"] == "captured", second.facts
        assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1, dict(counters["inductor"])
        assert counters["inductor"]["fxgraph_cache_bypass"] == bypassed
    # an end-of-sequence id greedy does pick (the 4th token): recorded where it first wins, then suppressed
    # as generate() suppresses it (the loop takes a second argmax only on those steps)
    forced = [reference[3]]
    pin = _PinLength(forced, ids.shape[1], 1)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=forced,
                              cache_implementation="static")
    with torch.inference_mode():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                   logits_processor=[pin], disable_compile=True)[:, ids.shape[1]:]
    _, _, tokens, natural = decoder.generate(ids, 12, forced)
    assert tokens == generated[0].tolist() and forced[0] not in tokens
    assert natural == reference.index(forced[0]) == pin.natural_lengths(generated)[0]


def test_captured_step_drops_per_call_asserts(tiny_loaded):
    """The captured step's inputs are fixed once captured: its compiled code checks no shapes per call."""
    from torch._inductor.utils import run_and_get_code

    from infer_tune.runners.generation import eos_ids
    from infer_tune.tuners.lean.loop import LeanDecoder

    model, tok = tiny_loaded.model, tiny_loaded.tokenizer
    ids = tok(["Question 3: what is 3 plus 3?"], return_tensors="pt")["input_ids"]
    decoder = LeanDecoder(model, compile=True)
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(decoder.generate, ids, 4, eos_ids(model, tok))
    assert decoder.facts["lean_step"] == "captured" and codes, decoder.facts
    calls = [line for code in codes for line in code.splitlines()
             if "assert_size_stride(" in line or "assert_alignment(" in line]
    assert not calls, calls[:3]


def test_lean_runs_through_its_runner(tiny_model_dir, prompts_file, tmp_path):
    from infer_tune.scenarios.bench import run_bench
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.tuners.lean import LeanConfig
    from infer_tune.workload import Protocol, Workload

    spec = RunSpec(model=str(tiny_model_dir), workload=Workload(suite=str(prompts_file), limit=2, max_new_tokens=6),
                   protocol=Protocol(warmup=1, min_iterations=2, min_duration_s=0), out_dir=tmp_path / "runs")
    outcome = run_bench(spec, [LeanConfig(compile=False)])
    doc = outcome.docs[0]
    assert doc["runner"] == "lean" and doc["metrics"]["exact_match_vs_baseline"] == 1.0
    assert doc["metrics"]["lean_overhead_ms_per_token"] >= 0 \
        and doc["metrics"]["iterations"] == doc["metrics"]["rounds"]["rounds"]
    # the cache sizes the prompts needed, warmed before the timed passes
    assert doc["metrics"]["lean_cache_buckets"] == [128] and doc["metrics"]["warmup_s"] > 0
    with pytest.raises(ConfigError, match="batch size"):
        run_bench(RunSpec(model=str(tiny_model_dir), workload=Workload(suite=str(prompts_file), limit=2, batch_size=2),
                          out_dir=tmp_path / "runs"), [LeanConfig(compile=False)])


# --------------------------------------------------------------------------- verdicts and noise
def test_broken_results_are_marked_and_never_a_speedup():
    from infer_tune.metrics.deltas import verdict
    from infer_tune.report.leaderboard import flatten

    outputs = [{"token_ids": list(range(20))}] * 3
    assert verdict({"ppl_delta_pct": 4.0e8}, outputs)["broken"]  # the GGUF int4-rtn report: 29.9 -> 120,612,490
    collapsed = {"bleu_vs_baseline": 0.0, "exact_match_vs_baseline": 0.0}
    assert not verdict(collapsed, outputs)["broken"]  # overlap with the baseline alone is not evidence
    dropped = {**collapsed, "bleu_drift": -9.0, "bleu_drift_ci95": [-14.0, -4.0]}
    assert verdict(dropped, outputs)["broken"]  # ... together with quality against the references dropping, it is
    assert not verdict(dropped, [{"token_ids": [1]}])["broken"]
    assert not verdict({"ppl_delta_pct": 12.0, "bleu_vs_baseline": 40.0}, outputs)["broken"]
    doc = {"run_id": "r", "technique": "quantize", "label": "int4-rtn", "metrics": {
        "speedup_vs_baseline": 3.24, "broken": True, "broken_why": "perplexity +403395953%"}}
    row = flatten(doc)
    from infer_tune.report import display

    assert row["speedup_vs_baseline"] is None and display.verdict(row) == "broken"


def test_noise_figure_flags_a_busy_host_and_compare_withholds_a_pass():
    from infer_tune.metrics import noise
    from infer_tune.report import compare as cmp
    from infer_tune.runners.base import RequestTiming

    def request(iteration: int, tpot_ms: float) -> RequestTiming:
        return RequestTiming(0, iteration, 5, 0, [int(10e6 + k * tpot_ms * 1e6) for k in range(5)])

    steady = [request(i, 10.0) for i in range(3)]
    shaky = [request(i, t) for i, t in enumerate((10.0, 14.0, 9.0))]
    idle = noise.HostSnapshot(0.0, 0.0, 0.0, 0.1), noise.HostSnapshot(10.0, 20.0, 19.5, 0.2)
    busy = noise.HostSnapshot(0.0, 0.0, 0.0, 3.0), noise.HostSnapshot(10.0, 20.0, 10.0, 3.5)
    assert not noise.figure(steady, *idle)["noisy"]
    # a spread of per-round medians decides nothing by itself: a run is noisy when its rounds missed the target
    assert not noise.figure(shaky, *idle)["noisy"] and noise.figure(shaky, *idle)["tpot_p50_cv"] > 0.05
    missed = {"target_met": False, "achieved_half_width_pct": 6.5, "target_half_width_pct": 2.0, "rounds": 20,
              "stopped_by": "max_rounds"}
    flagged = noise.figure(shaky, *idle, rounds=missed)
    assert flagged["noisy"] and "±6.5%" in flagged["why"][0] and "20 rounds" in flagged["why"][0]
    assert not noise.figure(shaky, *idle, rounds={**missed, "target_met": True})["noisy"]
    flagged = noise.figure(steady, *busy)
    assert flagged["noisy"] and flagged["other_cpu_share"] == pytest.approx(10.0 / (10.0 * __import__("psutil").cpu_count()))

    def doc(run_id, tpot, noisy):
        samples = [tpot] * 8
        return {"run_id": run_id, "workload": {"suite": "s"}, "model": {"ref": "m"},
                "metrics": {"tpot_ms": {"p50": tpot}, "noise": {"noisy": noisy, "tpot_p50_cv": 0.08}},
                "samples": {"tpot_ms": samples}}

    expr = cmp.parse_expr("tpot_ms.p50 > +5%")
    calm = cmp.judge(expr, doc("b", 10.0, False), doc("c", 10.8, False))
    assert calm.regressed and calm.noise is None  # 8% slower on quiet inputs: a regression
    noisy = cmp.judge(expr, doc("b", 10.0, False), doc("c", 10.8, True))
    assert noisy.regressed and "not used to relax" in noisy.noise  # a noisy candidate is never let off
    near = cmp.judge(expr, doc("b", 10.0, True), doc("c", 10.2, False))
    assert near.outcome == "inconclusive" and "noisy input" in near.noise  # a pass within the noise is withheld


# --------------------------------------------------------------------------- tune
def _doc(tpot, **metrics):
    base = {"tpot_ms": {"p50": tpot}, "ttft_ms": {"p50": 50.0}, "output_throughput_tok_s": 1000 / tpot}
    return {"run_id": f"r{tpot}", "label": "x", "technique": "quantize", "metrics": {**base, **metrics}}


def test_judge_and_pick_winner():
    from infer_tune.scenarios.tune_plan import Candidate, TuneSpec, judge, pick_winner

    spec = TuneSpec(max_ppl_delta=5, max_bleu_drift=1.0)
    fast_broken = _doc(5.0, speedup_vs_baseline=4.0, broken=True, broken_why="perplexity doubled")
    over_budget = _doc(6.0, speedup_vs_baseline=3.3, ppl_delta_pct=9.0)
    slow_kernel = _doc(7.0, speedup_vs_baseline=2.8, kernels={"decode": {"slower_than_fp32": True}})
    good = _doc(8.0, speedup_vs_baseline=2.5, ppl_delta_pct=3.0, bleu_drift=-0.5)
    assert "broken" in judge(fast_broken, spec, lossless_claimed=False).reasons[0]
    assert "perplexity" in judge(over_budget, spec, lossless_claimed=False).reasons[0]
    assert "slower than fp32" in judge(slow_kernel, spec, lossless_claimed=False).reasons[0]
    cands = []
    for doc in (fast_broken, over_budget, slow_kernel, good):
        c = Candidate(QuantizeConfig(), lossless=False, doc=doc, status="measured")
        c.eligible = judge(doc, spec, lossless_claimed=False).eligible
        cands.append(c)
    baseline = _doc(20.0)
    assert pick_winner(cands, baseline, "decode") is good
    assert pick_winner(cands[:3], baseline, "decode") is baseline
    lossless = TuneSpec(require_lossless=True)
    assert "not lossless" in " ".join(judge(good, lossless, lossless_claimed=False).reasons)


def test_host_screen_prunes_what_cannot_win_here(tiny_loaded):
    from infer_tune.scenarios.tune_plan import TuneSpec, candidate, single_candidates
    from infer_tune.tuners.quantize.tune import host_screen, method_offers

    avx2 = {("int8-dynamic", "decode"): ({"fbgemm": 0.5, "int_mm": 20.0, "dequant": 9.0}, 1.0),
            ("int8-dynamic", "prefill"): ({"fbgemm": 1.0, "int_mm": 354.0, "dequant": 9.0}, 7.8),
            ("int4", "decode"): ({"int4pack": 2.0, "dequant": 30.0}, 1.0),
            ("int4", "prefill"): ({"int4pack": 9.0, "dequant": 10.0}, 7.8)}
    screen = host_screen(tiny_loaded.model, ("int8-dynamic", "int4-rtn"), 33, timings=avx2)
    assert screen["int8-dynamic"]["decode"] == pytest.approx(2.0) and screen["int4-rtn"]["decode"] == pytest.approx(0.5)
    cands = {c.label: c for c in map(candidate, method_offers(("int8-dynamic", "int4-rtn"), "decode", screen))}
    assert cands["int4-rtn-auto-g32"].status == "pruned" and "slower than fp32" in cands["int4-rtn-auto-g32"].reason
    assert cands["int8-dynamic-auto"].status == "pending"
    lossless = single_candidates(TuneSpec(require_lossless=True))
    assert lossless and all(c.lossless for c in lossless)


def test_host_screen_prunes_only_when_the_interval_says_slower_than_fp32(tiny_loaded):
    """Per-round samples injected (no timing here): int8's every kernel slower than fp32 in every round
    (interval wholly below 1: pruned, the reason names the interval); int4pack's median a little slower
    than fp32 but its rounds straddle it (kept and measured, the interval recorded)."""
    from infer_tune.scenarios.tune_plan import candidate
    from infer_tune.tuners.quantize.screen import Screen
    from infer_tune.tuners.quantize.tune import host_screen, method_offers

    fp32 = [10.0, 10.1, 9.9, 10.0, 10.2, 9.8, 10.0]
    slow = Screen(samples={"fp32": fp32, "fbgemm": [14.0, 14.3, 13.8, 14.1, 14.4, 13.9, 14.0],
                           "int_mm": [20.0] * 7, "dequant": [30.0] * 7}, rounds=7)
    near = Screen(samples={"fp32": fp32, "int4pack": [9.2, 11.3, 9.5, 11.0, 10.6, 10.4, 9.8],
                           "dequant": [30.0] * 7}, rounds=7)
    prefill = ({"int_mm": 1.0, "dequant": 2.0, "int4pack": 1.0}, 1.5)
    timings = {("int8-dynamic", "decode"): slow, ("int4", "decode"): near,
               ("int8-dynamic", "prefill"): prefill, ("int4", "prefill"): prefill}
    screen = host_screen(tiny_loaded.model, ("int8-dynamic", "int4-rtn"), 33, timings=timings)
    int8, int4 = screen["int8-dynamic"], screen["int4-rtn"]
    assert int8["kernels"]["decode"] == "fbgemm" and int8["decode_speedup_ci95"][1] < 1.0 and int8["decode_rounds"] == 7
    low, high = int4["decode_speedup_ci95"]
    assert int4["decode"] < 1.0 and low < 1.0 < high  # the point says slower, the interval does not
    assert int4["prefill_speedup_ci95"] is None  # point timings: no interval
    cands = {c.label: c for c in map(candidate, method_offers(("int8-dynamic", "int4-rtn"), "decode", screen))}
    pruned, kept = cands["int8-dynamic-auto"], cands["int4-rtn-auto-g32"]
    assert pruned.status == "pruned" and "95% interval" in pruned.reason and "wholly below 1" in pruned.reason
    assert kept.status == "pending" and kept.summary()["kernel_screen_speedup_ci95"] == [low, high]


def test_tune_end_to_end_json(tiny_model_dir, prompts_file, tmp_path):
    out = tmp_path / "runs"
    result = runner.invoke(app, ["tune", "--model", str(tiny_model_dir), "--suite", str(prompts_file), "--limit", "2",
                                 "--max-new-tokens", "4", "--min-iterations", "1", "--min-duration", "0",
                                 "--methods", "int8-dynamic,int4-rtn", "--no-compile", "--max-ppl-delta", "1000",
                                 "--max-bleu-drift", "100", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc) >= {"winner", "tried", "recipe", "command", "kernel_screen"}
    assert doc["winner"]["run_id"] and (out / doc["winner"]["run_id"] / "result.json").is_file() \
        or doc["winner"]["technique"] == "baseline"
    statuses = Counter(t["status"] for t in doc["tried"])
    assert statuses["measured"] + statuses["pruned"] >= 3
    eligible_quantized = any(t["eligible"] and t["technique"] == "quantize" for t in doc["tried"])
    assert any(t["technique"] == "stack" for t in doc["tried"]) == eligible_quantized  # stacks build on survivors
    assert "llama" in " ".join(doc["notes"])  # no GGUF behind a random model: said, not fatal
    replay = runner.invoke(app, ["bench", "--recipe", doc["recipe"], "--model", str(tiny_model_dir), "--suite",
                                 str(prompts_file), "--no-ppl", "--out", str(tmp_path / "replay"), "--json"])
    assert replay.exit_code == 0, replay.output


@pytest.mark.parametrize("extra,fragment", [(["--objective", "speed"], "--objective"),
                                            (["--max-ppl-delta", "-1"], "--max-ppl-delta"),
                                            (["--methods", "int3"], "--methods"),
                                            (["--budget-minutes", "0"], "--budget-minutes")])
def test_tune_bad_input_exits_2_and_writes_nothing(tiny_model_dir, prompts_file, tmp_path, extra, fragment):
    result = runner.invoke(app, ["tune", "--model", str(tiny_model_dir), "--suite", str(prompts_file),
                                 "--out", str(tmp_path / "runs"), *extra])
    assert result.exit_code == 2 and fragment in result.output and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()


def test_llamacpp_reference_needs_a_gguf(tiny_loaded):
    from infer_tune.tuners.llamacpp import LlamaCppConfig, gguf_for

    with pytest.raises(ConfigError, match="not converted from a GGUF"):
        gguf_for(tiny_loaded, LlamaCppConfig())
    with pytest.raises(ConfigError, match="not found"):
        gguf_for(tiny_loaded, LlamaCppConfig(gguf="/nonexistent/model.gguf"))


def test_int4_siblings_merge_into_one_call_with_the_same_result():
    """fuse.py: three int4 Linears reading one input become one int4 call; outputs bit-equal."""
    from infer_tune.tuners.lean.fuse import INT4_MM, fuse_int4_siblings
    from infer_tune.tuners.quantize.apply import int4_quantize
    from infer_tune.tuners.quantize.modules import Int4Linear

    def int4(n, k):
        t = int4_quantize(torch.randn(n, k), 32, hqq=False)
        return Int4Linear(t["qweight_int4"], t["scale"], t["zero"], 32)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = int4(128, 64), int4(64, 64), int4(64, 64), int4(64, 192)
            self.a, self.b = int4(32, 64), int4(64, 64)  # a is 32 wide: the kernel packs rows in 64s

        def forward(self, x):  # o reads another input; a and b one that q, k, v do not
            y = self.o(torch.cat([self.q(x), self.k(x) * self.v(x)], -1).bfloat16())
            return y + torch.cat([self.a(y), self.b(y)], -1)[:, :64]

    block, x = Block(), torch.randn(1, 64).bfloat16()
    captured = {}

    def record(gm, example_inputs):
        captured.update(gm=gm, inputs=list(example_inputs))
        return gm.forward

    with torch.no_grad():
        reference = block(x)
        torch.compile(block, backend=record, fullgraph=True)(x)
        gm, inputs = captured["gm"], captured["inputs"]
        calls = lambda: sum("int4pack" in str(n.target) for n in gm.graph.nodes)  # noqa: E731
        assert calls() == 6
        # a and b merge only where the merged call is exact: on AVX-512 hosts the kernel packs rows in 64s
        # (a 32-wide part is not), on AVX2 ones in 32s (it is)
        probe = torch.randn(2, 64, dtype=torch.bfloat16)
        parts = [(m._tiles, m._scales_and_zeros) for m in (block.a, block.b)]
        separate = torch.cat([INT4_MM(probe, t, 32, s) for t, s in parts], -1)
        merged = INT4_MM(probe, torch.cat([t for t, _ in parts]), 32, torch.cat([s for _, s in parts], 1))
        ab = int(torch.equal(separate, merged))
        inputs, removed = fuse_int4_siblings(gm, inputs)
        assert removed == 2 + ab and calls() == 4 - ab  # q, k, v merged; a and b where exact
        assert torch.equal(gm(*inputs)[0], reference)


def test_tune_decides_from_intervals_and_names_overlapping_contenders():
    from infer_tune.scenarios.tune_plan import Candidate, TuneSpec, decide, judge

    spec = TuneSpec(max_ppl_delta=5, max_bleu_drift=1.0)
    tight = _doc(8.0, speedup_vs_baseline=2.5, speedup_vs_baseline_ci95=[2.45, 2.55])
    wide = _doc(7.5, speedup_vs_baseline=2.7, speedup_vs_baseline_ci95=[2.0, 3.4])
    apart = _doc(12.0, speedup_vs_baseline=1.6, speedup_vs_baseline_ci95=[1.55, 1.65])
    straddles = _doc(19.0, speedup_vs_baseline=1.04, speedup_vs_baseline_ci95=[0.95, 1.13])
    assert "whole 95% interval" in judge(straddles, spec, lossless_claimed=False).reasons[0]
    cands = []
    for doc in (tight, wide, apart, straddles):
        c = Candidate(QuantizeConfig(), lossless=False, doc=doc, status="measured")
        c.eligible = judge(doc, spec, lossless_claimed=False).eligible
        cands.append(c)
    winner, contenders = decide(cands, _doc(20.0), "decode")
    assert winner is tight  # the highest lower bound, not the highest point (wide's 2.7)
    assert [c.doc for c in contenders] == [tight, wide]  # apart's interval does not reach 2.45


# --------------------------------------------------------------------------- tune --objective goodput
def _serving(ratio, ci, good=4, **metrics):
    """A batched row's metrics as tune_goodput writes them (its goodput ratio vs the baseline, 95% interval)."""
    return _doc(10.0, goodput_req_s=1.0, good_requests=good, goodput_ratio_vs_baseline=ratio,
                goodput_ratio_vs_baseline_ci95=ci, **metrics)


def test_goodput_judge_and_decide_take_the_interval():
    from infer_tune.scenarios.tune_plan import Candidate, TuneSpec, decide, judge, may_stack

    spec = TuneSpec(objective="goodput", max_ppl_delta=5, max_bleu_drift=1.0)
    high = _serving(2.4, [1.8, 3.1])
    wide = _serving(2.6, [1.2, 5.0])  # the highest point, not the highest lower bound
    apart = _serving(1.5, [1.3, 1.7])
    straddles = _serving(1.2, [0.8, 1.7])
    none_good = _serving(1.9, [1.5, 2.3], good=0)  # two rows that meet no SLO compare durations, not goodput
    drifted = _serving(3.0, [2.5, 3.5], bleu_drift=-4.0)
    closed_loop = _doc(8.0, speedup_vs_baseline=2.5, ppl_delta_pct=1.0)  # a quantize row: no trace, no goodput
    verdicts = {id(d): judge(d, spec, lossless_claimed=False)
                for d in (high, wide, apart, straddles, none_good, drifted, closed_loop)}
    assert all(verdicts[id(d)].eligible for d in (high, wide, apart))
    assert "more goodput than the baseline with its whole 95% interval" in verdicts[id(straddles)].reasons[0]
    assert "[0.80, 1.70]" in verdicts[id(straddles)].reasons[0]
    assert "no request met the SLOs" in verdicts[id(none_good)].reasons[0]
    assert not verdicts[id(drifted)].eligible and not verdicts[id(drifted)].within_budget
    loop = verdicts[id(closed_loop)]
    assert not loop.eligible and "did not serve the arrival trace" in loop.reasons[0] and loop.within_budget
    cands = []
    for doc in (high, wide, apart, straddles, none_good, drifted, closed_loop):
        c = Candidate(QuantizeConfig(), lossless=False, doc=doc, status="measured")
        c.eligible, c.within_budget = verdicts[id(doc)].eligible, verdicts[id(doc)].within_budget
        cands.append(c)
    baseline = _doc(20.0)
    winner, contenders = decide(cands, baseline, "goodput")
    assert winner is high and [c.doc for c in contenders] == [high, wide]  # apart's interval ends below 1.8
    assert decide(cands[3:], baseline, "goodput") == (baseline, [])
    # a quantize row within the budgets gets its batched stacks under goodput; under throughput it must win first
    assert may_stack(cands[-1], spec) and not may_stack(cands[-1], TuneSpec(objective="throughput"))
    assert not may_stack(cands[5], spec)


def test_goodput_objective_plans_batched_stacks_on_a_poisson_trace():
    from infer_tune.scenarios.tune_plan import Candidate, TuneSpec, single_candidates, stack_candidates

    spec = TuneSpec(objective="goodput", rate=2.5, seed=7)
    cand = Candidate(QuantizeConfig(method="int4-rtn"), lossless=False, method="int4-rtn")
    parts = [c.config.configs[1] for c in stack_candidates(spec, [cand])]
    assert [p.batch_size for p in parts] == [4, 8]  # only the batched stacks: a single stream serves one at a time
    assert all(p.technique == "batch" and p.scheduler == "continuous" and p.engine == "lean" and p.rate == 2.5
               and p.seed == 7 for p in parts)
    assert stack_candidates(TuneSpec(objective="goodput", compile=False), [cand]) == []
    # where the native step runs the base, the slots with it, and with prompt-lookup drafts: tune decides by measuring
    native = Candidate(QuantizeConfig(method="int4-rtn", activations="int8"), lossless=False, method="int4-rtn")
    batched = [c.config.configs[1] for c in stack_candidates(spec, [native])]
    assert [(p.batch_size, p.native_step, p.speculate) for p in batched] == [
        (4, False, 0), (8, False, 0), (4, True, 0), (8, True, 0), (4, True, 8), (8, True, 8)]
    assert not [c for c in single_candidates(spec) if c.config.technique == "lean"]
    assert [c for c in single_candidates(TuneSpec()) if c.config.technique == "lean"]
    for bad, fragment in (({"rate": -1.0}, "rate"), ({"rate": float("inf")}, "rate"),
                          ({"slo_ttft_ms": -5.0}, "ttft_ms"), ({"slo_tpot_ms": 0.0}, "tpot_ms"),
                          ({"objective": "latency"}, "objective")):
        with pytest.raises(ConfigError, match=fragment):
            TuneSpec(**{"objective": "goodput", **bad})


def test_one_request_at_a_time_queues_behind_the_request_before():
    from infer_tune.metrics.saturation import one_at_a_time

    timings, duration = one_at_a_time([0.0, 0.1, 5.0], [100.0, 100.0, 100.0], [10.0, 10.0, 10.0], [5, 5, 5])
    # the first ends at 0.14 s; the second, arrived at 0.1 s, waits 40 ms; the third finds the server free
    assert [t.ttft_ms for t in timings] == pytest.approx([100.0, 140.0, 100.0])
    assert [t.e2e_ms for t in timings] == pytest.approx([140.0, 180.0, 140.0])
    assert [t.tpot_ms for t in timings] == pytest.approx([10.0, 10.0, 10.0]) and duration == pytest.approx(5.14)


def _trace_row(tmp_path, rows, rounds, ttft, e2e, tokens, group="g"):
    """A candidate that replayed `rows` once per round (its trace.jsonl beside it), each request timed."""
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    order = [r["prompt_index"] for r in rows]
    return _located({"metrics": {"rounds": {"rounds": rounds, "group": group}},
                     "samples": {"prompt_index": order * rounds, "ttft_ms": ttft, "e2e_ms": e2e,
                                 "output_tokens": tokens}}, tmp_path)


def _located(data: dict, location):
    """A hand-made row typed, with the folder it would have been saved in (`location`, as a saved result has)."""
    from infer_tune.document import as_document

    doc = as_document(data)
    doc.location = location
    return doc


def test_goodput_keys_pair_each_round_with_the_baseline_serving_the_trace_alone(tmp_path):
    import math

    from infer_tune.metrics.saturation import SLO
    from infer_tune.scenarios.tune_goodput import goodput_keys

    rows = [{"prompt_index": 1, "arrival_s": 0.0, "output_tokens": 4},
            {"prompt_index": 0, "arrival_s": 0.5, "output_tokens": 3}]
    cand_e2e = [80.0, 90.0, 85.0, 95.0, 70.0, 99.0]
    cand = _trace_row(tmp_path, rows, 3, [50.0, 60.0] * 3, cand_e2e, [4, 3] * 3)
    base_ttft = [400.0, 500.0, 410.0, 520.0, 390.0, 480.0]  # prompt 0, prompt 1, per round
    base_e2e = [900.0, 1000.0, 950.0, 1020.0, 880.0, 990.0]
    baseline = {"metrics": {"rounds": {"rounds": 3, "group": "g"}},
                "samples": {"prompt_index": [0, 1] * 3, "ttft_ms": base_ttft, "e2e_ms": base_e2e,
                            "output_tokens": [8, 8] * 3}}
    slo = SLO(ttft_ms=600.0, tpot_ms=500.0)
    m = goodput_keys([cand], baseline, slo, 2.0).metrics[cand.run_id]  # the sweep's keys, saved beside the row
    expected = []
    for k in range(3):
        # the candidate: both requests good, the replay ends at the later of arrival + e2e
        d_c = max(0.0 + cand_e2e[2 * k] / 1000, 0.5 + cand_e2e[2 * k + 1] / 1000)
        # the baseline alone: prompt 1 (arrives at 0) for 4 tokens, then prompt 0 (arrives at 0.5 s) behind it
        tpot1 = (base_e2e[2 * k + 1] - base_ttft[2 * k + 1]) / 7
        tpot0 = (base_e2e[2 * k] - base_ttft[2 * k]) / 7
        end1 = (base_ttft[2 * k + 1] + 3 * tpot1) / 1000
        start0 = max(0.5, end1)
        ttft0 = 1000 * (start0 - 0.5) + base_ttft[2 * k]
        good_b = (base_ttft[2 * k + 1] <= 600) + (ttft0 <= 600)
        d_b = 0.5 + (ttft0 + 2 * tpot0) / 1000
        expected.append(((2 + 0.5) / d_c) / ((good_b + 0.5) / d_b))
        assert m["goodput_vs_baseline"]["baseline_by_round"][k] == pytest.approx(good_b / d_b)
        assert m["goodput_vs_baseline"]["by_round"][k] == pytest.approx(2 / d_c)
    point = math.exp(sum(math.log(r) for r in expected) / 3)
    assert m["goodput_ratio_vs_baseline"] == pytest.approx(point)
    low, high = m["goodput_ratio_vs_baseline_ci95"]
    assert low < point < high and m["goodput_vs_baseline"]["paired"]
    assert m["good_requests"] == 6 and m["slo_attainment"] == 1.0 and m["goodput_req_s"] > 0
    assert m["goodput_vs_baseline"]["baseline_good_requests"] < 6

    # a baseline that meets no SLO at all: every round's ratio stays finite (half a request on each side)
    strict = _trace_row(tmp_path, rows, 3, [50.0, 60.0] * 3, cand_e2e, [4, 3] * 3)
    sm = goodput_keys([strict], baseline, SLO(ttft_ms=100.0, tpot_ms=500.0), 2.0).metrics[strict.run_id]
    assert sm["goodput_vs_baseline"]["baseline_good_requests"] == 0 and math.isfinite(sm["goodput_ratio_vs_baseline"])
    assert sm["goodput_ratio_vs_baseline_ci95"][0] > 1

    # rounds that are not the baseline's (a resumed row): a point from the pooled figures, no interval
    other = _trace_row(tmp_path, rows, 3, [50.0, 60.0] * 3, cand_e2e, [4, 3] * 3, group="elsewhere")
    om = goodput_keys([other], baseline, slo, 2.0).metrics[other.run_id]
    assert om["goodput_ratio_vs_baseline_ci95"] is None
    assert om["goodput_vs_baseline"]["paired"] is False and om["goodput_ratio_vs_baseline"]

    closed = _located({"metrics": {"rounds": {"rounds": 3, "group": "g"}}, "samples": {}}, tmp_path / "none")
    assert goodput_keys([closed], baseline, slo, 2.0).metrics == {}  # replayed no trace: nothing added


def test_tune_goodput_end_to_end(tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    """`tune --objective goodput` on a tiny model: the int4 row within the budgets gets its batched stacks,
    which replay the trace beside the baseline; their saved results carry goodput, the baseline's on the
    same trace and the ratio's 95% interval; the winner is the one the interval rule picks (or the baseline).
    Injected kernel timings (int4 faster than fp32) keep the host's kernel screen out of it; the slot engine
    runs eager (its compiled path is tests/test_batch_slots.py's)."""
    from infer_tune import results
    from infer_tune.scenarios.tune_plan import Candidate, TuneSpec, decide, judge
    from infer_tune.tuners.batch import slots as slots_module

    monkeypatch.setattr(slots_module.SlotBatcher.__init__, "__kwdefaults__",
                        {"timeout_ms": None, "compile": False, "compile_prefill": False, "every_bucket": True,
                         "shared": None})
    monkeypatch.setattr(kernel_choice, "screen_kernels",
                        lambda shapes, rows, kind, **_: ({k: 1.0 for k in kernel_choice.KERNELS[kind]}, 2.0))
    out = tmp_path / "runs"
    args = ["tune", "--model", str(tiny_model_dir), "--suite", str(prompts_file), "--limit", "2", "--max-new-tokens",
            "4", "--min-iterations", "1", "--min-duration", "0", "--max-rounds", "4", "--methods", "int4-rtn",
            "--max-ppl-delta", "1000", "--max-bleu-drift", "100", "--no-reference", "--objective", "goodput",
            "--rate", "20", "--slo-ttft-ms", "5000", "--slo-tpot-ms", "500", "--out", str(out), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["objective"] == "goodput" and doc["serving"]["rate_req_s"] == 20.0
    assert doc["serving"]["slo"] == {"ttft_ms": 5000.0, "tpot_ms": 500.0} and doc["serving"]["requests"] == 2
    assert any("goodput:" in n and "one request at a time" in n for n in doc["notes"])
    batched = [t for t in doc["tried"] if t["technique"] == "stack" and t["status"] == "measured"]
    assert len(batched) == 2 and not [t for t in doc["tried"] if t["technique"] == "lean"]
    spec = TuneSpec(objective="goodput", max_ppl_delta=1000, max_bleu_drift=100, rate=20.0)
    cands = []
    for row in batched:
        saved = results.load_result(out / row["run_id"])
        m = saved["metrics"]
        assert [p["technique"] for p in saved["config"]["configs"]] == ["quantize", "batch"]
        assert m["goodput_req_s"] > 0 and m["slo"] == {"ttft_ms": 5000.0, "tpot_ms": 500.0}
        assert m["goodput_vs_baseline"]["paired"] and m["goodput_vs_baseline"]["requests_per_round"] == 2
        assert m["goodput_vs_baseline"]["baseline_goodput_req_s"] > 0
        assert len(m["goodput_vs_baseline"]["by_round"]) == m["rounds"]["rounds"] >= 3
        low, high = m["goodput_ratio_vs_baseline_ci95"]
        assert low <= m["goodput_ratio_vs_baseline"] <= high
        assert row["goodput_ratio_vs_baseline_ci95"] == [low, high]
        verdict = judge(saved, spec, lossless_claimed=False)
        assert row["eligible"] == verdict.eligible == (low > 1.0 and m["good_requests"] > 0)
        cands.append(Candidate(QuantizeConfig(), lossless=False, doc=saved, status="measured",
                               eligible=verdict.eligible))
    winner, _ = decide(cands, {"run_id": "base", "technique": "baseline"}, "goodput")
    expected = "baseline" if winner["run_id"] == "base" else winner["run_id"]
    assert (doc["winner"]["technique"] if expected == "baseline" else doc["winner"]["run_id"]) == expected


def test_tune_offers_int8_activations_as_their_own_method():
    from infer_tune.scenarios.tune_plan import TuneSpec, tune_methods
    from infer_tune.tuners.lean import LeanConfig
    from infer_tune.tuners.quantize.tune import TUNE_METHODS, method_kind, quantize_config

    assert "int4-rtn-a8" in TUNE_METHODS and set(TUNE_METHODS) <= set(tune_methods()) and TuneSpec(methods=("int4-rtn-a8",)).methods == ("int4-rtn-a8",)
    config = quantize_config("int4-rtn-a8")
    assert (config.method, config.activations) == ("int4-rtn", "int8") and config.label().endswith("-a8")
    assert quantize_config("int4-rtn").activations == "bf16"
    assert [method_kind(m) for m in ("int4-rtn-a8", "int4-weight", "int8-dynamic", "bf16")] == \
        ["int4-a8", "int4", "int8-dynamic", "bf16"]
    assert LeanConfig().label() == "lean+compile" and LeanConfig(attention="sdpa").label() == "lean+compile+sdpa"
    with pytest.raises(ConfigError, match="attention"):
        LeanConfig(attention="flash")


def test_a_candidates_rounds_end_once_its_interval_settles_its_place():
    from infer_tune.scenarios.tune import Leader, _leader, _plan, decided
    from infer_tune.scenarios.tune_plan import Candidate, TuneSpec

    key = "speedup_vs_baseline"

    def group(*bounds):
        return {f"c{i}": {key: {"ci95": list(b)}} for i, b in enumerate(bounds)}

    # behind the leader's lower bound: cannot win
    assert decided(key, Leader("lean", 2.0, 2.2), group((1.6, 1.9))).startswith(f"{key} at most 1.90 (95% interval), below")
    assert decided(key, Leader("lean", 1.8, 2.2), group((1.6, 1.9))) is None  # reaches the leader's interval: open
    # ahead of the baseline and of the leader's upper bound: leads, separated
    assert "the leader lean's upper bound 2.20" in decided(key, Leader("lean", 1.8, 2.2), group((2.3, 2.6)))
    assert decided(key, Leader("lean", 1.8, 2.2), group((2.1, 2.6))) is None
    # no leader yet: settled once the interval is wholly above 1, or wholly below it (never eligible)
    assert decided(key, None, group((1.05, 1.3))).endswith("above the baseline")
    assert "not above the baseline" in decided(key, None, group((0.7, 0.95)))
    assert decided(key, None, group((0.95, 1.3))) is None
    # a group stops only when every candidate in it is settled; a missing interval keeps it going
    assert decided(key, None, group((1.05, 1.3), (0.95, 1.3))) is None
    assert decided(key, None, {"x": {key: None}}) is None
    # rivals: a group measured together goes on until its best separates from the others above the baseline
    assert decided(key, None, group((2.0, 3.0), (2.5, 3.5))) is not None
    assert decided(key, None, group((2.0, 3.0), (2.5, 3.5)), rivals=True) is None
    separated = decided(key, None, group((2.0, 2.4), (2.5, 3.5), (0.5, 0.9)), rivals=True)
    assert "at most 2.40 (95% interval), below c1's 2.50" in separated and "above the baseline and c0's upper bound 2.40" in separated
    assert "c1" not in decided(key, Leader("lean", 1.0, 1.2), group((2.5, 3.5), (0.5, 0.9)), rivals=True)
    plan = _plan(TuneSpec())  # rivals for RIVAL_ROUNDS calls, then each candidate against the baseline and leader
    from infer_tune.scenarios.tune import RIVAL_ROUNDS

    assert [plan.stop_rounds(group((2.0, 3.0), (2.5, 3.5))) is None for _ in range(RIVAL_ROUNDS + 1)] == \
        [True] * RIVAL_ROUNDS + [False]
    leader = Candidate(QuantizeConfig(), lossless=False, doc=_doc(8.0, speedup_vs_baseline=2.5,
                                                                    speedup_vs_baseline_ci95=[2.4, 2.6]))
    leader.eligible = True
    other = Candidate(QuantizeConfig(method="bf16"), lossless=False, doc=_doc(9.0, speedup_vs_baseline=3.0,
                                                                              speedup_vs_baseline_ci95=[2.9, 3.1]))
    assert _leader([leader, other], "decode") == (leader.label, 2.4, 2.6)  # only eligible rows lead
    assert _plan(TuneSpec(), None).stop_rounds is not None and _plan(TuneSpec(), Leader("lean", 2.4, 2.6)).stop_rounds
    assert _plan(TuneSpec(), None, settle=False) is None  # contenders measured again: to the target
    assert _plan(TuneSpec(objective="goodput"), Leader("lean", 2.4, 2.6)).stop_rounds(group((0.5, 3.0))) is None


def test_the_time_budget_expects_the_costliest_similar_row_and_ends_rounds_once_spent():
    from infer_tune.scenarios.tune import Budget, _plan
    from infer_tune.scenarios.tune_plan import Candidate, TuneSpec

    plain, compiled = Candidate(QuantizeConfig(), lossless=False), Candidate(QuantizeConfig(), lossless=False)
    compiled.compiles = True
    budget = Budget(1200.0)
    assert budget.expected(plain) == 0.0 and budget.expected(compiled) == 150.0  # nothing measured: the allowance
    budget.record([plain, plain], 189.6)  # a group's shares, then a slower row alone (a 2-core run's costs)
    budget.record([plain], 167.2)
    budget.record([compiled], 281.0)
    assert budget.expected(plain) == 167.2 and budget.expected(compiled) == 281.0
    budget.start -= 1088.3  # that run's clock when it started a 203 s row expecting the median, 94.8 s
    assert not budget.fits(plain) and budget.fits_all([]) and not budget.spent
    key = "speedup_vs_baseline"
    open_interval = {"c0": {key: {"ci95": [0.9, 1.3]}}}
    for spec in (TuneSpec(), TuneSpec(objective="goodput")):
        assert _plan(spec, budget=budget).stop_rounds(open_interval) is None
    budget.start -= 120.0
    assert budget.spent
    for spec in (TuneSpec(), TuneSpec(objective="goodput")):
        assert _plan(spec, budget=budget).stop_rounds(open_interval) == "the time budget (1200 s) is spent"
        assert _plan(spec).stop_rounds(open_interval) is None  # no budget given: rounds go on


def test_the_most_promising_method_shares_its_rounds_with_its_compiled_stacks(tiny_model_dir, prompts_file, tmp_path,
                                                                              monkeypatch):
    """The screen's first method and its lean stacks are measured in one group (one baseline pass per round
    for all); its static-cache stack waits until the method may win; the next eligible method gets its own
    stack after it. The leader after each measurement is kept, and the winner was found when it became the
    leader for good. Measurements come from a scripted executor (the search, not the speed, is under test)."""
    from infer_tune import executors
    from infer_tune.scenarios import tune as tune_module
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.scenarios.tune_plan import TuneSpec
    from infer_tune.workload import Protocol, Workload
    from tests.plugins.tunable import ScriptedExecutor

    executor = ScriptedExecutor({
        "int4-rtn-auto-g32": (3.0, 2.8, 3.2), "int8-dynamic-auto": (2.0, 1.9, 2.1),
        "int4-rtn-auto-g32+lean+compile": (9.0, 8.0, 10.0), "int4-rtn-auto-g32+lean+compile+cpp": (10.0, 9.6, 10.4),
        "int4-rtn-auto-g32+static+compile": (4.0, 3.8, 4.2), "int8-dynamic-auto+lean+compile": (5.0, 4.8, 5.2),
        "lean+compile": (1.5, 1.4, 1.6), "lean": (1.2, 1.1, 1.3)})
    groups = executor.groups
    monkeypatch.setattr(kernel_choice, "screen_kernels",  # int4 the most promising, then int8
                        lambda shapes, rows, kind, **_: ({k: 1.0 if kind == "int4" else 1.5
                                                          for k in kernel_choice.KERNELS[kind]}, 2.0))
    spec = RunSpec(model=str(tiny_model_dir), workload=Workload(suite=str(prompts_file), limit=2, max_new_tokens=4),
                   protocol=Protocol(warmup=0, min_iterations=1, min_duration_s=0), out_dir=tmp_path / "runs",
                   measure_ppl=False)
    with executors.use(executor):
        outcome = tune_module.run_tune(spec, TuneSpec(methods=("int8-dynamic", "int4-rtn"), reference=False))
    assert groups == [["int4-rtn-auto-g32", "int4-rtn-auto-g32+lean+compile", "int4-rtn-auto-g32+lean+compile+cpp"],
                      ["int4-rtn-auto-g32+static+compile"], ["int8-dynamic-auto"],
                      ["int8-dynamic-auto+lean+compile"], ["lean+compile"], ["lean"],
                      # the two lean stacks' intervals overlap: measured again together at the end
                      ["int4-rtn-auto-g32+lean+compile+cpp", "int4-rtn-auto-g32+lean+compile"]]
    assert outcome.winner["run_id"] == outcome.winner_label == "int4-rtn-auto-g32+lean+compile+cpp"
    assert [e["leader"] for e in outcome.leaders] == ["int4-rtn-auto-g32+lean+compile+cpp"] * 6
    assert outcome.winner_found_s == outcome.leaders[0]["s"] > 0
    # the winner's own first measurement does not make it found: it must lead from then on
    outcome.leaders[:] = [{"s": 1.0, "leader": "int4-rtn-auto-g32+lean+compile+cpp"}, {"s": 2.0, "leader": "other"},
                          {"s": 3.0, "leader": "int4-rtn-auto-g32+lean+compile+cpp"}]
    assert outcome.winner_found_s == 3.0 and outcome.to_dict()["leaders"][1]["leader"] == "other"


@pytest.mark.parametrize("native_runs", [True, False])
def test_native_stacks_go_first_and_the_compiled_ones_share_their_own_rounds(monkeypatch, native_runs):
    from infer_tune.scenarios.tune_plan import Candidate, TuneSpec, beside_method
    from infer_tune.tuners import lean
    from infer_tune.tuners.kv_cache import KVCacheConfig

    monkeypatch.setattr(lean, "native_step_runs", lambda: native_runs)
    cand = Candidate(QuantizeConfig(method="int4-rtn", activations="int8"), lossless=False, method="int4-rtn")
    beside, later = beside_method(TuneSpec(), cand)
    if native_runs:  # before any compile: the native step alone beside its method
        assert [c.config.configs[1].native_step for c in beside] == [True] and not beside[0].compiles
        compiled = [c for c in later if not isinstance(c.config.configs[1], KVCacheConfig)]
        assert len(compiled) == 2 and all(c.compiles and c.rounds_with for c in compiled)
        assert len({c.rounds_with for c in compiled}) == 1  # one group of shared rounds
    else:  # nothing native: the compiled stacks beside it, as before
        assert len(beside) == 2 and all(c.compiles for c in beside)
    assert isinstance(later[-1].config.configs[1], KVCacheConfig) and later[-1].rounds_with is None


def test_a_registered_technique_is_searched_by_its_offers(tiny_model_dir, prompts_file, tmp_path):
    """Two techniques registered by the test alone (tests/plugins/tunable.py), searched through `run_tune`
    with a scripted executor: the bases most promising first (the pruned one never measured), the first
    base measured in one group with the part that compiles nothing, its compiled parts (its own and the
    lean path's) as one group of shared rounds, the late parts after it, the second base that may win
    stacked with its parts after it (not the first base's only ones), the contenders measured again
    together, and the winner the highest lower bound."""
    from infer_tune import executors
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.scenarios.tune import run_tune
    from infer_tune.scenarios.tune_plan import TuneSpec
    from infer_tune.workload import Workload
    from tests.plugins import tunable

    executor = tunable.ScriptedExecutor({
        "t-fast": (3.0, 2.8, 3.2), "t-slow": (1.5, 1.4, 1.6), "t-fast+part-cheap": (5.0, 4.8, 5.2),
        "t-fast+part-c1": (6.0, 5.0, 7.0), "t-fast+part-c2": (6.5, 5.5, 7.5), "t-slow+part-cheap": (2.0, 1.9, 2.1)})
    spec = RunSpec(model=str(tiny_model_dir), workload=Workload(suite=str(prompts_file), limit=1, max_new_tokens=2),
                   out_dir=tmp_path / "out", measure_ppl=False)
    tunable.register()
    try:
        with executors.use(executor):
            outcome = run_tune(spec, TuneSpec(methods=tunable.METHODS, budget_s=3600, reference=False))
    finally:
        tunable.unregister()
    groups = executor.groups
    assert groups[0] == ["t-fast", "t-fast+part-cheap"]  # before any compile, in the same rounds
    assert sorted(groups[1]) == sorted(["t-fast+lean+compile", "t-fast+lean+compile+cpp", "t-fast+part-c1",
                                        "t-fast+part-c2"])  # the compiled parts: one group of shared rounds
    assert groups[2:4] == [["t-fast+static+compile"], ["t-fast+part-late"]]  # not beside: after it may win
    assert groups[4] == ["t-slow"]
    assert groups[5:9] == [["t-slow+lean+compile"], ["t-slow+part-cheap"], ["t-slow+part-c1"], ["t-slow+part-c2"]]
    assert groups[9:11] == [["lean+compile"], ["lean"]]  # the single rows, after the bases and their stacks
    assert sorted(groups[11]) == ["t-fast+part-c1", "t-fast+part-c2"] and len(groups) == 12  # contenders, again
    tried = {t["label"]: t for t in outcome.tried()}
    assert tried["t-pruned"]["status"] == "pruned" and tried["t-pruned"]["reason"] == tunable.PRUNED
    assert not [g for g in groups if "t-pruned" in " ".join(g)]
    assert outcome.screen == {m: {"decode": tunable.ESTIMATES[m], "screened": True} for m in tunable.METHODS}
    assert outcome.winner["run_id"] == "t-fast+part-c2" and "not separated" in " ".join(outcome.notes)


def test_a_registered_technique_is_measured_by_the_tune_command(tiny_model_dir, prompts_file, tmp_path):
    """`infer-tune tune` measures a test package's techniques for real: its base rows, the part stacked beside
    the first base in the same rounds, the pruned method listed and never measured, a recipe that reruns."""
    from tests.plugins import tunable

    out = tmp_path / "runs"
    tunable.register()
    try:
        result = runner.invoke(app, ["tune", "--model", str(tiny_model_dir), "--suite", str(prompts_file), "--limit",
                                     "2", "--max-new-tokens", "4", "--min-iterations", "1", "--min-duration", "0",
                                     "--max-rounds", "3", "--methods", "t-fast,t-pruned", "--no-compile",
                                     "--no-reference", "--max-ppl-delta", "1000", "--max-bleu-drift", "100",
                                     "--out", str(out), "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        tried = {t["label"]: t for t in doc["tried"]}
        assert tried["t-pruned"]["status"] == "pruned" and tried["t-pruned"]["run_id"] is None
        assert tried["t-fast"]["status"] == tried["t-fast+part-cheap"]["status"] == "measured"
        first, beside = (results.load_result(out / tried[k]["run_id"]) for k in ("t-fast", "t-fast+part-cheap"))
        assert first["metrics"]["test_base"] == beside["metrics"]["test_base"] == "t-fast"
        assert beside["metrics"]["test_part"] == "part-cheap" and "test_part" not in first["metrics"]
        assert [p["technique"] for p in beside["config"]["configs"]] == ["test-base", "test-part"]
        assert first["metrics"]["rounds"]["group"] == beside["metrics"]["rounds"]["group"]  # the same rounds
        assert doc["kernel_screen"]["t-fast"]["screened"] is True
        replay = runner.invoke(app, ["bench", "--recipe", doc["recipe"], "--model", str(tiny_model_dir), "--suite",
                                     str(prompts_file), "--limit", "1", "--max-new-tokens", "2", "--min-iterations",
                                     "1", "--min-duration", "0", "--no-ppl", "--out", str(tmp_path / "replay"), "--json"])
        assert replay.exit_code == 0, replay.output
    finally:
        tunable.unregister()


def test_tune_scenarios_name_no_technique():
    """scenarios/tune*.py know techniques only through the registry: no technique's name as a string, no
    technique module imported or cited, no config class named (the names come from the registry)."""
    import ast
    import re
    from pathlib import Path

    import infer_tune
    from infer_tune.tuners.base import TECHNIQUES, load_techniques

    load_techniques()
    names = {cls.technique for cls in TECHNIQUES}
    classes = {cls.__name__ for cls in TECHNIQUES}
    tuners_dir = Path(infer_tune.__file__).parent / "tuners"
    modules = {p.stem for p in tuners_dir.iterdir() if p.stem not in ("base", "__init__", "__pycache__")
               and (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert {"quantize", "lean", "kv_cache", "batch", "stack", "llamacpp"} <= modules and "kv-cache" in names
    cited = re.compile(r"tuners[./](" + "|".join(sorted(modules)) + r")\b")
    found = []
    files = sorted((tuners_dir.parent / "scenarios").glob("tune*.py"))
    assert len(files) >= 3
    for file in files:
        text = file.read_text(encoding="utf-8")
        found += [f"{file.name}: cites {m.group(0)}" for m in cited.finditer(text)]
        found += [f"{file.name}: names {c}" for c in sorted(classes) if re.search(rf"\b{c}\b", text)]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip() in names:
                found.append(f"{file.name}:{node.lineno} the string {node.value!r}")
            elif isinstance(node, ast.ImportFrom) and node.module and (
                    any(node.module.startswith(f"infer_tune.tuners.{m}") for m in modules)
                    or node.module == "infer_tune.tuners" and {a.name for a in node.names} & modules):
                found.append(f"{file.name}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Name) and node.id in modules | classes:
                found.append(f"{file.name}:{node.lineno} the name {node.id}")
            elif isinstance(node, ast.Attribute) and node.attr in classes:
                found.append(f"{file.name}:{node.lineno} the attribute {node.attr}")
    assert not found, found
