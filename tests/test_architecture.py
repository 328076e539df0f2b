"""The technique contract: one test technique per runner kind, registered here only and measured end to
end through the same sweep engine (`run_configs`); the multi-token clock; constraints; shared options."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import transformers
from typer.testing import CliRunner

from infer_tune import env as envinfo
from infer_tune.errors import ConfigError
from infer_tune.results import find_results, load_outputs, load_result
from infer_tune.runners import PreparedModel, Protocol, RunCounters, TokenClock
from infer_tune.runners.base import RequestTiming
from infer_tune.runners.trace import TraceRequest
from infer_tune.sweep import prepare_inputs, run_configs
from infer_tune.tuners import RunContext, TechniqueConfig, register_technique, unregister_technique
from infer_tune.workload import Workload

ONCE = Protocol(warmup=1, min_iterations=1, min_duration_s=0)


# --------------------------------------------------------------------------- closed loop
@dataclass
class PlainConfig(TechniqueConfig):
    technique: ClassVar[str] = "test-plain"


def _prepare_plain(loaded, config, ctx):
    return PreparedModel(loaded.model, loaded.tokenizer, label="plain", extra_model_bytes=1000)


# --------------------------------------------------------------------------- speculative (multi-token steps)
@dataclass
class LookupConfig(TechniqueConfig):
    """Prompt lookup through transformers' assisted generation: several tokens per step."""

    technique: ClassVar[str] = "test-lookup"
    max_batch_size: ClassVar[int] = 1
    tokens: int = 4


class ForwardCounter(RunCounters):
    def snapshot(self):
        values = super().snapshot()
        values["target_forward_passes"] = values.get("forwards", 0)
        return values


def _prepare_lookup(loaded, config, ctx):
    model = copy.deepcopy(loaded.model)
    counters = ForwardCounter()
    model.register_forward_hook(lambda *_: counters.add("forwards"))
    return PreparedModel(model, loaded.tokenizer, label=f"lookup{config.tokens}", counters=counters,
                         generate_kwargs={"prompt_lookup_num_tokens": config.tokens, "max_matching_ngram_size": 2})


# --------------------------------------------------------------------------- arrival trace
@dataclass
class TraceConfig(TechniqueConfig):
    technique: ClassVar[str] = "test-trace"
    gap_s: float = 0.05


def _prepare_trace(loaded, config, ctx):
    trace = [TraceRequest(prompt_index=i, arrival_s=i * config.gap_s) for i in range(3)]
    return PreparedModel(loaded.model, loaded.tokenizer, label="trace", runner_options={"trace": trace})


# --------------------------------------------------------------------------- multi-process
@dataclass
class AllReduceConfig(TechniqueConfig):
    technique: ClassVar[str] = "test-allreduce"
    procs: int = 2


def allreduce_worker(rank: int, world: int, payload: dict) -> dict:
    """Sums a tensor over the ranks with gloo; returns what it exchanged and the sum it saw."""
    import torch.distributed as dist

    tensor = torch.full((payload["numel"],), float(rank + 1))
    dist.all_reduce(tensor)
    return {"sum_seen": float(tensor[0]), "counters": {"bytes_exchanged": tensor.numel() * tensor.element_size()}}


def _prepare_allreduce(loaded, config, ctx):
    return PreparedModel(None, loaded.tokenizer, label=f"allreduce-{config.procs}",
                         runner_options={"worker": allreduce_worker, "procs": config.procs, "payload": {"numel": 256}})


ENTRIES = [
    (PlainConfig, _prepare_plain, {"runner": "generation"}),
    (LookupConfig, _prepare_lookup, {"runner": "speculative", "metric_keys": dict.fromkeys(
        ("forwards", "multi_token_steps", "target_forward_passes"), "the lookup loop's counters")}),
    (TraceConfig, _prepare_trace, {"runner": "trace", "metric_keys": dict.fromkeys(
        ("scheduler", "trace_duration_s", "trace_requests", "trace_span_s"), "the trace runner's facts")}),
    (AllReduceConfig, _prepare_allreduce, {"runner": "multiprocess", "measure_ppl": False, "metric_keys": dict.fromkeys(
        ("bytes_exchanged", "launch_elapsed_s", "procs"), "the ranks' exchange")}),
]


@pytest.fixture()
def test_techniques():
    for cls, fn, options in ENTRIES:
        register_technique(cls, **options)(fn)
    yield
    for cls, _, _ in ENTRIES:
        unregister_technique(cls)


@pytest.fixture()
def setup(tiny_loaded, prompts_file, tmp_path):
    workload = Workload(suite=str(prompts_file), limit=3, max_new_tokens=12)
    return workload, prepare_inputs(tiny_loaded, workload), RunContext(env=envinfo.collect_env(1), out_dir=tmp_path)


def test_each_runner_kind_measures_a_technique_end_to_end(test_techniques, tiny_loaded, setup, tmp_path):
    workload, inputs, ctx = setup
    configs = [PlainConfig(), LookupConfig(), TraceConfig(), AllReduceConfig()]
    baseline, docs = run_configs(tiny_loaded, inputs, workload, ONCE, configs, ctx)
    by = {d["technique"]: d for d in docs}
    assert [d["runner"] for d in docs] == ["generation", "speculative", "trace", "multiprocess"]
    assert len(find_results(tmp_path)) == 5
    # every row names the engine that ran it (no part names one: torch), its versions, no launch argv; kept on load
    for doc in [baseline, *docs]:
        assert doc.engine == "torch" and doc.engine_argv is None
        assert doc.engine_version == {"torch": torch.__version__, "transformers": transformers.__version__}
        again = load_result(doc.location)
        assert (again.engine, again.engine_version, again["engine_argv"]) == ("torch", doc.engine_version, None)

    plain = by["test-plain"]["metrics"]
    assert plain["output_mismatches"] == 0
    assert plain["model_bytes"] == baseline["metrics"]["model_bytes"] + 1000  # extra (draft) bytes count

    lookup = by["test-lookup"]["metrics"]
    assert lookup["output_mismatches"] == 0  # assisted generation is lossless under greedy
    rounds = lookup["rounds"]["rounds"]  # generation, speculative and trace candidates run in interleaved rounds
    assert rounds >= 3 and plain["rounds"]["rounds"] == by["test-trace"]["metrics"]["rounds"]["rounds"] == rounds
    assert "rounds" not in by["test-allreduce"]["metrics"]  # several processes: measured alone
    assert lookup["generated_tokens"] == rounds * 3 * 12
    # the counters accumulate over the timed rounds only (the warm call reset them): one forward per step
    assert lookup["target_forward_passes"] == lookup["generate_steps"] + 0
    assert lookup["generate_steps"] <= rounds * 3 * 12
    assert lookup["tpot_ms"]["n"] == rounds * 3

    trace = by["test-trace"]
    m = trace["metrics"]
    assert m["output_mismatches"] == 0
    # the whole trace once per round: every round's requests kept, the counters describe one trace
    assert m["queue_ms"]["n"] == 3 * rounds and len(trace["samples"]["queue_ms"]) == 3 * rounds
    assert m["scheduler"] == "serial" and m["trace_requests"] == 3
    assert set(m["rounds"]["per_round"]) >= {"output_throughput_tok_s", "e2e_ms_mean"}
    assert all(t >= q for t, q in zip(trace["samples"]["ttft_ms"], trace["samples"]["queue_ms"]))

    multi = by["test-allreduce"]["metrics"]
    assert multi["procs"] == 2 and len(multi["ranks"]) == 2
    assert [r["sum_seen"] for r in multi["ranks"]] == [3.0, 3.0]  # 1 + 2, reduced across two real processes
    assert multi["bytes_exchanged"] == 2 * 256 * 4
    assert all(r["peak_rss_bytes"] > 0 and r["elapsed_s"] > 0 for r in multi["ranks"])
    assert load_outputs(trace)  # outputs saved with the result


def test_speculative_steps_deliver_several_tokens_with_one_timestamp(test_techniques, tiny_loaded, setup):
    """Prompt lookup on a repetitive random model accepts drafts: some steps carry several tokens."""
    from infer_tune.sweep import measure_prepared

    workload, inputs, ctx = setup
    prepared = _prepare_lookup(tiny_loaded, LookupConfig(tokens=6), ctx)
    doc, _ = measure_prepared(tiny_loaded, prepared, inputs, workload, ONCE, technique="test-lookup", config={},
                              env=ctx.env, runner="speculative", measure_ppl=False)
    m = doc["metrics"]
    assert m["multi_token_steps"] > 0, "a random tiny model repeats itself; lookup should accept something"
    assert m["generate_steps"] < m["generated_tokens"]
    assert m["itl_ms"]["n"] == m["generate_steps"] - 3  # ITL is per step: one gap fewer than steps, per request


def test_token_clock_multi_token_puts():
    clock = TokenClock()
    clock.put(torch.zeros(1, 7, dtype=torch.long))  # the prompt
    clock.put(torch.tensor([5]))  # one token
    clock.put(torch.tensor([[1, 2, 3]]))  # an accepted draft of two + the bonus token
    clock.put(torch.tensor([[4]]))
    assert clock.step_tokens == [1, 3, 1] and clock.multi_token
    t = clock.step_ns
    assert clock.token_ns == [t[0], t[1], t[1], t[1], t[2]]
    timing = RequestTiming(0, 0, 7, submit_ns=t[0] - 1_000_000, token_ns=clock.token_ns,
                           step_tokens=clock.step_tokens)
    assert timing.itl_ms == [(t[1] - t[0]) / 1e6, (t[2] - t[1]) / 1e6]  # per step, not per token
    assert timing.tpot_ms == pytest.approx((t[2] - t[0]) / 1e6 / 4)  # per token
    cut = timing.truncated(3)
    assert cut.step_tokens == [1, 2] and cut.token_ns == clock.token_ns[:3]


def test_fake_multi_token_stream_gives_right_tpot_and_itl():
    """Hand-made timestamps: 1 token at 10 ms, 4 tokens at 30 ms, 1 at 40 ms after submission at 0."""
    ms = 1_000_000
    timing = RequestTiming(0, 0, 5, submit_ns=0, token_ns=[10 * ms] + [30 * ms] * 4 + [40 * ms],
                           step_tokens=[1, 4, 1])
    assert timing.ttft_ms == 10.0 and timing.e2e_ms == 40.0
    assert timing.tpot_ms == 6.0  # (40 - 10) / 5
    assert timing.itl_ms == [20.0, 10.0]


def test_batch_size_constraint_refused_before_anything_is_written(test_techniques, tiny_loaded, prompts_file,
                                                                   tmp_path):
    workload = Workload(suite=str(prompts_file), limit=2, max_new_tokens=4, batch_size=2)
    ctx = RunContext(env=envinfo.collect_env(1), out_dir=tmp_path / "runs")
    with pytest.raises(ConfigError, match="batch size <= 1"):
        run_configs(tiny_loaded, prepare_inputs(tiny_loaded, workload), workload, ONCE, [LookupConfig()], ctx)
    assert not (tmp_path / "runs").exists()


def test_device_comes_from_the_context(test_techniques, tiny_loaded):
    from infer_tune.tuners import apply

    # a device other than the loaded model's ("cpu"): the prepared model's comes from the context, not the model
    prepared = apply(tiny_loaded, PlainConfig(), RunContext(device="meta"))
    assert tiny_loaded.device == "cpu" and prepared.device == "meta"


def _option_names(command: str) -> set[str]:
    from infer_tune.cli import app

    text = CliRunner().invoke(app, [command, "--help"], terminal_width=200).output
    return set(re.findall(r"(--[a-z][a-z-]+)", text))


def test_measuring_commands_share_one_option_group():
    from infer_tune.cli.options import COMMON

    shared = {"--model", "--suite", "--limit", "--max-new-tokens", "--batch-size", "--threads", "--seed", "--warmup",
              "--min-iterations", "--min-duration", "--out", "--dtype", "--device", "--chat-template",
              "--max-prompt-tokens", "--ppl", "--resume", "--json", "--debug"}
    # every shared flag is an entry of the one group (json's parameter is json_out), and every command lists it
    assert {f[2:].replace("-", "_") for f in shared} - {"json"} | {"json_out"} <= set(COMMON)
    for command in ("bench", "quantize", "kv-cache"):
        assert shared <= _option_names(command), command


def test_a_technique_document_is_the_same_whichever_command_ran_it(tiny_loaded, tiny_model_dir, prompts_file, tmp_path):
    """kv-cache and batch rows from a recipe (run_configs) carry the keys their own commands write: the engine
    writes every result and the technique's finish hook adds its keys and files on both paths."""

    from infer_tune.scenarios.batch import ServeSpec, run_serve
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.scenarios.kv_cache import KVSweepSpec, run_kv_sweep
    from infer_tune.tuners.batch import BatchConfig
    from infer_tune.tuners.kv_cache import KVCacheConfig

    workload = Workload(suite=str(prompts_file), limit=3, max_new_tokens=5)
    inputs = prepare_inputs(tiny_loaded, workload)
    env = envinfo.collect_env(1)
    _, (recipe_kv,) = run_configs(tiny_loaded, inputs, workload, ONCE, [KVCacheConfig(impl="static")],
                                  RunContext(env=env, out_dir=tmp_path / "recipe"))
    command_kv = run_kv_sweep(tiny_loaded, KVSweepSpec(impls=["static"], context_lengths=[12], max_new_tokens=5,
                                                       suite=str(prompts_file)),
                              ONCE, RunContext(env=env, out_dir=tmp_path / "kv")).docs[-1]
    cache_keys = {"kv_cache_bytes", "kv_cache_bytes_analytic", "kv_cache_tokens", "kv_cache_class",
                  "flops_with_cache", "flops_without_cache", "per_position_ms"}
    assert cache_keys <= set(recipe_kv["metrics"]) and recipe_kv["metrics"]["kv_cache_bytes"] > 0
    assert set(command_kv["metrics"]) <= set(recipe_kv["metrics"])
    # only what the recipe's suite adds beyond the command's raw text: references, so a BLEU-drift interval
    assert set(recipe_kv["metrics"]) - set(command_kv["metrics"]) <= {"bleu_drift_ci95"}

    batch = BatchConfig(scheduler="continuous", batch_size=2, rate=50.0, requests=3)
    _, (recipe_batch,) = run_configs(tiny_loaded, inputs, workload, ONCE, [batch],
                                     RunContext(env=env, out_dir=tmp_path / "recipe"))
    spec = RunSpec(model=str(tiny_model_dir), workload=workload, protocol=ONCE, threads=1, out_dir=tmp_path / "serve")
    command_batch = run_serve(spec, ServeSpec(rates=[50.0], requests=3, batch_size=2, schedulers=("continuous",))).docs[0]
    for doc in (recipe_batch, command_batch):
        assert {"offered_rate", "interarrival_cv"} <= set(doc["metrics"]) and doc["samples"]["output_tokens"]
        assert (doc.location / "trace.jsonl").is_file() and doc["workload"]["rate"] == 50.0
    # the command adds what its own options define (goodput under its SLOs), nothing the recipe row lacks
    assert set(recipe_batch["metrics"]) <= set(command_batch["metrics"])

    # a batch-size sweep row: at its own batch size (its config's workload_for), with the sweep's keys and figure
    from infer_tune.scenarios.batch import SweepSpec, run_sweep

    sized = Workload(suite=str(prompts_file), limit=2, max_new_tokens=3)
    _, (recipe_row,) = run_configs(tiny_loaded, prepare_inputs(tiny_loaded, sized), sized, ONCE,
                                   [BatchConfig(scheduler="sweep", batch_size=2)],
                                   RunContext(env=env, out_dir=tmp_path / "recipe-sweep"))
    spec = RunSpec(model=str(tiny_model_dir), workload=sized, protocol=ONCE, threads=1, out_dir=tmp_path / "sweep")
    command_row = run_sweep(spec, SweepSpec(batch_sizes=[1, 2])).docs[-1]
    for doc in (recipe_row, command_row):
        assert doc["workload"]["batch_size"] == 2 and doc["metrics"]["batch_size"] == 2 and doc["sweep"]
        assert (doc.location / "sweep.png").is_file()
    # the command adds its memory limit and prediction, nothing the recipe row lacks
    assert set(recipe_row["metrics"]) <= set(command_row["metrics"])
    assert set(command_row["metrics"]) - set(recipe_row["metrics"]) <= {
        "predicted_peak_bytes", "memory_limit_bytes", "exceeded_memory_limit"}


WRITERS = {"save_run", "save_conclusion", "add_files"}


def test_only_the_sweep_engine_writes_results():
    """sweep/writing.py is the only module that writes a result (executors.py lands remote results measured
    by run_configs on cluster nodes through the same atomic writer), and no bench/ script writes one beside
    it (they go through `sweep.save_rows`, under the runs lock); docs/architecture.md, "The sweep engine"."""
    import ast
    from pathlib import Path

    import infer_tune

    root = Path(infer_tune.__file__).parent
    allowed = {"sweep/writing.py": WRITERS, "executors.py": {"save_run"}, "results.py": WRITERS}
    found = []
    scripts = sorted((root.parent / "bench").glob("*.py"))
    assert scripts, "the bench scripts were not found beside the package"
    for file in sorted(root.rglob("*.py")) + scripts:
        name = file.relative_to(root).as_posix() if file.is_relative_to(root) else f"bench/{file.name}"
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if called in WRITERS and called not in allowed.get(name, set()):
                    found.append(f"{name}:{node.lineno} {called}")
    assert not found, found


SWEEP_MODULE_LINES = 350  # the engine split by job (measure, document, baseline, writing): each stays small


def test_the_sweep_engine_is_split_by_job_into_small_modules():
    """The sweep engine is a package of one module per job, none over SWEEP_MODULE_LINES lines, and no single
    `session.py` holds it all again; docs/architecture.md, "Layers"."""
    from pathlib import Path

    import infer_tune

    root = Path(infer_tune.__file__).parent
    jobs = {p.stem: len(p.read_text(encoding="utf-8").splitlines()) for p in (root / "sweep").glob("*.py")}
    assert {"engine", "measure", "document", "baseline", "writing", "plan"} <= set(jobs), sorted(jobs)
    assert not (root / "session.py").exists()
    assert all(n <= SWEEP_MODULE_LINES for n in jobs.values()), {k: n for k, n in jobs.items() if n > SWEEP_MODULE_LINES}


def test_a_technique_from_its_own_package_reaches_every_surface(tiny_model_dir, prompts_file, tmp_path):
    """Registered by this test alone, a technique runs in `bench --recipe`, stacks in its phase after the
    weights, is offered to `tune`, and shows in the claims table and the report: nothing else lists it."""
    import json

    from typer.testing import CliRunner

    from infer_tune.cli import app
    from infer_tune.scenarios.tune_plan import TuneSpec, single_candidates
    from tests.plugins import echo

    echo.register()
    try:
        recipe = tmp_path / "echo.yaml"
        recipe.write_text("configs:\n  - {technique: test-echo, tag: b}\n"
                          "  - {technique: stack, configs: [{technique: test-echo}, {technique: quantize, method: bf16}]}\n")
        out = tmp_path / "runs"
        result = CliRunner().invoke(app, ["bench", "--recipe", str(recipe), "--model", str(tiny_model_dir), "--suite",
                                          str(prompts_file), "--limit", "2", "--max-new-tokens", "4", "--out", str(out),
                                          "--warmup", "0", "--min-iterations", "1", "--min-duration", "0",
                                          "--threads", "1", "--json"])
        assert result.exit_code == 0, result.output
        docs = json.loads(result.stdout)
        by = {d["technique"]: d for d in docs}
        assert by["test-echo"]["metrics"]["echo_tag"] == "b" and by["test-echo"]["metrics"]["output_mismatches"] == 0
        assert [p["technique"] for p in by["stack"]["config"]["configs"]] == ["quantize", "test-echo"]
        assert CliRunner().invoke(app, ["leaderboard", str(out)]).exit_code == 0
        assert echo.STATEMENT in (out / "leaderboard.md").read_text()
        assert "echo-b" in (out / "leaderboard.html").read_text()
        offered = [c.config for c in single_candidates(TuneSpec())]
        assert echo.EchoConfig(tag="tuned") in offered
    finally:
        echo.unregister()


def test_the_documented_contract_is_the_registrys():
    """docs/architecture.md's technique contract shows every option of a registry entry (tuners/base.py
    `Technique`) as a keyword of `register_technique`, and no option the entry does not have; an unknown
    option is refused by name."""
    import dataclasses
    from pathlib import Path

    from infer_tune.tuners.base import Technique

    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text[text.index("## The technique contract"):text.index("### Adding a technique")]
    block = section[section.index("@register_technique(MyConfig"):section.index("def prepare(")]
    shown = set(re.findall(r"(\w+)=", block))
    options = {f.name for f in dataclasses.fields(Technique)} - {"config_cls", "prepare"}
    assert shown == options, (sorted(options - shown), sorted(shown - options))
    assert f"from those {len(options)} options" in section

    @dataclass
    class Odd(TechniqueConfig):
        technique: ClassVar[str] = "test-odd"

    with pytest.raises(TypeError, match="unknown option.*tune_candidates"):
        register_technique(Odd, tune_candidates=None)
