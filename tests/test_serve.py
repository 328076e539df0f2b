"""`infer-tune serve` (infer_tune/endpoint/serving.py, infer_tune/tuners/batch/serving.py): a tiny int4 model
served by the slot engine on 127.0.0.1 (a free port), driven by the project's own endpoint client
(`bench --endpoint`, streaming, 4 requests in flight) and by plain HTTP (non-streaming). Every answer is
the engine's own greedy output for its prompt alone (0 mismatches), usage counts are the tokenizer's, bad
requests get 400 / 404 / 413, and SIGTERM stops the server cleanly (exit 0).

Bounded: 4 prompts x 8 tokens, every HTTP call with a timeout, the server started with a 120 s readiness
limit and always stopped (terminate, then kill).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer_tune.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()
SERVE = ["--method", "int4-rtn", "--no-compile", "--context", "256", "--slots", "4", "--threads", "1"]
PROMPTS = ["Question 1: what is 1 plus 1?", "def add(a, b):\n    return a + b", "The quick brown fox", "Hello"]


def _post(url: str, body, timeout: float = 60.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (loopback)
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture(scope="module")
def server(tiny_model_dir, _test_home):
    env = dict(os.environ, INFER_TUNE_HOME=str(_test_home), PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen([sys.executable, "-m", "infer_tune", "serve", "--model", str(tiny_model_dir), *SERVE,
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and not line.startswith("READY"):
            line = process.stdout.readline()
            if not line and process.poll() is not None:
                pytest.fail(f"serve exited with {process.returncode}: {process.stderr.read()[-2000:]}")
        assert line.startswith("READY"), "serve did not print READY within 120 s"
        yield process, line.split()[1]
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, _test_home):
    """The same plan built in this process: its `alone` outputs are the reference of every answer."""
    from infer_tune.scenarios.serve import build, plan_from_method

    old = os.environ.get("INFER_TUNE_HOME")
    os.environ["INFER_TUNE_HOME"] = str(_test_home)
    try:
        plan = plan_from_method(str(tiny_model_dir), "int4-rtn")
        plan.slots, plan.compile = 4, False
        return build(plan, threads=1, max_context=256)
    finally:
        if old is None:
            os.environ.pop("INFER_TUNE_HOME", None)
        else:
            os.environ["INFER_TUNE_HOME"] = old


def _chat_ids(tokenizer, text: str) -> list[int]:
    from infer_tune.workload import render_prompt

    return list(tokenizer(render_prompt(tokenizer, text, True), add_special_tokens=False)["input_ids"])


def _expected_text(served, ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
    tokens = served.engine.alone(ids, max_tokens)
    return served.tokenizer.decode(tokens, skip_special_tokens=True), tokens


def test_bench_endpoint_streams_the_engines_own_greedy_outputs(server, engine, tiny_model_dir, tmp_path):
    """The project's client (streaming, usage in the last chunk, 4 in flight: requests share decode steps)."""
    _, url = server
    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps({"prompt": p, "reference": p}) + "\n" for p in PROMPTS))
    result = runner.invoke(app, ["bench", "--endpoint", url, "--model", str(tiny_model_dir), "--suite", str(suite),
                                 "--limit", "4", "--max-new-tokens", "8", "--concurrency", "4", "--warmup", "0",
                                 "--min-iterations", "1", "--min-duration", "0", "--out", str(tmp_path / "runs"),
                                 "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    m = doc["metrics"]
    assert m["requests_ok"] == 4 and m["requests_failed"] == 0 and m["token_count_source"] == "usage"
    from infer_tune import results

    outputs = results.load_outputs(doc["location"])
    assert len(outputs) == 4
    mismatches = 0
    for o in outputs:
        ids = _chat_ids(engine.tokenizer, o["prompt"])
        expected, _ = _expected_text(engine, ids, 8)
        mismatches += o["output"] != expected
        assert o["prompt_tokens"] == len(ids)  # usage.prompt_tokens: the tokenizer's count
    assert mismatches == 0


def test_non_streaming_answers_and_usage(server, engine):
    _, url = server
    for text in PROMPTS:
        ids = _chat_ids(engine.tokenizer, text)
        status, answer = _post(f"{url}/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                           "max_tokens": 8, "temperature": 0})
        assert status == 200, answer
        expected, tokens = _expected_text(engine, ids, 8)
        assert answer["choices"][0]["message"]["content"] == expected
        usage = answer["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0  # the prefix cache's (a native step: its own test)
        assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
            "prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}
        plain = list(engine.tokenizer(text)["input_ids"])
        status, answer = _post(f"{url}/completions", {"prompt": text, "max_tokens": 5, "ignore_eos": True})
        assert status == 200, answer
        tokens = engine.engine.alone(plain, 5, ignore_eos=True)
        assert answer["choices"][0]["text"] == engine.tokenizer.decode(tokens, skip_special_tokens=True)
        assert answer["usage"]["prompt_tokens"] == len(plain) and answer["usage"]["completion_tokens"] == 5


def test_models_health_and_bad_requests(server, tiny_model_dir):
    _, url = server
    with urllib.request.urlopen(f"{url}/models", timeout=10) as response:  # noqa: S310
        assert [m["id"] for m in json.loads(response.read())["data"]] == [Path(tiny_model_dir).name]
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10) as response:  # noqa: S310
        assert json.loads(response.read())["status"] == "ok"
    chat = f"{url}/chat/completions"
    assert _post(chat, b"{not json")[0] == 400
    assert _post(chat, b"[1, 2]")[0] == 400
    assert _post(chat, {"messages": "hi"})[0] == 400
    for bad in ({"temperature": 3}, {"temperature": 0.5, "top_p": 0}, {"top_k": -1}, {"seed": "x"},
                {"stop": ["a", "b", "c", "d", "e"]}, {"stop": ""}):
        status, answer = _post(chat, {"messages": [{"role": "user", "content": "hi"}], **bad})
        assert status == 400 and list(bad)[-1] in answer["error"]["message"], (bad, answer)
    assert _post(chat, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})[0] == 400
    assert _post(chat, {"messages": [{"role": "user", "content": "hi"}], "model": "other"})[0] == 404
    status, answer = _post(f"{url}/completions", {"prompt": "word " * 400})
    assert status == 400 and "context is 256" in answer["error"]["message"]
    status, _ = _post(f"{url}/completions", b'{"prompt": "' + b"x" * (2 << 20) + b'"}')
    assert status == 413


def test_sampling_is_seeded_top_k_1_is_greedy_and_stop_strings_end_the_text(server, engine):
    _, url = server
    chat = f"{url}/chat/completions"
    text = PROMPTS[1]
    base = {"messages": [{"role": "user", "content": text}], "max_tokens": 24, "ignore_eos": True}
    greedy_text, _ = _expected_text(engine, _chat_ids(engine.tokenizer, text), 24)

    def answer(**options) -> tuple[str, str]:
        status, body = _post(chat, {**base, **options})
        assert status == 200, body
        return body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]

    seeded = answer(temperature=1.5, seed=42)
    assert answer(temperature=1.5, seed=42) == seeded  # the same seed, the same tokens
    assert answer(temperature=1.5, seed=43)[0] != seeded[0] != greedy_text  # a random model at 1.5: not greedy
    assert answer(temperature=1.0, top_k=1, seed=7)[0] == greedy_text  # the most likely token only: greedy
    assert answer(temperature=0.8, top_p=1e-6, seed=7)[0] == greedy_text  # the nucleus of one token
    stop = greedy_text[len(greedy_text) // 2:len(greedy_text) // 2 + 3]
    cut = greedy_text.index(stop)
    assert answer(stop=[stop, "\x00never"]) == (greedy_text[:cut], "stop")
    request = urllib.request.Request(chat, data=json.dumps({**base, "stop": stop, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 (loopback)
        events = [json.loads(line[6:]) for line in response.read().decode().splitlines()
                  if line.startswith("data: {")]
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices"))
    assert streamed == greedy_text[:cut] and events[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_are_the_chosen_tokens_and_their_top_alternatives(server, engine):
    """Chat `logprobs` + `top_logprobs` and completions' `logprobs` N: one entry per returned token, the chosen
    token's log probability the largest of its top list under greedy (and <= 0), the tokens spelling the text,
    the same entries streamed; bad values 400."""
    _, url = server
    text = PROMPTS[0]
    base = {"messages": [{"role": "user", "content": text}], "max_tokens": 6, "ignore_eos": True}
    status, body = _post(f"{url}/chat/completions", {**base, "logprobs": True, "top_logprobs": 3})
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 6
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 3 and entry["logprob"] <= 0 and entry["logprob"] == pytest.approx(top[0]["logprob"])
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
        assert entry["bytes"] == list(entry["token"].encode())
    assert "".join(e["token"] for e in content) == engine.tokenizer.decode(
        engine.engine.alone(_chat_ids(engine.tokenizer, text), 6))
    plain = _post(f"{url}/chat/completions", base)[1]["choices"][0]
    assert "logprobs" not in plain or plain["logprobs"] is None
    status, body = _post(f"{url}/completions", {"prompt": text, "max_tokens": 4, "ignore_eos": True, "logprobs": 2})
    block = body["choices"][0]["logprobs"]
    assert status == 200 and len(block["tokens"]) == len(block["token_logprobs"]) == len(block["top_logprobs"]) == 4
    assert all(len(t) <= 2 for t in block["top_logprobs"])
    request = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(
        {**base, "logprobs": True, "stream": True}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 (loopback)
        events = [json.loads(line[6:]) for line in response.read().decode().splitlines() if line.startswith("data: {")]
    streamed = [e for ev in events for c in ev.get("choices", []) for e in (c.get("logprobs") or {}).get("content", [])]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content])
    # one event per token (its content possibly empty), besides the role announcement and the finish
    per_token = [ev for ev in events for c in ev.get("choices", []) if "content" in c["delta"]
                 and "role" not in c["delta"] and not c["finish_reason"]]
    assert len(per_token) == 6
    for bad in ({"logprobs": "yes"}, {"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        assert _post(f"{url}/chat/completions", {**base, **bad})[0] == 400, bad


def test_sigterm_stops_cleanly(server):
    """Last in the module: the server exits 0 on SIGTERM, within a bound, and says how many it served."""
    process, _ = server
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    assert "stopped after" in process.stderr.read()


def test_recipe_plans_and_refusals(tmp_path, tiny_model_dir):
    from infer_tune.errors import ConfigError
    from infer_tune.scenarios.serve import plan_from_recipe

    recipe = tmp_path / "recommended.yaml"
    recipe.write_text(f"model: {tiny_model_dir}\nconfigs:\n  - technique: stack\n    configs:\n"
                      "      - {technique: quantize, method: int4-rtn, activations: int8}\n"
                      "      - {technique: batch, scheduler: continuous, batch_size: 2, rate: 1.0, engine: lean, "
                      "native_step: true}\n")
    plan = plan_from_recipe(str(recipe))
    assert plan.slots == 2 and plan.native_step and [c.method for c in plan.weights] == ["int4-rtn"]
    lean = tmp_path / "lean.yaml"
    lean.write_text(f"model: {tiny_model_dir}\nconfigs:\n  - {{technique: lean, native_step: true}}\n")
    assert plan_from_recipe(str(lean)).slots == 1
    lookup = tmp_path / "lookup.yaml"  # prompt lookup: drafts verified in the native step
    lookup.write_text(f"model: {tiny_model_dir}\nconfigs:\n  - {{technique: stack, configs: [{{technique: quantize, method: int4-rtn, activations: int8}},"
                      f" {{technique: speculate, draft: prompt-lookup, num_draft_tokens: 8, engine: lean, native_step: true}}]}}\n")
    plan = plan_from_recipe(str(lookup))
    assert (plan.speculate, plan.ngram, plan.native_step, plan.slots) == (8, 2, True, 4) and not plan.notes
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model: {tiny_model_dir}\nconfigs:\n  - {{technique: speculate, draft: self-draft:1, engine: lean}}\n")
    with pytest.raises(ConfigError, match="not served"):
        plan_from_recipe(str(spec))
    result = runner.invoke(app, ["serve", "--recipe", str(spec)])
    assert result.exit_code == 2 and "not served" in result.output
