"""OpenVINO GenAI as an engine (infer_tune/engines/openvino.py, docs/engines.md "OpenVINO"): the settings and
export plumbing without the runtime, then SmolLM2-135M exported and run for real (one int8 export per session
under the test home, by the exporter venv of the real home)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from infer_tune.engines import openvino as ovm
from infer_tune.errors import ConfigError
from tests.conftest import REAL_HOME


# --------------------------------------------------------------------------- without the runtime
@pytest.mark.parametrize("values, message", [
    ({"weight_format": "int3"}, "weight_format must be one of"),
    ({"kv_cache_precision": "q8"}, "kv_cache_precision must be one of"),
    ({"hint": "FAST"}, "hint must be one of"),
    ({"weight_format": "int8", "group_size": 64}, "apply to weight_format=int4"),
    ({"prefix_caching": True}, "needs scheduler=true"),
    ({"speed": 1}, "unknown openvino setting(s) speed"),
])
def test_bad_settings_are_one_clear_config_error(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ovm.Settings.from_dict(values)


def test_export_command_and_cache_key_follow_the_settings(tmp_path):
    int4 = ovm.Settings(weight_format="int4", ratio=0.8, sym=True)
    argv = ovm.export_argv(Path("/py"), tmp_path, int4, tmp_path / "out")
    # nncf's default group size (128) does not divide SmolLM2's 576 channels: int4 exports with 64
    assert argv[argv.index("--weight-format") + 1] == "int4" and argv[argv.index("--group-size") + 1] == "64"
    assert argv[argv.index("--ratio") + 1] == "0.8" and "--sym" in argv
    assert ovm.export_key(int4) == "int4-g64-r0.8-sym"
    assert ovm.export_key(ovm.Settings()) == "int8" and "--group-size" not in ovm.export_argv(
        Path("/py"), tmp_path, ovm.Settings(), tmp_path / "o")
    # runtime-only settings share the export of their weight format
    assert ovm.export_key(ovm.Settings(kv_cache_precision="f16", hint="THROUGHPUT")) == "int8"


def test_eos_ids_without_a_torch_model():
    """An engine's row has no torch model: the generation runner's eos_ids reads the tokenizer's."""
    from types import SimpleNamespace

    from infer_tune.runners.generation import eos_ids

    assert eos_ids(None, SimpleNamespace(eos_token_id=2)) == [2]


# --------------------------------------------------------------------------- for real
EXPORTER = REAL_HOME / ovm.EXPORTER_DIR


@pytest.fixture(scope="module")
def exported(tmp_path_factory, smollm2_available):
    why = ovm.runtime_missing()
    if why:
        pytest.skip(why)
    if not smollm2_available:
        pytest.skip("smollm2-135m is not provisioned (make model)")
    if not (EXPORTER / ovm.EXPORTER_MARK).is_file():
        pytest.skip(f"the OpenVINO exporter venv is not installed at {EXPORTER} "
                    "(python -c 'from infer_tune.engines import openvino; openvino.ensure_exporter()')")
    home = tmp_path_factory.mktemp("ov-home")
    (home / "models").mkdir()
    (home / "models" / "smollm2-135m").symlink_to(REAL_HOME / "models" / "smollm2-135m")
    mp = pytest.MonkeyPatch()
    mp.setenv("INFER_TUNE_HOME", str(home))
    mp.setenv("INFER_TUNE_OPENVINO_EXPORTER", str(EXPORTER / "bin" / "python"))
    folder = ovm.export(REAL_HOME / "models" / "smollm2-135m", ovm.Settings())
    mp.undo()
    return home, folder


@pytest.fixture
def ov_home(exported, monkeypatch):
    home, folder = exported
    monkeypatch.setenv("INFER_TUNE_HOME", str(home))
    monkeypatch.setenv("INFER_TUNE_OPENVINO_EXPORTER", str(EXPORTER / "bin" / "python"))
    return folder


@pytest.fixture
def smol_run(ov_home):
    from infer_tune.scenarios.common import RunSpec, open_run
    from infer_tune.workload import Protocol, Workload

    spec = RunSpec(workload=Workload(limit=2, max_new_tokens=8), threads=1,
                   protocol=Protocol(warmup=1, min_iterations=1, min_duration_s=0.0))
    return spec, open_run(spec)


def test_export_is_cached_by_checkpoint_digest_and_settings(ov_home, monkeypatch):
    assert (ov_home / "openvino_model.xml").is_file() and (ov_home / "export.json").is_file()
    assert ov_home.parent.parent.name == "openvino" and ov_home.name == "int8"
    record = ovm.export_record(ov_home)
    assert record["settings"]["weight_format"] == "int8" and record["ir_bytes"] > 100e6  # 135M int8 weights
    monkeypatch.setattr(ovm, "_run", lambda *a, **k: pytest.fail("a cached export ran the exporter again"))
    assert ovm.export(REAL_HOME / "models" / "smollm2-135m", ovm.Settings(hint="LATENCY")) == ov_home


def test_runner_times_every_token_of_openvinos_own_greedy_decode(smol_run, ov_home):
    from infer_tune.runners import get_runner
    from infer_tune.runners.generation import eos_ids

    spec, run = smol_run
    loaded, inputs = run.loaded, run.inputs
    prepared = ovm.prepare(ov_home, ovm.Settings(threads=1), loaded.tokenizer, eos_ids(loaded.model, loaded.tokenizer))
    result = get_runner("openvino")(prepared, inputs, spec.workload, spec.protocol)
    assert len(result.requests) == 2 and len(result.outputs) == 2
    for request in result.requests:
        assert len(request.token_ns) == 8  # pinned: every request decodes its full length
        assert request.token_ns == sorted(request.token_ns) and request.token_ns[0] > request.submit_ns
    # the tokens are OpenVINO's: its own pipeline's greedy text on the same rendered prompt
    pipe = prepared.runner_options["pipeline"]
    config = ovm.generation_config(pipe, prepared.runner_options["settings"], 8, pin_length=False)
    config.apply_chat_template = False  # the prompt is rendered already (a string is templated again by default)
    own = str(pipe.generate(inputs.rendered[0], config))
    assert result.outputs[0].text.strip() and own.startswith(result.outputs[0].text.strip()[:20])


def test_tune_engine_openvino_rows_against_its_default(smol_run, ov_home, tmp_path, monkeypatch):
    """The search's rows against OpenVINO's default; each configuration runs first in a child process (the
    engine's probe, engines/crash.py `run_child`): the real probe passes for the default and the f16 cache, a
    child that kills itself with SIGILL (as llama.cpp's AMX matmul does) is a `crashed` row with its reproducer,
    listed twice it is built once (quarantined), and the search measures the rest."""
    import sys

    from infer_tune.metrics import perplexity as P
    from infer_tune.results import find_results
    from infer_tune.scenarios.openvino_tune import OpenVINOTuneSpec, run_openvino_tune

    real, probed = ovm.probe_command, []
    sigill = ["-c", "import os, signal; print('jit_amx: tile', flush=True); os.kill(os.getpid(), signal.SIGILL)"]

    def probe_command(folder, settings):
        probed.append(settings.label)
        return [sys.executable, *sigill] if settings.kv_cache_precision == "f32" else real(folder, settings)

    monkeypatch.setattr(ovm, "probe_command", probe_command)
    spec, run = smol_run
    torch_ppl = P.reference_perplexity(run.loaded.model, run.loaded.tokenizer, run.inputs.rendered,
                                       [p.reference for p in run.inputs.prompts])
    spec = dataclasses.replace(spec, out_dir=tmp_path / "runs")
    outcome = run_openvino_tune(spec, OpenVINOTuneSpec(budget_s=60), settings_list=[
        {"kv_cache_precision": "f16"}, {"weight_format": "int8", "group_size": 32}, {"kv_cache_precision": "f32"},
        {"kv_cache_precision": "f32"}])
    assert [r["label"] for r in outcome.refused] == ["openvino weight_format=int8 group_size=32",
                                                     "openvino kv_cache_precision=f32"]
    assert "quarantined (crashed at start: signal SIGILL (4))" in outcome.refused[1]["reason"]
    f32 = "openvino weight_format=int8 kv_cache_precision=f32 threads=1"
    assert probed == ["openvino weight_format=int8 threads=1",
                      "openvino weight_format=int8 kv_cache_precision=f16 threads=1", f32]
    (crashed,) = outcome.crashed
    assert (crashed.label, crashed["engine_status"], crashed["crash"]["signal"]) == (f32, "crashed", "SIGILL")
    assert crashed["crash"]["log_tail"][-1] == "jit_amx: tile" and crashed.engine == ovm.ENGINE
    assert len(crashed["crash"]["reproducer"]["model_sha256"]["ir"]) == 64  # the IR the child was given
    (row,) = outcome.rows
    assert row.label == "openvino weight_format=int8 kv_cache_precision=f16 threads=1" and row.baseline_run_id
    assert row.metrics["ppl_source"] == "openvino logits" and row.engine == ovm.ENGINE
    # the cache is read back in its precision: an f16 cache is not scored as the default's u8 one (a single
    # teacher-forced forward scored both alike); both near the torch model's figure on the same text
    assert row.metrics["ppl_delta_pct"] != 0 and abs(row.metrics["ppl_delta_pct"]) < 5
    assert abs(outcome.baseline.metrics["ppl"] / torch_ppl - 1) < 0.05
    assert row.metrics["speedup_vs_baseline_ci95"] and "bleu_drift" in row.metrics
    assert outcome.baseline.get("engine_status") == "default" and outcome.recommended.is_file()
    assert len(list(find_results(spec.out_dir))) == 3  # the default, the f16 cache, the crashed f32
    assert os.path.isdir(row.config["launch"]["export"]["path"])

