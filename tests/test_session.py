"""Baseline-in-the-same-session: reuse of a matching baseline, --resume, and versus-baseline keys."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from infer_tune import env as envinfo
from infer_tune.errors import ConfigError
from infer_tune.results import find_results
from infer_tune.runners import PreparedModel, Protocol
from infer_tune.sweep import prepare_inputs, run_configs
from infer_tune.tuners import RunContext, TechniqueConfig, register_technique, unregister_technique
from infer_tune.workload import Workload

ONCE = Protocol(warmup=0, min_iterations=1, min_duration_s=0)


@dataclass
class NoiseConfig(TechniqueConfig):
    """Test technique: perturbs the weights so outputs drift."""

    technique: ClassVar[str] = "test-noise"
    scale: float = 0.0


def _apply_noise(loaded, config: NoiseConfig, ctx) -> PreparedModel:
    import copy

    model = copy.deepcopy(loaded.model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * config.scale)
    return PreparedModel(model, loaded.tokenizer, label=f"noise-{config.scale}")


def _registration():
    register_technique(NoiseConfig)(_apply_noise)
    yield NoiseConfig
    unregister_technique(NoiseConfig)


@pytest.fixture()
def noise_technique():
    yield from _registration()


def test_run_configs_reuses_baseline_and_resumes(noise_technique, tiny_loaded, prompts_file, tmp_path):
    workload = Workload(suite=str(prompts_file), limit=3, max_new_tokens=6)
    inputs = prepare_inputs(tiny_loaded, workload)
    ctx = RunContext(env=envinfo.collect_env(1), out_dir=tmp_path)
    configs = [NoiseConfig(scale=0.0), NoiseConfig(scale=0.5)]
    base1, docs1 = run_configs(tiny_loaded, inputs, workload, ONCE, configs, ctx)
    assert docs1[0]["metrics"]["exact_match_vs_baseline"] == 1.0  # no noise: identical outputs
    assert docs1[0]["metrics"]["bleu_drift"] == 0.0
    assert docs1[1]["metrics"]["output_mismatches"] > 0  # noise: outputs drift
    assert docs1[1]["metrics"]["ppl_delta_pct"] != 0.0
    assert all(d["baseline_run_id"] == base1["run_id"] for d in docs1)
    base2, docs2 = run_configs(tiny_loaded, inputs, workload, ONCE, configs, ctx, resume=True)
    assert base2["run_id"] == base1["run_id"]  # reused, not re-measured
    assert [d["run_id"] for d in docs2] == [d["run_id"] for d in docs1]  # resumed
    assert len(find_results(tmp_path)) == 3
    other = Workload(suite=str(prompts_file), limit=2, max_new_tokens=6)
    base3, _ = run_configs(tiny_loaded, prepare_inputs(tiny_loaded, other), other, ONCE, [], ctx)
    assert base3["run_id"] != base1["run_id"]  # a different workload gets its own baseline
    longer = Protocol(warmup=0, min_iterations=2, min_duration_s=0)
    base4, _ = run_configs(tiny_loaded, inputs, workload, longer, [], ctx)
    assert base4["run_id"] != base1["run_id"]  # another protocol is another measurement


def test_baseline_reuse_does_not_depend_on_the_date(noise_technique, tiny_loaded, prompts_file, tmp_path):
    """A baseline measured before midnight is still the same measurement after it."""
    import json

    workload = Workload(suite=str(prompts_file), limit=2, max_new_tokens=4)
    inputs = prepare_inputs(tiny_loaded, workload)
    ctx = RunContext(env=envinfo.collect_env(1), out_dir=tmp_path)
    base1, _ = run_configs(tiny_loaded, inputs, workload, ONCE, [], ctx)
    stored = tmp_path / base1["run_id"] / "result.json"
    doc = json.loads(stored.read_text())
    doc["created_at"] = "1999-12-31T23:59:59+0000"
    stored.write_text(json.dumps(doc))
    base2, _ = run_configs(tiny_loaded, inputs, workload, ONCE, [], ctx)
    assert base2["run_id"] == base1["run_id"]


def test_a_rows_roofline_ceiling_is_the_read_of_its_weights_in_its_own_rounds(noise_technique, tiny_loaded,
                                                                              prompts_file, tmp_path):
    """Measured in rounds, a row's roofline ceiling is the median of its rounds' plain reads of its weights (taken
    beside its passes), not the host's cached reading; a single pass reads its weights once after the run."""
    import statistics

    workload = Workload(suite=str(prompts_file), limit=2, max_new_tokens=4)
    inputs = prepare_inputs(tiny_loaded, workload)
    env = dict(envinfo.collect_env(1), mem_bandwidth_gb_s=1e-6)  # a reading no read of real memory is near
    ctx = RunContext(env=env, out_dir=tmp_path)
    protocol = Protocol(warmup=0, min_iterations=4, min_duration_s=0, max_rounds=4)
    base, docs = run_configs(tiny_loaded, inputs, workload, protocol, [NoiseConfig(0.0)], ctx)
    for doc in (base, *docs):
        reads = doc["metrics"]["rounds"]["read_gb_s_by_round"]
        assert len(reads) == doc["metrics"]["rounds"]["rounds"] and all(r > 0.01 for r in reads)
        assert doc["metrics"]["roofline_bandwidth_gb_s"] == statistics.median(reads)
        assert doc["metrics"]["roofline_bandwidth_from"] == "read of the weights in the rounds"
        assert doc["metrics"]["roofline_tok_s"] > 1.0  # at the 1e-6 GB/s reading: far below a token a second
        # the fraction pairs each round's decode with the read taken after it
        by_round = doc["metrics"]["roofline_fraction_by_round"]
        assert len(by_round) == len(reads) and all(f > 0 for f in by_round)
        low, high = doc["metrics"]["roofline_fraction_ci95"]
        assert low <= doc["metrics"]["roofline_fraction"] <= high
        assert min(by_round) <= doc["metrics"]["roofline_fraction"] <= max(by_round)
    once, _ = run_configs(tiny_loaded, inputs, workload, ONCE, [], RunContext(env=env, out_dir=tmp_path / "once"))
    # a single pass reads its own weights after the run (the host's 1e-6 GB/s reading is not taken)
    assert once["metrics"]["roofline_bandwidth_from"] == "read of the weights after the run"
    assert once["metrics"]["roofline_bandwidth_gb_s"] > 0.01


def test_each_runs_read_follows_that_run_and_a_round_reads_their_mean(noise_technique, tiny_loaded, prompts_file,
                                                                       tmp_path, monkeypatch):
    """The read of a variant's weights is taken right after each of its runs (nothing of another variant's between),
    and the round's read is the mean of them: a decode is paired with a read of the same seconds. On the old code
    the reads came at the round's end, after every variant had run."""
    from infer_tune import rounds

    workload = Workload(suite=str(prompts_file), limit=2, max_new_tokens=4)
    inputs = prepare_inputs(tiny_loaded, workload)
    events: list[tuple[str, int]] = []
    owner: dict[int, int] = {}  # id of a weights list -> id of its model
    values = iter(range(1, 10_000))

    real_tensors, real_runner = rounds.models.readable_tensors, rounds.get_runner

    def tensors(model):
        got = real_tensors(model)
        owner[id(got)] = id(model)
        return got

    def read(weights):
        events.append(("read", owner[id(weights)]))
        return float(next(values))

    def runner(kind):
        inner = real_runner(kind)

        def run(prepared, *args, **kwargs):
            events.append(("run", id(prepared.model)))
            return inner(prepared, *args, **kwargs)
        return run

    monkeypatch.setattr(rounds.models, "readable_tensors", tensors)
    monkeypatch.setattr(rounds.env, "read_gb_s", read)
    monkeypatch.setattr(rounds, "get_runner", runner)
    protocol = Protocol(warmup=0, min_iterations=3, min_duration_s=0, max_rounds=3)
    ctx = RunContext(env=envinfo.collect_env(1), out_dir=tmp_path)
    base, docs = run_configs(tiny_loaded, inputs, workload, protocol, [NoiseConfig(0.0)], ctx)
    timed = [i for i, e in enumerate(events) if e[0] == "read"]
    assert len(timed) == 3 * 2 * 2  # 3 rounds, 2 request batches, 2 variants
    for i in timed:  # every read is of the model whose run came just before it
        assert events[i - 1] == ("run", events[i][1])
    # the reads returned 1, 2, 3, ... in order: a variant's round read is the mean of its two runs' values
    returned: dict[int, list[int]] = {}
    for value, i in enumerate(timed, start=1):
        returned.setdefault(events[i][1], []).append(value)
    candidate = next(m for m in returned if m != id(tiny_loaded.model))
    for doc, model in ((base, id(tiny_loaded.model)), (docs[0], candidate)):
        values = returned[model]
        assert doc["metrics"]["rounds"]["read_gb_s_by_round"] == [(values[2 * r] + values[2 * r + 1]) / 2
                                                                  for r in range(3)]


def test_rows_compared_with_the_first_are_measured_in_rounds_beside_it(noise_technique, tiny_loaded, prompts_file,
                                                                       tmp_path):
    """`reference: first` (a random-weight model too large to build whole): the rows in the first one's group
    share its rounds, so their ratios have intervals against it and their ceilings per-round reads; no plain
    baseline is measured. The rows were measured alone, once, with no interval, before."""
    from infer_tune.sweep.plan import SweepPlan

    workload = Workload(suite=str(prompts_file), limit=2, max_new_tokens=4)
    inputs = prepare_inputs(tiny_loaded, workload)
    ctx = RunContext(env=envinfo.collect_env(1), out_dir=tmp_path)
    protocol = Protocol(warmup=0, min_iterations=3, min_duration_s=0, max_rounds=3)
    first, docs = run_configs(tiny_loaded, inputs, workload, protocol, [NoiseConfig(0.0), NoiseConfig(0.1)], ctx,
                              plan=SweepPlan(reference="first"))
    assert first["run_id"] == docs[0]["run_id"] and len(find_results(tmp_path)) == 2  # no baseline row
    reference, other = docs[0]["metrics"], docs[1]["metrics"]
    assert reference["rounds"]["rounds"] == other["rounds"]["rounds"] == 3
    assert reference["rounds"]["variants"] == other["rounds"]["variants"] == 2
    assert other["roofline_bandwidth_from"] == "read of the weights in the rounds"
    assert docs[1]["baseline_run_id"] == docs[0]["run_id"]
    low, high = other["speedup_vs_baseline_ci95"]
    assert low <= other["speedup_vs_baseline"] <= high
    assert reference.get("speedup_vs_baseline") is None


def test_a_single_pass_rows_ceiling_on_an_accelerator_is_that_devices_memory(monkeypatch):
    """Weights on a GPU: the ceiling is a read of the device's own memory, never the host's (a GPU row's
    roofline_fraction against a CPU copy rate read 76.6% on an H200 where the device reads 1000x that)."""
    from infer_tune.sweep.document import roofline_ceiling

    asked = []
    monkeypatch.setattr(envinfo, "device_read_gb_s", lambda device: asked.append(device) or 4000.0)
    model, env = torch.nn.Linear(2, 2), {"mem_bandwidth_gb_s": 40.0}
    on_gpu = PreparedModel(model=model, tokenizer=None, device="cuda:0")
    assert roofline_ceiling(None, on_gpu, env) == (4000.0, "read of cuda:0 memory") and asked == ["cuda:0"]
    assert roofline_ceiling(None, PreparedModel(model=None, tokenizer=None, device="cpu"), env) == (40.0, "host reading")
    assert roofline_ceiling({"read_gb_s_by_round": [30.0, None, 50.0, 20.0]}, on_gpu, env) == (
        30.0, "read of the weights in the rounds")


def test_the_device_read_runs_through_the_devices_own_synchronize():
    """env.device_read_gb_s on the CPU device (the same code a CUDA device runs, with torch.cpu's synchronize):
    a positive rate, and one measurement per process and device."""
    envinfo.device_read_gb_s.cache_clear()
    first = envinfo.device_read_gb_s("cpu", size_mb=16, repeats=2)
    assert first > 0.1 and envinfo.device_read_gb_s("cpu", size_mb=16, repeats=2) == first
    envinfo.device_read_gb_s.cache_clear()


def test_candidates_are_measured_in_interleaved_rounds_with_intervals(noise_technique, tiny_loaded, prompts_file,
                                                                     tmp_path):
    """The baseline and every candidate run one pass per round, in a shuffled order; each ratio comes from
    the rounds with its 95% interval, and the result says how the rounds stopped."""
    workload = Workload(suite=str(prompts_file), limit=2, max_new_tokens=4)
    inputs = prepare_inputs(tiny_loaded, workload)
    ctx = RunContext(env=envinfo.collect_env(1), out_dir=tmp_path)
    protocol = Protocol(warmup=0, min_iterations=4, min_duration_s=0, max_rounds=5)
    base, docs = run_configs(tiny_loaded, inputs, workload, protocol, [NoiseConfig(0.0), NoiseConfig(0.1)], ctx)
    assert base["metrics"]["rounds"]["rounds"] == base["metrics"]["iterations"]
    for doc in docs:
        block = doc["metrics"]["rounds"]
        assert 4 <= block["rounds"] <= 5 and block["variants"] == 3 and block["design"] == "interleaved"
        assert block["stopped_by"] in ("target", "max_rounds", "max_duration_s")
        assert doc["metrics"]["noise"]["noisy"] == (not block["target_met"])
        for name in ("speedup_vs_baseline", "ttft_speedup_vs_baseline", "throughput_ratio_vs_baseline"):
            low, high = doc["metrics"][f"{name}_ci95"]
            assert low <= doc["metrics"][name] <= high
        assert doc["metrics"]["iterations"] == block["rounds"]
        assert len(doc["samples"]["tpot_ms"]) == block["rounds"] * 2  # every round's requests kept
    assert base["metrics"]["iterations"] == docs[0]["metrics"]["rounds"]["rounds"]
    # compare recomputes the per-round figures from each row's own samples: real rows agree with them
    from infer_tune.report.compare import _throughput_agrees, compare, recomputed_rounds, rounds_problem

    for doc in (base, *docs):
        assert rounds_problem(doc) is None
        assert {"ttft_ms", "e2e_ms_mean"} <= set(recomputed_rounds(doc)) and _throughput_agrees(doc)
    methods = {d.metric: d.method for d in compare(base, docs[:1]).candidates[0].deltas}
    assert methods["ttft_ms.p50"].startswith("paired rounds") and methods["output_throughput_tok_s"].startswith(
        "paired rounds")


def test_passes_collect_only_what_the_sweep_made_and_its_models_are_still_freed(noise_technique, tiny_loaded,
                                                                               prompts_file, tmp_path, monkeypatch):
    """Inside a sweep what lived before it is set aside from the collector (the collection before each
    pass scans only what the sweep made); the candidates' models, cyclic like every transformers model,
    are still collected when their group ends, and everything is handed back after the sweep."""
    import gc
    import weakref

    from infer_tune.metrics import memory

    frozen_at_passes: list[int] = []
    release = memory.release_and_reset_peak

    def recording() -> int:
        frozen_at_passes.append(gc.get_freeze_count())
        return release()

    monkeypatch.setattr(memory, "release_and_reset_peak", recording)
    made: list[weakref.ref] = []

    def keep_a_ref(loaded, config, ctx):
        prepared = _apply_noise(loaded, config, ctx)
        made.append(weakref.ref(prepared.model))
        return prepared

    register_technique(noise_technique)(keep_a_ref)  # the fixture takes it out again
    workload = Workload(suite=str(prompts_file), limit=2, max_new_tokens=4)
    inputs = prepare_inputs(tiny_loaded, workload)
    ctx = RunContext(env=envinfo.collect_env(1), out_dir=tmp_path)
    assert gc.get_freeze_count() == 0
    freezes = []
    monkeypatch.setattr(memory.gc, "freeze", lambda real=gc.freeze: freezes.append(1) or real())
    with memory.long_lived_heap():
        assert gc.get_freeze_count() > 10_000
        with memory.long_lived_heap():  # the outermost acts (a count compared here moved when frozen objects died)
            assert len(freezes) == 1
    assert gc.get_freeze_count() == 0
    run_configs(tiny_loaded, inputs, workload, ONCE, [NoiseConfig(scale=0.5)], ctx)
    assert frozen_at_passes and min(frozen_at_passes) > 10_000  # torch, transformers and the model set aside
    assert len(made) == 1 and made[0]() is None  # the candidate's model was made inside and is gone
    assert gc.get_freeze_count() == 0


@pytest.mark.full_rounds
def test_rounds_stop_at_the_target_and_report_a_miss_as_noisy():
    """The stopping rule on scripted timings: steady ratios stop at the floor; scattered ones run to the
    round budget and are flagged with the achieved half-width; a steady row of the same rounds is not."""
    from infer_tune import rounds
    from infer_tune.runners.base import GenerationRun, RequestTiming
    from infer_tune.workload import Inputs

    def fake_runner(values):
        it = iter(values)

        def run(prepared, inputs, workload, protocol, progress):
            tpot = next(it)
            req = RequestTiming(0, 0, 4, 0, [int(1e6 * (10 + tpot * k)) for k in range(5)])
            return GenerationRun([req], [], 0.1, 1, None, 0.0, 0, 0, 5, 1)
        return run

    from infer_tune.runners.base import RUNNERS
    steady = [10.0] * 40
    scattered = [10.0, 5.0, 20.0, 7.0, 14.0] * 8
    for name, values in (("steady", steady), ("scattered", scattered)):
        RUNNERS[f"test-{name}"] = fake_runner(values)
    try:
        protocol = Protocol(warmup=0, min_iterations=1, min_duration_s=0, max_rounds=6)
        make = lambda n: rounds.Variant(n, PreparedModel(None, None), "test-steady")  # noqa: E731
        one = Inputs(prompts=[None], rendered=["x"], batches=[{"input_ids": torch.zeros(1, 4)}], templated=False)
        out = rounds.run_rounds([make("a"), make("b")], one, None, protocol)
        assert out.target_met and out.stopped_by == "target" and out.rounds == rounds.MIN_ROUNDS
        b = rounds.Variant("b", PreparedModel(None, None), "test-scattered")
        out = rounds.run_rounds([make("a"), b, make("c")], one, None, protocol)
        assert not out.target_met and out.stopped_by == "max_rounds" and out.rounds == 6
        assert out.block("b")["achieved_half_width_pct"] > protocol.target_half_width_pct
        # the rounds went on for b's sake; c's own intervals met the target, and its row says so
        assert out.block("b")["target_met"] is False and out.block("c")["target_met"] is True
        assert out.block("a")["target_met"] is None  # the baseline has no ratio of its own
        # a candidate behind tune's leader: `stop` ends the scattered rounds at the floor, with its reason
        b = rounds.Variant("b", PreparedModel(None, None), "test-scattered")
        seen = []

        def stop(found):
            seen.append(sorted(found))
            return "behind the leader" if found["b"]["speedup_vs_baseline"] else None
        out = rounds.run_rounds([make("a"), b], one, None, protocol, stop=stop)
        assert out.stopped_by == "early: behind the leader" and out.rounds == rounds.MIN_ROUNDS and seen == [["b"]]
    finally:
        RUNNERS.pop("test-steady")
        RUNNERS.pop("test-scattered")


@pytest.mark.full_rounds
def test_rounds_pool_their_prompt_pairs_unless_the_rounds_differ():
    """Four prompts a round, each candidate's per-prompt ratio steady across rounds but for pair noise: the
    decode interval pools the rounds with the pairs (12 degrees of freedom at 4 rounds, narrower than the
    rounds alone give); the same pairs with each round shifted as a whole are judged on the rounds alone."""
    import numpy as np

    from infer_tune import rounds
    from infer_tune.metrics.stats import log_ratio_interval
    from infer_tune.runners.base import RUNNERS, GenerationRun, RequestTiming
    from infer_tune.workload import Inputs

    shift = {0: -0.3, 1: 0.0, 2: 0.3, 3: 0.1}

    def fake_runner(base_tpot, shifted, seed):
        calls = iter(range(64))
        noise = np.random.default_rng(seed).normal(0, 0.05, 64)

        def run(prepared, inputs, workload, protocol, progress):
            k = next(calls)  # k // 4: the round (4 request batches a round)
            tpot = base_tpot * (1 + k % 4) * float(np.exp(noise[k] + (shift[k // 4 % 4] if shifted else 0.0)))
            req = RequestTiming(0, 0, 4, 0, [int(1e6 * (10 + tpot * j)) for j in range(5)])
            return GenerationRun([req], [], 0.1, 1, None, 0.0, 0, 0, 5, 1)
        return run

    four = Inputs(prompts=[None] * 4, rendered=["x"] * 4, batches=[{"input_ids": torch.zeros(1, 4)}] * 4,
                  templated=False)
    protocol = Protocol(warmup=0, min_iterations=4, min_duration_s=0, max_rounds=4, target_half_width_pct=0.1)
    blocks = {}
    try:
        for shifted in (False, True):
            RUNNERS["test-base"] = fake_runner(10.0, False, 4)
            RUNNERS["test-cand"] = fake_runner(5.0, shifted, 5)
            variants = [rounds.Variant("a", PreparedModel(None, None), "test-base"),
                        rounds.Variant("b", PreparedModel(None, None), "test-cand")]
            out = rounds.run_rounds(variants, four, None, protocol)
            assert out.rounds == 4
            blocks[shifted] = (out.block("b")["interval_method"]["speedup_vs_baseline"],
                               out.intervals["b"]["speedup_vs_baseline"],
                               log_ratio_interval(rounds.round_ratios(variants[0], variants[1], "tpot_ms")))
    finally:
        RUNNERS.pop("test-base", None)
        RUNNERS.pop("test-cand", None)
    method, pooled, by_round = blocks[False]
    assert method["pooled"] is True and method["df"] == 12
    assert abs(pooled["point"] - by_round["point"]) < 1e-9 and pooled["half_width_pct"] < by_round["half_width_pct"]
    method, iv, by_round = blocks[True]
    assert method["pooled"] is False and method["df"] == 3 and iv["ci95"] == pytest.approx(by_round["ci95"])


@pytest.mark.full_rounds
def test_rounds_target_on_the_objective_ratio_alone():
    """`target_on: objective`: a row whose decode ratio is steady and whose TTFT is scattered stops at the
    floor, target met, with the TTFT interval still reported (as wide as it came out); under `all` the
    same timings run to the round budget and the row is noisy, its reason naming the ratios."""
    from infer_tune import rounds
    from infer_tune.metrics import noise
    from infer_tune.runners.base import RUNNERS, GenerationRun, RequestTiming
    from infer_tune.workload import Inputs

    def fake_runner(ttfts):
        it = iter(ttfts)

        def run(prepared, inputs, workload, protocol, progress):
            first = next(it)
            req = RequestTiming(0, 0, 4, 0, [int(1e6 * (first + 10.0 * k)) for k in range(5)])
            return GenerationRun([req], [], 0.1, 1, None, 0.0, 0, 0, 5, 1)
        return run

    one = Inputs(prompts=[None], rendered=["x"], batches=[{"input_ids": torch.zeros(1, 4)}], templated=False)
    try:
        outs = {}
        for target_on in ("all", "objective"):
            RUNNERS["test-base"] = fake_runner([10.0] * 40)
            RUNNERS["test-late"] = fake_runner([10.0, 5.0, 20.0, 7.0, 14.0] * 8)
            protocol = Protocol(warmup=0, min_iterations=1, min_duration_s=0, max_rounds=6, target_on=target_on)
            variants = [rounds.Variant("a", PreparedModel(None, None), "test-base"),
                        rounds.Variant("b", PreparedModel(None, None), "test-late")]
            outs[target_on] = rounds.run_rounds(variants, one, None, protocol)
        every, ranked = outs["all"], outs["objective"]
        assert every.stopped_by == "max_rounds" and every.rounds == 6 and every.block("b")["target_met"] is False
        assert every.block("b")["judged_on"] == list(rounds.RATIOS)
        why = noise.figure([], noise.HostSnapshot.take(), noise.HostSnapshot.take(), rounds=every.block("b"))["why"]
        assert "ttft_speedup_vs_baseline" in why[0]
        assert ranked.stopped_by == "target" and ranked.rounds == rounds.MIN_ROUNDS
        block = ranked.block("b")
        assert block["target_met"] is True and block["judged_on"] == ["speedup_vs_baseline"]
        assert block["achieved_half_width_pct"] <= protocol.target_half_width_pct
        assert ranked.intervals["b"]["ttft_speedup_vs_baseline"]["half_width_pct"] > 10  # reported, not judged
        # a whole-trace variant is judged on throughput whatever the protocol says
        whole = rounds.Variant("w", PreparedModel(None, None), "test-late", whole=True)
        assert rounds.judged(whole, protocol) == rounds.WHOLE_RATIOS
        assert rounds.judged(rounds.Variant("t", PreparedModel(None, None), "x", objective="throughput"),
                             protocol) == ("throughput_ratio_vs_baseline",)
    finally:
        RUNNERS.pop("test-base", None)
        RUNNERS.pop("test-late", None)
    with pytest.raises(ConfigError, match="target_on"):
        Protocol(target_on="ttft")


def test_rounds_warm_every_prompt_shape_without_a_whole_discarded_pass(monkeypatch):
    """A plain generation variant is warmed by its warmup calls on the first request batch at full length,
    then the other batches once at WARM_TOKENS (every prefill shape seen, decode mostly skipped); one
    that compiles per cache length keeps the whole discarded pass at full length."""
    from infer_tune import rounds
    from infer_tune.runners.base import RUNNERS, GenerationRun, RequestTiming
    from infer_tune.workload import Inputs

    calls = []

    def runner(prepared, inputs, workload, protocol, progress):
        calls.append((prepared.label, [int(b["input_ids"][0, 0]) for b in inputs.batches], workload.max_new_tokens,
                      protocol.warmup))
        req = RequestTiming(0, 0, 4, 0, [int(1e6 * (10 + 5.0 * k)) for k in range(5)])
        return GenerationRun([req], [], 0.1, 1, None, 0.0, 0, 0, 5, 1)

    monkeypatch.setitem(RUNNERS, "generation", runner)
    batches = [{"input_ids": torch.full((1, 3), j)} for j in range(3)]
    inputs = Inputs(prompts=[None] * 3, rendered=["a", "b", "c"], batches=batches, templated=False)
    workload = Workload(max_new_tokens=32)
    protocol = Protocol(warmup=1, min_iterations=1, min_duration_s=0)
    plain = rounds.Variant("plain", PreparedModel(None, None, label="plain"), "generation")
    compiled = rounds.Variant("compiled", PreparedModel(None, None, label="compiled",
                                                        generate_kwargs={"compile_config": object()}), "generation")
    run = rounds.warm(plain, inputs, workload, protocol)
    assert calls == [("plain", [0], 32, 0), ("plain", [1, 2], rounds.WARM_TOKENS, 0)]
    assert run.first_call_ms == pytest.approx(30.0)  # the first call's e2e: 10 ms + 4 x 5 ms
    calls.clear()
    rounds.warm(compiled, inputs, workload, protocol)
    assert calls == [("compiled", [0, 1, 2], 32, 1)]


@pytest.mark.full_rounds
def test_rounds_run_a_contended_request_batch_again(monkeypatch):
    """A request batch during which other processes used over OTHER_CPU_LIMIT of the host is run again by
    every variant, once; the first try's timings and technique counts are dropped, the rerun counted."""
    from infer_tune import rounds
    from infer_tune.metrics import noise

    monkeypatch.setattr(rounds, "RERUNS", 1)  # the suite's conftest turns the rerun off for every other test
    from infer_tune.runners.base import RUNNERS, GenerationRun, RequestTiming
    from infer_tune.runners.prepared import RunCounters
    from infer_tune.workload import Inputs

    calls = []

    def runner(prepared, inputs, workload, protocol, progress):
        calls.append(prepared.label)
        slow = len(calls) <= 2  # the first try of batch 0 (both variants) ran while the host was contended
        tpot = (50.0 if slow else 10.0) if prepared.label == "base" else 5.0
        if prepared.counters is not None:
            prepared.counters.add("drafted", 4)
        req = RequestTiming(0, 0, 4, 0, [int(1e6 * (10 + tpot * k)) for k in range(5)])
        return GenerationRun([req], [], 0.1, 1, None, 0.0, 0, 0, 5, 1)

    shares = iter([0.5] + [0.0] * 100)  # one reading per request batch tried: the first says contended
    monkeypatch.setattr(noise, "other_share", lambda before, after: next(shares))
    monkeypatch.setitem(RUNNERS, "test-contended", runner)
    counted = PreparedModel(None, None, label="cand", counters=RunCounters())
    variants = [rounds.Variant("base", PreparedModel(None, None, label="base"), "test-contended"),
                rounds.Variant("cand", counted, "test-contended")]
    one = Inputs(prompts=[None], rendered=["x"], batches=[{"input_ids": torch.zeros(1, 4)}], templated=False)
    out = rounds.run_rounds(variants, one, None, Protocol(warmup=0, min_iterations=3, min_duration_s=0, max_rounds=3))
    assert len(calls) == 2 * (3 + rounds.RERUNS) and out.reruns_by_round == [1, 0, 0]
    assert out.block("cand")["reruns_by_round"] == [1, 0, 0]
    assert out.per_round["base"]["tpot_ms"] == [10.0] * 3  # the contended try (50 ms) is not a sample
    assert out.intervals["cand"]["speedup_vs_baseline"]["point"] == pytest.approx(2.0)
    assert counted.counters.values["drafted"] == 4 * 3  # the dropped try's counts went with it


def test_test_techniques_leave_the_registry_clean():
    """The fixture's registration takes the test technique out again (driven here step by step, so the test
    sees both states whatever ran before it)."""
    from infer_tune.tuners import TECHNIQUES

    steps = _registration()  # what the fixture runs
    assert next(steps) is NoiseConfig and NoiseConfig in TECHNIQUES
    with pytest.raises(StopIteration):
        next(steps)
    assert NoiseConfig not in TECHNIQUES and all(e.name != "test-noise" for e in TECHNIQUES.values())


@pytest.mark.full_rounds
def test_rounds_interleave_request_by_request_and_pair_prompts():
    """Within a round every variant runs request batch j back to back (shuffled) before any runs batch j+1;
    prompt indices come back as the workload's, so TTFT / TPOT ratios pair each prompt with itself."""
    from infer_tune import rounds
    from infer_tune.runners.base import RUNNERS, GenerationRun, RequestTiming
    from infer_tune.workload import Inputs

    calls = []

    def runner(prepared, inputs, workload, protocol, progress):
        calls.append((prepared.label, int(inputs.batches[0]["input_ids"][0, 0])))
        tpot = 10.0 if prepared.label == "base" else 5.0
        req = RequestTiming(0, 0, 4, 0, [int(1e6 * (10 + tpot * k)) for k in range(5)])
        return GenerationRun([req], [], 0.1, 1, None, 0.0, 0, 0, 5, 1)

    RUNNERS["test-calls"] = runner
    try:
        batches = [{"input_ids": torch.full((1, 3), j)} for j in range(3)]
        inputs = Inputs(prompts=[None] * 3, rendered=["a", "b", "c"], batches=batches, templated=False)
        variants = [rounds.Variant(n, PreparedModel(None, None, label=n), "test-calls") for n in ("base", "c1", "c2")]
        out = rounds.run_rounds(variants, inputs, None, Protocol(warmup=0, min_iterations=3, min_duration_s=0,
                                                                   max_rounds=3))
    finally:
        RUNNERS.pop("test-calls")
    timed = calls  # warmup 0: no warm calls, every call is a timed one
    assert len(timed) == 3 * 3 * 3  # rounds x batches x variants
    for start in range(0, len(timed), 3):
        assert len({batch for _, batch in timed[start:start + 3]}) == 1  # one batch, all variants, back to back
    assert [r.prompt_index for r in variants[1].passes[0].requests] == [0, 1, 2]
    assert out.intervals["c1"]["speedup_vs_baseline"]["point"] == pytest.approx(2.0)


@pytest.mark.full_rounds
def test_a_whole_trace_variant_runs_once_per_round_and_is_judged_on_throughput():
    """A runner registered with passes="whole" (an arrival trace) gets the whole workload once per round,
    among the baseline's request batches; its interval is throughput's alone, its counters describe one
    trace (integers: the largest round, floats: the mean), and every variant keeps its per-round figures."""
    from infer_tune import rounds
    from infer_tune.metrics.stats import pair_interval
    from infer_tune.runners.base import RUNNERS, WHOLE_RUNNERS, GenerationRun, RequestTiming, register_runner
    from infer_tune.workload import Inputs

    calls = []

    def split(prepared, inputs, workload, protocol, progress):
        calls.append((prepared.label, len(inputs.batches)))
        req = RequestTiming(0, 0, 4, 0, [int(1e6 * (10 + 10 * k)) for k in range(5)])
        return GenerationRun([req], [], 0.1, 1, None, 0.0, 0, 0, 5, 1, counters={"steps": 5})

    def whole(prepared, inputs, workload, protocol, progress):
        calls.append((prepared.label, len(inputs.batches)))
        n = len(inputs.batches)
        wall = 0.2 if prepared.label == "fast" else 0.4
        reqs = [RequestTiming(i, 0, 4, 0, [int(1e6 * (50 + 10 * k)) for k in range(5)]) for i in range(n)]
        return GenerationRun(reqs, [], wall, 1, None, 0.0, 0, 0, 5 * n, 2,
                             counters={"trace_requests": n, "busy_share": 0.5 + 0.1 * (len(calls) % 2)})

    RUNNERS["test-split"] = split
    register_runner("test-whole", passes="whole")(whole)
    try:
        batches = [{"input_ids": torch.full((1, 3), j)} for j in range(3)]
        inputs = Inputs(prompts=[None] * 3, rendered=["a", "b", "c"], batches=batches, templated=False)
        variants = [rounds.Variant("base", PreparedModel(None, None, label="base"), "test-split"),
                    rounds.Variant("fast", PreparedModel(None, None, label="fast"), "test-whole", whole=True),
                    rounds.Variant("slow", PreparedModel(None, None, label="slow"), "test-whole", whole=True)]
        out = rounds.run_rounds(variants, inputs, None, Protocol(warmup=0, min_iterations=4, min_duration_s=0,
                                                                   max_rounds=4))
    finally:
        RUNNERS.pop("test-whole")
        RUNNERS.pop("test-split")
        WHOLE_RUNNERS.discard("test-whole")
    assert out.rounds == 4 and out.variants == 3
    # per round: the baseline three times (one batch each), each trace variant once (all three batches)
    assert sorted(calls) == sorted([("base", 1)] * 12 + [("fast", 3)] * 4 + [("slow", 3)] * 4)
    assert set(out.intervals["fast"]) == {"throughput_ratio_vs_baseline"}
    # base: 15 tokens in 0.3 s a round = 50 tok/s; fast: 15 in 0.2 s = 75 tok/s; slow: 37.5 tok/s
    assert out.intervals["fast"]["throughput_ratio_vs_baseline"]["point"] == pytest.approx(1.5)
    merged = rounds.merged_run(variants[1])
    assert merged.counters["trace_requests"] == 3 and 0.5 <= merged.counters["busy_share"] <= 0.6
    assert rounds.merged_run(variants[0]).counters["steps"] == 4 * 3 * 5  # split runs: counts add up
    per_round = out.block("slow")["per_round"]
    assert len(per_round["output_throughput_tok_s"]) == 4 and per_round["e2e_ms_mean"][0] == pytest.approx(90.0)
    fast_vs_slow = pair_interval(out.per_round["fast"]["output_throughput_tok_s"],
                                 out.per_round["slow"]["output_throughput_tok_s"])
    assert fast_vs_slow["point"] == pytest.approx(2.0) and fast_vs_slow["half_width_pct"] == pytest.approx(0.0, abs=1e-6)


@dataclass
class ConcludingConfig(TechniqueConfig):
    technique: ClassVar[str] = "test-concluding"


def test_a_sweep_conclusion_is_stored_in_this_sweeps_rows_only(tmp_path):
    """A technique's `conclude` returns a claim, files, keys and sections (tuners/base.py `Conclusion`); the
    engine merges each into the rows it names (new documents: a saved one is never modified), saves it beside
    the results this sweep saved (their result.json byte for byte as written), and writes nothing for a result
    of an earlier run (read back by `resume`), though it was concluded over."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from result_docs import make_result, save

    from infer_tune import results
    from infer_tune.sweep import conclude_sweep
    from infer_tune.tuners.base import Conclusion

    def conclude(docs, skipped):
        ids = [d["run_id"] for d in docs]
        return Conclusion(claim={"statement": "s", "finding": f"{len(docs)} rows", "held": True},
                          files={"figure.png": b"\x89PNG\r\n\x1a\n"},
                          metrics={i: {"rank": n} for n, i in enumerate(ids)},
                          sections={i: {"sweep": {"rows": ids}} for i in ids})

    register_technique(ConcludingConfig, conclude=conclude, metric_keys={"rank": "the row's rank"})(
        lambda loaded, config, ctx: None)
    try:
        folders = [save(make_result(name, technique="test-concluding", seed=i), tmp_path)
                   for i, name in enumerate(("earlier", "mine"))]
        before = [(folder / "result.json").read_bytes() for folder in folders]
        docs = [results.load_result(folder) for folder in folders]
        concluded = conclude_sweep(docs, own={"mine"})
    finally:
        unregister_technique(ConcludingConfig)
    assert [(folder / "result.json").read_bytes() for folder in folders] == before
    assert not (folders[0] / "figure.png").exists() and not (folders[0] / "conclusion.json").exists()
    assert "claim_check" not in docs[0]["metrics"] and concluded[0]["metrics"]["claim_check"]["held"] is True
    assert (folders[1] / "conclusion.json").is_file()
    mine = results.load_result(folders[1])
    assert mine["metrics"]["claim_check"]["finding"] == "2 rows" and mine["metrics"]["rank"] == 1
    assert mine["sweep"] == {"rows": ["earlier", "mine"]} and (folders[1] / "figure.png").is_file()
