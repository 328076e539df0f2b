"""llama.cpp at its best (infer_tune/engines/llamacpp.py): the fastest-format choice from llama-bench's JSON,
the GGUF pipeline and its cache with stand-in tools, what the reference row records, and (when
scripts/build-llama-cpp.sh built the tools here) the real conversion, quantization and llama-bench on a tiny
Llama checkpoint."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from infer_tune.engines import llamacpp
from infer_tune.errors import ConfigError


def bench_row(model: str, n_prompt: int, n_gen: int, avg_ns: float, size: int = 1000) -> dict:
    tokens = n_prompt + n_gen
    return {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "backends": "CPU",
            "model_filename": model, "model_size": size, "n_threads": 2, "n_prompt": n_prompt, "n_gen": n_gen,
            "avg_ns": avg_ns, "stddev_ns": avg_ns / 100, "avg_ts": tokens / (avg_ns / 1e9),
            "stddev_ts": 1.0}


def fake_json(rows: dict[str, tuple[float, float, float]], size: dict[str, int] | None = None) -> str:
    """rows: model file -> (prefill ms at 40, prefill ms at 500, decode ms per token over 128)."""
    out = []
    for model, (p40, p500, per_token) in rows.items():
        s = (size or {}).get(model, 1000)
        out += [bench_row(model, 40, 0, p40 * 1e6, s), bench_row(model, 500, 0, p500 * 1e6, s),
                bench_row(model, 0, 128, per_token * 128 * 1e6, s)]
    return json.dumps(out)


def test_fastest_format_by_objective():
    """Q4_0 decodes fastest, Q8_0 prefills fastest; e2e weighs both over the workload's lengths."""
    files = {"/g/q4_0.gguf": "q4_0", "/g/q4_k_m.gguf": "q4_k_m", "/g/q8_0.gguf": "q8_0"}
    text = fake_json({"/g/q4_0.gguf": (30.0, 350.0, 4.0), "/g/q4_k_m.gguf": (40.0, 420.0, 4.5),
                      "/g/q8_0.gguf": (25.0, 300.0, 6.0)})
    timings, facts = llamacpp.parse_bench(text, files)
    assert [t.format for t in timings] == ["q4_0", "q4_k_m", "q8_0"]
    q4 = timings[0]
    assert q4.prefill_ms == {40: pytest.approx(30.0), 500: pytest.approx(350.0)}
    assert q4.decode_tok_s == pytest.approx(250.0)
    assert facts["build_commit"] == "0c1e570" and facts["cpu_info"] == "AMD EPYC"
    assert llamacpp.fastest(timings, "decode", 128).format == "q4_0"
    assert llamacpp.fastest(timings, "prefill", 128).format == "q8_0"
    # e2e: q4_0 190 + 512 = 702 ms; q8_0 162.5 + 768 = 930.5 ms
    assert llamacpp.fastest(timings, "e2e", 128).format == "q4_0"
    assert q4.e2e_ms(128) == pytest.approx(190.0 + 512.0)
    # a short decode makes prefill count more: at 8 new tokens q8_0 (162.5 + 48) beats q4_0 (190 + 32)
    assert llamacpp.fastest(timings, "e2e", 8).format == "q8_0"
    with pytest.raises(ConfigError, match="objective"):
        llamacpp.fastest(timings, "latency")


def test_ties_go_to_the_smaller_file_and_bad_output_is_one_error():
    files = {"/g/a.gguf": "q8_0", "/g/b.gguf": "q4_0"}
    text = fake_json({"/g/a.gguf": (30.0, 300.0, 4.0), "/g/b.gguf": (30.0, 300.0, 4.0)},
                     size={"/g/a.gguf": 2000, "/g/b.gguf": 1000})
    timings, _ = llamacpp.parse_bench(text, files)
    assert llamacpp.fastest(timings).format == "q4_0"
    with pytest.raises(llamacpp.LlamaCppError, match="no JSON"):
        llamacpp.parse_bench("llama-bench: error", files)
    with pytest.raises(llamacpp.LlamaCppError, match="not given"):
        llamacpp.parse_bench(fake_json({"/other.gguf": (1.0, 1.0, 1.0)}), files)


def test_prompt_lengths_of_a_workload():
    assert llamacpp.prompt_lengths([43, 43, 502]) == [43, 502]
    assert llamacpp.prompt_lengths([10, 20, 30, 40, 500]) == [10, 30, 500]
    with pytest.raises(ConfigError):
        llamacpp.prompt_lengths([])


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture()
def fake_tools(tmp_path, monkeypatch):
    """Stand-in llama-quantize (copies, logs its argv), llama-bench (prints JSON where Q4_K_M is fastest,
    logs its argv), a source folder whose convert_hf_to_gguf.py writes a file, and the build's record, in a
    home of their own (the test home links the real bin/ folder: nothing may be written through it)."""
    home = tmp_path / "home"
    monkeypatch.setenv("INFER_TUNE_HOME", str(home))
    log = tmp_path / "calls.log"
    tools = tmp_path / "tools"
    tools.mkdir()
    _script(tools / "llama-quantize", f'echo "quantize $*" >> {log}\n'
                       'src=; dst=; for a in "$@"; do if [ -n "$src" ] && [ -z "$dst" ]; then dst="$a"; fi\n'
                       'case "$a" in *f16.gguf) src="$a";; esac; done; cp "$src" "$dst"\n')
    rows = {"q4_0": (30.0, 350.0, 5.0), "q4_k_m": (28.0, 330.0, 4.0), "q8_0": (25.0, 300.0, 7.0),
            "smollm2-135m (shipped)": (90.0, 1100.0, 6.0)}
    bench_py = tmp_path / "bench.py"
    bench_py.write_text(
        "import json, sys\n"
        f"rows = {rows!r}\n"
        "models = [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == '-m']\n"
        "out = []\n"
        "for m in models:\n"
        "    key = next((k for k in rows if m.endswith(k.split(' ')[0] + '.gguf')), None)\n"
        "    p40, p500, per = rows[key]\n"
        "    for n_p, n_g, ns in ((40, 0, p40 * 1e6), (500, 0, p500 * 1e6), (0, 128, per * 128 * 1e6)):\n"
        "        out.append({'model_filename': m, 'model_size': 1, 'n_prompt': n_p, 'n_gen': n_g, 'avg_ns': ns,\n"
        "                    'stddev_ns': 0, 'avg_ts': (n_p + n_g) / (ns / 1e9), 'stddev_ts': 0,\n"
        "                    'build_commit': 'abc1234', 'build_number': 7, 'cpu_info': 'test cpu'})\n"
        "print(json.dumps(out))\n")
    _script(tools / "llama-bench", f'echo "bench $*" >> {log}\nexec {os.sys.executable} {bench_py} "$@"\n')
    _script(tools / "llama-server", "exit 0\n")
    source = tmp_path / "llama.cpp"
    source.mkdir()
    (source / "convert_hf_to_gguf.py").write_text(
        "import sys\n"
        f"open({str(log)!r}, 'a').write('convert ' + ' '.join(sys.argv[1:]) + '\\n')\n"
        "out = sys.argv[sys.argv.index('--outfile') + 1]\n"
        "open(out, 'wb').write(b'GGUF' + b'0' * 64)\n")
    bin_dir = home / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    record = bin_dir / llamacpp.BUILD_INFO
    record.write_text(json.dumps({"commit": "abc1234", "build_number": 7, "llama_cpp_python": "0.3.36",
                                  "source": str(source), "flags": "native",
                                  "system_info": "system_info: n_threads = 2 / 2 | CPU : AVX2 = 1 | AVX512 = 1"}))
    for name in ("llama-quantize", "llama-bench", "llama-server"):
        monkeypatch.setenv(name.upper().replace("-", "_"), str(tools / name))
    return log


def test_ggufs_are_made_once_per_checkpoint_and_build(fake_tools, tiny_model_dir, tmp_path):
    """f16 by convert_hf_to_gguf.py, then llama-quantize with Q8_0 embeddings and output; cached by the
    checkpoint's digest and the llama.cpp version; another checkpoint makes new files."""
    log = fake_tools
    q4 = llamacpp.gguf(tiny_model_dir, "q4_0", threads=2)
    again = llamacpp.gguf(tiny_model_dir, "q4_0", threads=2)
    assert q4 == again and q4.name == "q4_0.gguf" and q4.parent.name == "b7-abc1234"
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and calls[0].startswith(f"convert {tiny_model_dir} --outtype f16")
    assert calls[1].startswith("quantize --token-embedding-type q8_0 --output-tensor-type q8_0 ")
    assert calls[1].endswith(" Q4_0 2")
    facts = llamacpp.gguf_facts(q4)
    assert facts["format"] == "q4_0" and facts["llama_cpp"]["commit"] == "abc1234"
    assert facts["checkpoint_sha256"] and facts["command"][0] == "llama-quantize"
    llamacpp.gguf(tiny_model_dir, "q8_0")  # the f16 is reused: one more call, a quantize
    assert len(log.read_text().splitlines()) == 3
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    (other / "generation_config.json").write_text("{}")
    assert llamacpp.gguf(other, "q4_0").parent != q4.parent
    with pytest.raises(ConfigError, match="GGUF type"):
        llamacpp.gguf(tiny_model_dir, "q4_1")
    with pytest.raises(ConfigError, match="GGUF type"):
        llamacpp.gguf(tiny_model_dir, "f16-default")


def test_default_head_format_leaves_the_head_to_llama_quantize(fake_tools, tiny_model_dir):
    """`q4_0-default`: the same type with llama-quantize's own output-tensor and embedding types (no Q8_0
    flags), its own file beside the Q8_0-head one, the head recorded."""
    log = fake_tools
    q8_head = llamacpp.gguf(tiny_model_dir, "q4_0")
    own_head = llamacpp.gguf(tiny_model_dir, "q4_0-default", threads=2)
    assert own_head.name == "q4_0-default.gguf" and own_head.parent == q8_head.parent
    quantize = log.read_text().splitlines()[-1]
    assert quantize.startswith("quantize ") and "--output-tensor-type" not in quantize
    assert "--token-embedding-type" not in quantize and quantize.endswith(" Q4_0 2")
    assert llamacpp.gguf_facts(own_head)["head"] == "default"
    assert llamacpp.gguf_facts(q8_head)["head"] == "q8_0"


def test_best_records_commit_system_info_and_every_format(fake_tools, tiny_model_dir, tmp_path):
    shipped = tmp_path / "smollm2-135m.gguf"
    shipped.write_bytes(b"GGUF")
    best = llamacpp.best(tiny_model_dir, [40, 500], 128, 2, repeats=5,
                         extra={"smollm2-135m (shipped)": shipped})
    assert best.format == "q4_k_m"  # fastest on both prefill and decode in the stand-in's figures
    record = best.to_dict()
    assert record["llama_cpp"]["commit"] == "abc1234" and record["llama_cpp"]["build_number"] == 7
    assert record["llama_cpp"]["system_info"].startswith("system_info:")
    assert record["llama_cpp"]["cpu_info"] == "test cpu"
    assert set(record["formats"]) == {"q4_0", "q4_k_m", "q8_0", "smollm2-135m (shipped)"}
    assert record["formats"]["q4_k_m"]["prefill_ms"] == {"40": pytest.approx(28.0), "500": pytest.approx(330.0)}
    bench_call = next(c for c in fake_tools.read_text().splitlines() if c.startswith("bench"))
    assert bench_call.count(" -m ") == 4 and "-p 40,500 -n 128 -t 2 -r 5 -o json" in bench_call
    assert record["command"][0] == "llama-bench"


def test_shipped_gguf_is_never_chosen(fake_tools, tiny_model_dir, tmp_path):
    """Timed beside for the record, even when it would be fastest."""
    shipped = tmp_path / "q4_0-shipped" / "smollm2-135m.gguf"
    shipped.parent.mkdir()
    shipped.write_bytes(b"GGUF")
    best = llamacpp.best(tiny_model_dir, [40, 500], 128, 2, formats=("q8_0",),
                         extra={"smollm2-135m (shipped)": shipped})
    assert best.format == "q8_0"


def test_reference_row_records_the_choice(fake_tools, tiny_model_dir):
    """The llama-cpp technique's facts carry the GGUF's format, the build and the fastest-format record
    when tune chose that GGUF; versus_reference passes the format and build on."""
    from infer_tune.scenarios.tune import versus_reference
    from infer_tune.tuners.base import RunContext
    from infer_tune.tuners.llamacpp import LlamaCppConfig, _facts, _resolve

    best = llamacpp.best(tiny_model_dir, [40, 500], 128, 2)
    ctx = RunContext(device="cpu", dtype="float32", threads=2)
    ctx.cache["llamacpp_best"] = best.to_dict()
    facts = _facts(best.gguf, ctx)
    assert facts["gguf_format"] == "q4_k_m" and facts["llamacpp_best"]["format"] == "q4_k_m"
    other = llamacpp.gguf(tiny_model_dir, "q8_0")
    assert "llamacpp_best" not in _facts(other, ctx)  # another GGUF is not the chosen one
    assert _resolve(LlamaCppConfig(), ctx).engine == "server"  # the built llama-server (a stand-in here)
    winner = {"metrics": {"tpot_ms": {"p50": 2.0}, "ttft_ms": {"p50": 30.0}}}
    reference = {"metrics": {"tpot_ms": {"p50": 4.0}, "ttft_ms": {"p50": 30.0}, "gguf_format": "q4_k_m",
                             "llama_cpp": {"commit": "abc1234", "system_info": "system_info: x"}}}
    vs = versus_reference(winner, reference)
    assert vs["reference_format"] == "q4_k_m" and vs["reference_llama_cpp"]["commit"] == "abc1234"


def test_missing_tools_are_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_BENCH", str(tmp_path / "missing"))
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("INFER_TUNE_HOME", str(tmp_path / "home"))  # no bin/llama-bench there
    with pytest.raises(ConfigError, match="build-llama-cpp.sh"):
        llamacpp.require("llama-bench")
    with pytest.raises(ConfigError, match="not a checkpoint"):
        llamacpp.gguf_dir(tmp_path, {"commit": "abc"})
    with pytest.raises(ConfigError, match=r"no llama-server \(\$LLAMA_SERVER unset\) or llama-bench \(\$LLAMA_BENCH is"):
        llamacpp.version_key({})
    with pytest.raises(ConfigError, match="version is unknown"):
        llamacpp.version_key({"source": "/x"})


def test_parse_version_line():
    assert llamacpp.parse_version("version: 1 (0c1e570)\nbuilt with GNU 12.2.0") == {"build_number": 1,
                                                                                     "commit": "0c1e570"}
    assert llamacpp.parse_version("version: 0.5.0-dev (build 1, commit 0c1e570)") == {"build_number": 1,
                                                                                      "commit": "0c1e570"}
    assert llamacpp.parse_version("nothing") == {}


# ----------------------------------------------------------------------------- the real tools
def _real_tools_or_skip():
    missing = llamacpp.missing_tools(("llama-quantize", "llama-bench"))
    if missing:
        pytest.skip(f"llama.cpp's {', '.join(missing)} not built here (scripts/build-llama-cpp.sh)")
    try:
        llamacpp.source_dir()
    except ConfigError as exc:
        pytest.skip(str(exc))


@pytest.fixture()
def tiny_bpe_checkpoint(tmp_path, _test_home):
    """A tiny random Llama with SmolLM2's tokenizer (llama.cpp's converter knows its pre-tokenizer; the
    suite's own tiny BPE tokenizer it refuses)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    smollm2 = _test_home / "models" / "smollm2-135m"
    if not (smollm2 / "tokenizer.json").is_file():
        pytest.skip("SmolLM2's tokenizer is not provisioned (infer-tune models pull smollm2-135m)")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path / "tiny-bpe"
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_real_pipeline_on_a_tiny_llama(tiny_bpe_checkpoint):
    """convert_hf_to_gguf.py -> f16 -> llama-quantize Q4_0 with Q8_0 token embeddings; llama-bench times it."""
    _real_tools_or_skip()
    from gguf import GGMLQuantizationType, GGUFReader

    path = llamacpp.gguf(tiny_bpe_checkpoint, "q4_0", threads=2)
    types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert types["token_embd.weight"] == GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q4_0
    f16 = {t.name: t.tensor_type for t in GGUFReader(path.with_name("f16.gguf")).tensors}
    assert f16["blk.0.attn_q.weight"] == GGMLQuantizationType.F16
    best = llamacpp.best(tiny_bpe_checkpoint, [8], 4, 1, repeats=1, formats=("q4_0", "q8_0"))
    assert best.format in ("q4_0", "q8_0") and all(t.decode_tok_s > 0 for t in best.timings)
    assert best.llama_cpp["commit"] and best.llama_cpp.get("build_commit")


def test_tune_times_the_workloads_own_prompt_lengths(fake_tools, tiny_loaded):
    """tune's reference, asked of the registry: llama-bench at the prompts' token counts (as tune's Host
    hands them) and the workload's new tokens, the run's threads; the fastest becomes the row's GGUF."""
    from infer_tune.tuners import llamacpp as technique
    from infer_tune.tuners.base import RunContext, TuneAsk

    counts = (5, 17, 17)
    offers = technique.tune_offer(TuneAsk(reference=True, loaded=tiny_loaded, prompt_tokens=counts,
                                          max_new_tokens=24))
    assert [o.role for o in offers] == ["reference"] and offers[0].reason is None
    config = offers[0].config
    assert config.engine == "server" and config.best_at == [5, 17] and config.best_new_tokens == 24
    ctx = RunContext(device="cpu", dtype="float32", threads=3)
    path = technique._fastest(tiny_loaded, config, ctx)
    bench_call = next(c for c in fake_tools.read_text().splitlines() if c.startswith("bench"))
    assert "-p 5,17 -n 24 -t 3 " in bench_call
    chosen = ctx.cache["llamacpp_best"]
    assert chosen["format"] == "q4_k_m" and str(path) == chosen["gguf"]
    assert bench_call.count(" -m ") == 3  # no shipped GGUF behind a random model: nothing timed beside
    assert technique.tune_offer(TuneAsk(reference=False, loaded=tiny_loaded)) == []


@pytest.mark.parametrize("extra, fragment", [(["--type", "q4_1"], "GGUF type"),
                                             (["--bench", "--prompt-lengths", "40,x"], "--prompt-lengths"),
                                             (["--bench", "--n-gen", "0"], "--bench"),
                                             (["--objective", "latency"], "--objective")])
def test_models_gguf_bad_input_exits_2(tiny_model_dir, extra, fragment):
    from typer.testing import CliRunner

    from infer_tune.cli import app

    result = CliRunner().invoke(app, ["models", "gguf", str(tiny_model_dir), *extra])
    assert result.exit_code == 2 and fragment in result.output and "Traceback" not in result.output


def test_real_server_row_records_the_build(tiny_bpe_checkpoint, prompts_file, tmp_path):
    """A `technique: llama-cpp` row on the built llama-server (engine server): measured through the endpoint
    runner, labelled by its format, with the commit and system_info of the build in its metrics."""
    _real_tools_or_skip()
    if llamacpp.tool("llama-server") is None:
        pytest.skip("llama.cpp's llama-server not built here (scripts/build-llama-cpp.sh)")
    from typer.testing import CliRunner

    from infer_tune.cli import app

    path = llamacpp.gguf(tiny_bpe_checkpoint, "q8_0", threads=2)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({
        "model": str(tiny_bpe_checkpoint), "workload": {"suite": str(prompts_file), "limit": 2, "max_new_tokens": 4},
        "protocol": {"warmup": 1, "min_iterations": 1, "min_duration_s": 0},
        "configs": [{"technique": "llama-cpp", "gguf": str(path), "engine": "server"}]}))
    result = CliRunner().invoke(app, ["bench", "--recipe", str(recipe), "--threads", "1", "--no-ppl",
                                      "--out", str(tmp_path / "runs"), "--json"])
    assert result.exit_code == 0, result.output
    docs = json.loads(result.stdout)
    row = next(d for d in (docs if isinstance(docs, list) else [docs]) if d["technique"] == "llama-cpp")
    m = row["metrics"]
    assert row["label"] == "llama.cpp q8_0" and row["runner"] == "endpoint" and m["gguf_format"] == "q8_0"
    assert m["llama_cpp"]["commit"] == llamacpp.build_info()["commit"]
    assert m["command"][0] == "llama-server" and m["requests_ok"] == 2
