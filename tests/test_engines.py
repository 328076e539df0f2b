"""The engine axis (docs/architecture.md, "The engine axis"): one registry of what runs a model, each entry
declaring what technique stack it runs and how; recipes name their engine; nothing else lists engines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import infer_tune
from infer_tune import recipe as recipes
from infer_tune.engines.base import (
    ENGINES,
    Engine,
    config_engine,
    engine_of,
    register_engine,
    resolve,
    unregister_engine,
)
from infer_tune.errors import ConfigError

ROOT = Path(infer_tune.__file__).parent


def test_every_engine_is_registered_with_how_it_starts_and_what_measures_it():
    got = {name: (e.starts, e.runner) for name, e in ENGINES.items()}
    assert {k: got[k] for k in ("torch", "lean", "slots", "llama.cpp", "vllm", "sglang", "remote")} == {
        "torch": ("in-process", "generation"), "lean": ("in-process", "generation"), "slots": ("in-process", "trace"),
        "llama.cpp": ("server", "endpoint"), "vllm": ("server", "endpoint"), "sglang": ("server", "endpoint"),
        "remote": ("server", "endpoint")}
    # a launched engine's technique map is read off its settings table: every setting tagged with a technique
    llama = ENGINES["llama.cpp"]
    assert "cache_type_k" in llama.techniques["kv-cache"] and "draft" in llama.techniques["speculate"]
    assert set(llama.setting_table) >= {"gguf", "parallel"}


def test_one_engines_definition_in_the_package():
    """`ENGINES =` is defined once (engines/base.py): the launch, batch, speculate, llama-cpp and reference-server
    tuples it replaced are gone."""
    found = [f"{f.relative_to(ROOT)}:{i}" for f in ROOT.rglob("*.py")
             for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if re.match(r"\s*ENGINES\s*=", line)]
    assert found == [f"engines{'/'}base.py:{found[0].split(':')[1]}"] if found else False


def test_supports_names_why_not():
    from infer_tune.tuners.kv_cache import KVCacheConfig
    from infer_tune.tuners.lean import LeanConfig
    from infer_tune.tuners.speculate import SpeculateConfig
    from infer_tune.tuners.stack import StackConfig

    slots = ENGINES["slots"]
    from infer_tune.tuners.quantize import QuantizeConfig

    assert slots.supports(StackConfig(configs=[QuantizeConfig(method="int8-dynamic"), LeanConfig()])) is None
    assert slots.supports(KVCacheConfig(impl="static")) is None
    assert slots.supports(SpeculateConfig(draft="prompt-lookup")) is None  # verified in the native step
    assert "not served" in slots.supports(SpeculateConfig(draft="self-draft:1", engine="lean"))
    assert "impl 'quantized'" in slots.supports(KVCacheConfig(impl="quantized"))
    assert "does not run lean" in ENGINES["torch"].supports(LeanConfig())
    assert ENGINES["remote"].supports([]) is None and ENGINES["remote"].supports(LeanConfig())


def test_a_row_runs_on_the_engine_its_parts_name():
    from infer_tune.tuners.batch import BatchConfig
    from infer_tune.tuners.lean import LeanConfig
    from infer_tune.tuners.quantize import QuantizeConfig
    from infer_tune.tuners.stack import StackConfig

    assert engine_of(QuantizeConfig(method="int8-dynamic")) == "torch"
    assert engine_of(StackConfig(configs=[QuantizeConfig(method="int8-dynamic"), LeanConfig()])) == "lean"
    assert engine_of(BatchConfig(scheduler="continuous", batch_size=2, rate=1.0, engine="lean")) == "slots"
    assert engine_of(BatchConfig(scheduler="continuous", batch_size=2, rate=1.0)) == "torch"


def test_config_engine_fields_resolve_through_the_registry():
    """speculate's and batch's `engine` take an in-process engine that runs the technique (or its alias) and keep
    their own spelling; a launched or non-selectable engine is refused naming what is allowed."""
    from infer_tune.tuners.batch import BatchConfig
    from infer_tune.tuners.speculate import SpeculateConfig

    assert SpeculateConfig(draft="prompt-lookup", engine="torch").engine == "hf"
    assert BatchConfig(scheduler="continuous", batch_size=2, rate=1.0, engine="torch").engine == "transformers"
    for bad in ("llama.cpp", "slots", "nope"):
        with pytest.raises(ConfigError, match="speculate engine must be one of torch, hf, transformers, lean"):
            SpeculateConfig(draft="prompt-lookup", engine=bad)
    assert config_engine("lean", technique="batch") == "lean"
    assert resolve("hf") == "torch"


def test_an_engine_module_plugs_in_by_registering_itself():
    register_engine(Engine(name="test-engine", starts="in-process", runner="generation",
                           techniques={"quantize": "its own int8"}, version=lambda: {"version": "1"}))
    try:
        from infer_tune.tuners.speculate import SpeculateConfig

        assert ENGINES["test-engine"].identity() == {"version": "1"}
        assert config_engine("test-engine", technique="quantize") == "test-engine"
        assert "does not run speculate" in ENGINES["test-engine"].supports(SpeculateConfig(draft="prompt-lookup"))
    finally:
        unregister_engine("test-engine")
    assert "test-engine" not in ENGINES
    with pytest.raises(TypeError, match="starts"):
        Engine(name="x", starts="elsewhere", runner="generation")


def test_scenarios_name_no_technique_or_engine_by_string():
    """scenarios/ dispatches through the registries: no string constant there is a technique's or an engine's
    name (serve asks ENGINES for the slots engine's supports / settings; the launch tuner asks what a
    launched engine does)."""
    from infer_tune.tuners import configs_by_technique

    names = {n for n in configs_by_technique() if n} | {n for e in ENGINES.values() for n in (e.name, *e.aliases)}
    hits = [(f.name, node.lineno, node.value) for f in sorted((ROOT / "scenarios").glob("*.py"))
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]
    assert hits == []


# Where a string spelled like an engine names something else (the rule of the test below, path prefix -> words):
# the torch and transformers *libraries* (package versions, logger names, quantize's plain-torch backend, the
# speculative verify path's torch forward), the word "slots" as a count field of metrics and plans, and a
# technique's own name (and runner's) inside its own package. Anything else naming an engine goes through the
# registry (engines/base.py) or the engine's registered entry.
NOT_AN_ENGINE = {
    "env.py": {"torch", "transformers"}, "report/html.py": {"torch", "transformers"},
    "cli/__init__.py": {"torch", "transformers"}, "tuners/quantize/": {"torch", "transformers"},
    "tuners/speculate/prepare.py": {"torch"},
    "endpoint/serving.py": {"slots"}, "tuners/batch/serving.py": {"slots"}, "tuners/experts/planners.py": {"slots"},
    "tuners/lean/": {"lean"}, "tuners/llamacpp/": {"llama-cpp"},
}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def test_no_module_outside_engines_names_an_engine():
    """Engine knowledge lives in infer_tune/engines: no module outside it has a string constant (docstrings
    aside) equal to a registered engine's name or alias, except where the same spelling names something else
    (NOT_AN_ENGINE). How a reference server starts, a config's word for its engine, what a technique runs on:
    each is asked of the registry."""
    names = {n for e in ENGINES.values() for n in (e.name, *e.aliases)}
    hits = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith("engines/"):
            continue
        allowed = set().union(*(words for prefix, words in NOT_AN_ENGINE.items() if rel.startswith(prefix)))
        tree = ast.parse(f.read_text(encoding="utf-8"))
        docs = _docstrings(tree)
        hits += [(rel, node.lineno, node.value) for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                 and node.value not in allowed and id(node) not in docs]
    assert sorted(hits) == []


def test_reference_servers_are_started_from_the_engines_entry(tmp_path, monkeypatch):
    """endpoint/servers.py starts what the engine's `serve_here` gives it: a registered stand-in engine is
    started by name, and its own checks refuse options it does not have."""
    from infer_tune.endpoint import servers
    from infer_tune.engines.base import ServeHere

    def refuse(parallel):
        if parallel > 1:
            raise ConfigError("test-served has no slots")

    serve = ServeHere(command=lambda ref, port, **kw: (["test-server", ref, str(port)], "served-" + ref),
                      check=refuse, missing=lambda: [], extra="none")
    register_engine(Engine(name="test-served", starts="server", runner="endpoint", serve_here=serve))
    try:
        assert servers.engine_command("test-served", "m", 8123) == (["test-server", "m", "8123"], "served-m")
        servers.check_engine("test-served", 1)
        with pytest.raises(ConfigError, match="test-served has no slots"):
            servers.check_engine("test-served", 2)
    finally:
        unregister_engine("test-served")
    with pytest.raises(ConfigError, match="engine must be one of llama.cpp, llama-cpp, torch, hf, transformers, got"):
        servers.check_engine("test-served")


# --------------------------------------------------------------------------- recipes name their engine
def test_a_launch_recipe_is_one_format_and_an_earlier_launch_file_is_refused(tmp_path):
    """One recipe format: engine, model and settings at the top; the launch file of earlier versions is not
    sniffed and read another way but refused in one line (its key unknown)."""
    new = tmp_path / "new.yaml"
    new.write_text("model: m\nengine: llama.cpp\nsettings: {gguf: q4_0, parallel: 2}\nworkload: {limit: 2}\n")
    launch = recipes.engine_launch(recipes.load_recipe(str(new)))
    assert (launch.engine, launch.model, launch.settings) == ("llama.cpp", "m", {"gguf": "q4_0", "parallel": 2})
    old = tmp_path / "old.yaml"
    old.write_text("engine_launch: {engine: llama.cpp, model: m, settings: {gguf: q4_0, parallel: '2'}, argv: [x]}\n"
                   "workload: {limit: 2}\nresult: runs/x\n")
    with pytest.raises(ConfigError, match="unknown keys engine_launch, result"):
        recipes.load_recipe(str(old))


@pytest.mark.parametrize("body, why", [
    ("engine: nope\nconfigs: []\n", "engine must be one of"),
    ("model: m\nengine: llama.cpp\nsettings: {gguf: q3_x}\n", "must be one of"),
    ("model: m\nengine: llama.cpp\nconfigs: [{technique: lean}]\n", "runs from its settings"),
    ("model: m\nengine: openvino\nsettings: {weight_format: int3}\n", "weight_format must be one of"),
    ("engine: torch\nsettings: {gguf: q4_0}\n", "takes no settings"),
    ("settings: {gguf: q4_0}\n", "name it with engine:"),
    ("engine: remote\n", "bench --endpoint"),
])
def test_bad_engine_recipes_are_refused_in_one_line(tmp_path, body, why):
    path = tmp_path / "r.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=why):
        recipes.load_recipe(str(path))


def test_an_in_process_engine_must_run_every_config(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("engine: slots\nconfigs: [{technique: speculate, draft: self-draft:1, engine: lean}]\n")
    with pytest.raises(ConfigError, match=r"configs\[0\]: .*speculative draft 'self-draft:1' is not served"):
        recipes.build_configs(recipes.load_recipe(str(path)))


def test_bench_recipe_of_a_launched_engine_reaches_the_launch(monkeypatch, tmp_path):
    """`bench --recipe FILE` reads the file once, as a recipe: its engine and settings (with --set over them) are
    the launch measured; no other reader sees the file."""
    from infer_tune.cli import app
    from infer_tune.scenarios import engine_tune

    seen = []
    monkeypatch.setattr(engine_tune, "run_engine_bench", lambda spec, launch, **_: seen.append(launch) or [])
    path = tmp_path / "recommended.yaml"
    path.write_text("model: m\nengine: vllm\nsettings: {max_num_seqs: 4}\n")
    result = CliRunner().invoke(app, ["bench", "--recipe", str(path), "--set", "kv_cache_dtype=fp8", "--json"])
    assert result.exit_code == 0, result.output
    assert [(la.engine, la.model, la.settings) for la in seen] == [
        ("vllm", "m", {"max_num_seqs": 4, "kv_cache_dtype": "fp8"})]


@pytest.mark.parametrize("argv, expect", [
    (["bench", "--engine", "openvino", "--set", "weight_format=int4", "--set", "kv_cache_precision=f16",
      "--set", "prompt_lookup=true", "--model", "m"],
     ("openvino", "m", {"weight_format": "int4", "kv_cache_precision": "f16", "prompt_lookup": True})),
    (["bench", "--recipe", "RECIPE", "--set", "hint=throughput"],
     ("openvino", "smol", {"weight_format": "int8", "kv_cache_precision": "f16", "hint": "THROUGHPUT"})),
    (["bench", "--engine", "llama.cpp", "--set", "gguf=q4_0", "--model", "m"], ("llama.cpp", "m", {"gguf": "q4_0"})),
])
def test_bench_engine_goes_through_the_engines_scenario(monkeypatch, tmp_path, argv, expect):
    """`bench --engine E --set ...` and `bench --recipe` of an engine's recipe take one path: the registry's
    `parse_settings`, then `bench` of the engine's scenario (OpenVINO in-process, llama.cpp launched); the
    recipe `tune --engine openvino` writes is read back (engine, model, settings), --set layered over it."""
    from infer_tune.cli import app
    from infer_tune.scenarios import engine_tune, openvino_tune

    seen = []
    for module in (engine_tune, openvino_tune):
        monkeypatch.setattr(module, "bench", lambda spec, engine, settings, **_: seen.append(
            (engine, spec.model, settings)) or [])
    path = tmp_path / "recommended.yaml"
    path.write_text("model: smol\nengine: openvino\nsettings: {weight_format: int8, kv_cache_precision: f16}\n"
                    "provenance: {export: /x}\n")
    result = CliRunner().invoke(app, [str(path) if a == "RECIPE" else a for a in argv] + ["--json"])
    assert result.exit_code == 0, result.output
    assert seen == [expect]


@pytest.mark.parametrize("sets, why", [(["weight_format=int3"], "weight_format must be one of"),
                                       (["sym=maybe"], "sym takes true / false"),
                                       (["speed=1"], "unknown openvino setting")])
def test_bench_engine_openvino_bad_setting_is_one_line(sets, why):
    from infer_tune.cli import app

    result = CliRunner().invoke(app, ["bench", "--engine", "openvino", *[x for s in sets for x in ("--set", s)]])
    assert result.exit_code == 2 and why in result.output, result.output


# --------------------------------------------------------------------------- in-process crashes are rows
SIGILL_CHILD = ("import os, signal; print('ggml_backend_amx_mul_mat: tile config', flush=True); "
                "os.kill(os.getpid(), signal.SIGILL)")
HANG_CHILD = "import time; print('compiling', flush=True); time.sleep(60)"  # the hang under test, cut at 1 s


@pytest.mark.parametrize("code, expect", [(SIGILL_CHILD, ("SIGILL", None)), (HANG_CHILD, (None, 1.0))])
def test_an_in_process_engines_child_that_dies_or_hangs_is_a_crashed_row(tmp_path, code, expect):
    """engines/crash.py `run_child`: an in-process engine's configuration runs first in a child; one killed by
    SIGILL or silent past its deadline is a Crash (the signal or the hang, its log's tail, a reproducer with the
    binary, the engine's build, the argv, the model file's sha256 and the CPU flags), saved as a `crashed` row
    that is never eligible; a configuration crashed once is quarantined; an exit code is not a crash."""
    import sys

    from infer_tune import env as envinfo
    from infer_tune.engines import crash
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.scenarios.engine_tune import crashed_doc
    from infer_tune.sweep import Row, save_rows

    weights = tmp_path / "openvino_model.bin"
    weights.write_bytes(b"weights")
    target = crash.InProcess("openvino", "smollm2-135m", {"weight_format": "int4"}, "openvino weight_format=int4")
    end = crash.run_child(target, [sys.executable, "-c", code], deadline_s=1.0, log_path=tmp_path / "probe.log",
                          files={"ir": weights})
    found = end.crash
    assert found is not None and (found.signal, found.hung_after_s) == expect and found.phase == "start"
    assert found.log_tail[-1] == ("ggml_backend_amx_mul_mat: tile config" if expect[0] else "compiling")
    rep = found.reproducer
    assert rep["binary"] == sys.executable and rep["argv"] == ["-c", code]
    assert rep["model_sha256"]["ir"] == __import__("hashlib").sha256(b"weights").hexdigest()
    assert rep["cpu_flags"] == envinfo.cpu_flags() and set(rep["build"]) == set(ENGINES["openvino"].identity())
    assert rep["line"].endswith(f"{sys.executable} -c {__import__('shlex').quote(code)}")
    doc = save_rows(tmp_path / "runs", [Row(crashed_doc(RunSpec(out_dir=tmp_path / "runs"), found, None))])[0]
    assert doc["engine_status"] == "crashed" and doc["eligible"] is False and doc.engine == "openvino"
    assert doc.runner == "openvino" and doc["crash"]["reproducer"]["line"] == rep["line"]
    quarantine = crash.Quarantine()
    quarantine.add(target, found.summary)
    assert crash.InProcess("openvino", "smollm2-135m", {"weight_format": "int4"}, "again") in quarantine


def test_an_in_process_engines_child_that_exits_with_a_code_is_not_a_crash(tmp_path):
    import sys

    from infer_tune.engines import crash

    target = crash.InProcess("openvino", "m", {}, "openvino default")
    end = crash.run_child(target, [sys.executable, "-c", "import sys; print('refused: no such hint'); sys.exit(3)"],
                          deadline_s=30.0, log_path=tmp_path / "probe.log")
    assert end.crash is None and end.code == 3 and end.tail == ["refused: no such hint"]


def test_an_engine_row_is_compared_with_its_own_default_by_its_settings():
    """The report's "compared with" of an engine row names that engine's default and its settings (OpenVINO's
    int8 export is no f16 GGUF); a launched server's default is a launch."""
    from infer_tune.report.leads import default_vs

    base = {"run_id": "b", "label": "openvino weight_format=int8 threads=2"}
    row = {"run_id": "r", "baseline_run_id": "b", "label": "openvino weight_format=int8 kv_cache_precision=f16"}
    from infer_tune.document import as_document

    assert default_vs("openvino", as_document(row), [base, row]) == \
        "openvino default (weight_format=int8 threads=2; same run)"
    assert default_vs("llama.cpp", as_document({**row, "label": "llama.cpp gguf=q4_0"}),
                      [{"run_id": "b", "label": "llama.cpp default"}]) == \
        "llama.cpp default launch (default flags; same run)"


@pytest.mark.parametrize("engine, settings", [("openvino", "{kv_cache_precision: f16}"), ("llama.cpp", "{gguf: q4_0}")])
def test_serve_refuses_a_recipe_of_an_engine_run_from_its_settings(tmp_path, engine, settings):
    from infer_tune.scenarios.serve import plan_from_recipe

    path = tmp_path / "recommended.yaml"
    path.write_text(f"model: m\nengine: {engine}\nsettings: {settings}\n")
    with pytest.raises(ConfigError, match=f"names engine {engine}, run from its own settings: serve runs the slots"):
        plan_from_recipe(str(path))


def test_a_row_without_a_baseline_is_not_said_to_be_compared_with_one():
    """A server measured on its own (bench --endpoint without --baseline, as engines_report.py's serve row) has no
    ratio: the report says so instead of "baseline (same session)"."""
    from infer_tune.document import as_document
    from infer_tune.report.leads import decode_speedup

    lead = decode_speedup(as_document({"run_id": "s", "technique": "endpoint", "metrics": {}}))
    assert lead.figures == () and lead.vs == "- (no baseline of its own)"


def test_an_in_process_engine_that_raises_during_the_rounds_is_a_crashed_row_and_the_rest_are_measured(tmp_path):
    """After its child probe came through, a configuration whose engine raises in the measured rounds (its 2nd
    run here) is a `crashed` row (phase measurement, the exception, the traceback's tail, its probe as the
    reproducer), quarantined, and the rounds start again with the default and the others, which are measured."""
    import sys

    import torch

    from infer_tune import rounds
    from infer_tune.engines import crash
    from infer_tune.runners.base import RUNNERS, GenerationRun, RequestTiming
    from infer_tune.runners.prepared import PreparedModel
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.scenarios.engine_tune import crashed_doc, rounds_without_crashes
    from infer_tune.sweep import Row, save_rows
    from infer_tune.workload import Inputs, Protocol

    calls: dict[str, int] = {}

    def run(prepared, inputs, workload, protocol, progress):
        calls[prepared.label] = calls.get(prepared.label, 0) + 1
        if prepared.label == "bad" and calls["bad"] == 2:
            raise RuntimeError("Exception from src/plugins/intel_cpu/src/node.cpp:771: jit kernel failed")
        req = RequestTiming(0, 0, 4, 0, [int(1e6 * (10 + 10.0 * k)) for k in range(5)])
        return GenerationRun([req], [], 0.1, 1, None, 0.0, 0, 0, 5, 1)

    register_engine(Engine(name="test-raising", starts="in-process", runner="test-raising",
                           techniques={"quantize": "its own"}, version=lambda: {"version": "1"}))
    RUNNERS["test-raising"] = run
    try:
        variants = [rounds.Variant(n, PreparedModel(None, None, label=n), "test-raising") for n in ("default", "bad", "good")]
        targets = {n: crash.InProcess("test-raising", "m", {"mode": n}, f"test-raising mode={n}") for n in ("bad", "good")}
        quarantine = crash.Quarantine()

        def crash_of(variant, exc):
            found = crash.exception_crash(targets[variant.name], exc, [sys.executable, "-c", "pass", variant.name])
            quarantine.add(targets[variant.name], found.summary)
            return found

        one = Inputs(prompts=[None], rendered=["x"], batches=[{"input_ids": torch.zeros(1, 4)}], templated=False)
        protocol = Protocol(warmup=0, min_iterations=1, min_duration_s=0, max_rounds=3)
        outcome, kept, dropped = rounds_without_crashes(variants, one, None, lambda: protocol, crash_of=crash_of)
    finally:
        RUNNERS.pop("test-raising")
    try:
        assert [v.name for v in kept] == ["default", "good"] and outcome.variants == 2
        assert set(outcome.intervals) == {"good"} and len(kept[1].passes) == outcome.rounds >= rounds.MIN_ROUNDS
        ((variant, found),) = dropped
        assert variant.name == "bad" and found.phase == "measurement" and found.signal is None
        assert found.exception == "RuntimeError: Exception from src/plugins/intel_cpu/src/node.cpp:771: jit kernel failed"
        assert found.log_tail[-1] == found.exception and any("Traceback" in ln for ln in found.log_tail)
        assert targets["bad"] in quarantine and targets["good"] not in quarantine
        doc = save_rows(tmp_path / "runs", [Row(crashed_doc(RunSpec(out_dir=tmp_path / "runs"), found, None))])[0]
        assert doc["engine_status"] == "crashed" and doc["eligible"] is False and doc.engine == "test-raising"
        assert doc["crash"]["reproducer"]["line"].endswith("-c pass bad") and doc["crash"]["phase"] == "measurement"
    finally:
        unregister_engine("test-raising")


def test_an_exception_of_the_default_during_the_rounds_is_raised_as_it_came():
    import torch

    from infer_tune import rounds
    from infer_tune.runners.base import RUNNERS
    from infer_tune.runners.prepared import PreparedModel
    from infer_tune.scenarios.engine_tune import rounds_without_crashes
    from infer_tune.workload import Inputs, Protocol

    def run(prepared, inputs, workload, protocol, progress):
        raise ValueError("the default's engine failed")

    RUNNERS["test-raising-default"] = run
    try:
        variants = [rounds.Variant(n, PreparedModel(None, None), "test-raising-default") for n in ("default", "x")]
        one = Inputs(prompts=[None], rendered=["x"], batches=[{"input_ids": torch.zeros(1, 4)}], templated=False)
        with pytest.raises(ValueError, match="default's engine") as caught:
            rounds_without_crashes(variants, one, None, lambda: Protocol(warmup=0, min_iterations=1, min_duration_s=0),
                                   crash_of=lambda v, e: pytest.fail("the default is not dropped"))
        assert getattr(caught.value, rounds.VARIANT_ATTR) == "default"
    finally:
        RUNNERS.pop("test-raising-default")
