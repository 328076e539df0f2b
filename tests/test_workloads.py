"""Endpoint workloads (infer_tune/endpoint/workloads.py, sessions.py): trace parsers on the shipped samples
and on bad files, seeded determinism, Mooncake hash blocks as shared token prefixes, multi-turn sessions
against the loopback server (history grows and carries the server's answers), per-turn aggregation,
token counts checked against the server's usage. Network on 127.0.0.1 only, every replay bounded."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infer_tune.cli import app
from infer_tune.endpoint import workloads as wl
from infer_tune.endpoint.client import StreamRecord
from infer_tune.endpoint.config import EndpointConfig
from infer_tune.endpoint.loopback import Behaviour, LoopbackServer
from infer_tune.endpoint.replay import check_token_count, client_session
from infer_tune.endpoint.sessions import replay_sessions
from infer_tune.errors import ConfigError
from infer_tune.runners.base import RequestTiming

DATA = Path(__file__).parent / "data"
TRACES = DATA / "traces"
CONVERSATIONS = DATA / "conversations_sample.jsonl"
runner = CliRunner()


# --------------------------------------------------------------------------- parsers
def test_mooncake_sample_parses_with_arrivals_lengths_and_hash_blocks():
    entries, info = wl.read_trace(TRACES / "mooncake_sample.jsonl", "mooncake")
    assert [e.arrival_s for e in entries] == [0.0, 0.12, 0.25, 0.25, 0.6, 0.71]
    assert [e.input_length for e in entries] == [40, 36, 20, 48, 12, 24]
    assert [e.output_length for e in entries] == [4, 3, 5, 2, 4, 3]
    assert entries[3].hash_ids == [0, 1, 2, 6] and info == {"format": "mooncake", "file": "mooncake_sample.jsonl",
                                                            "rows": 6, "skipped": 0, "block_size": 512}
    assert wl.sharing_first_block(entries) == 5  # hash 0 opens 3 requests, hash 4 two


def test_burstgpt_sample_parses_relative_to_its_first_row_and_skips_failed_requests():
    entries, info = wl.read_trace(TRACES / "burstgpt_sample.csv", "burstgpt")
    assert [round(e.arrival_s, 6) for e in entries] == [0.0, 0.3, 1.4, 2.0]
    assert [(e.input_length, e.output_length) for e in entries] == [(42, 6), (17, 3), (30, 4), (12, 5)]
    assert info["rows"] == 5 and info["skipped"] == 1  # the row with 0 response tokens


def test_plain_jsonl_sample_takes_prompts_messages_or_lengths():
    entries, _ = wl.read_trace(TRACES / "plain_sample.jsonl", "jsonl")
    assert [e.arrival_s for e in entries] == [0.0, 0.08, 0.15, 0.4]
    assert entries[0].prompt.startswith("Summarize") and entries[1].prompt is None and entries[1].input_length == 16
    assert entries[2].prompt[0] == {"role": "system", "content": "You are terse."}
    prompts = wl.trace_prompts(entries, seed=0, block_size=512, vocab=wl.vocabulary())
    assert prompts[0] == entries[0].prompt and prompts[2] == entries[2].prompt and len(prompts[1].split()) == 16


@pytest.mark.parametrize("fmt, text, expected", [
    ("mooncake", '{"timestamp": 0, "input_length": 4, "output_length": 2}\n', "line 1: missing hash_ids"),
    ("mooncake", '{"timestamp": 5, "input_length": 4, "output_length": 2, "hash_ids": [1]}\n'
                 '{"timestamp": 3, "input_length": 4, "output_length": 2, "hash_ids": [1]}\n',
     "line 2: timestamp goes back in time"),
    ("mooncake", '{"timestamp": 0, "input_length": -4, "output_length": 2, "hash_ids": [1]}\n',
     "line 1: input_length must be >= 1, got -4"),
    ("mooncake", '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}\n',
     "longer than its 1 hash block(s) of 512 tokens"),
    ("mooncake", 'not json\n', "line 1: not JSON"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens\n1,m,3,4,7\n",
     "missing column(s) Log Type"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,m,3,-4,7,x\n",
     "line 2: Response tokens must be >= 0, got -4"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n2,m,3,4,7,x\n1,m,3,4,7,x\n",
     "line 3: timestamp goes back in time"),
    ("jsonl", '{"timestamp": 0, "output_length": 2}\n', "line 1: needs prompt or input_length"),
    ("jsonl", '{"timestamp": -1, "prompt": "hi", "output_length": 2}\n', "timestamp must be >= 0"),
])
def test_bad_traces_are_one_line_config_errors(tmp_path, fmt, text, expected):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as err:
        wl.read_trace(path, fmt)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_bad_trace_on_the_command_line_exits_2_with_one_line_before_any_request(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 9, "input_length": 4, "output_length": 2, "hash_ids": [1]}\n'
                   '{"timestamp": 1, "input_length": 4, "output_length": 2, "hash_ids": [1]}\n')
    with LoopbackServer() as server:
        cases = [["--trace", str(bad), "--trace-format", "mooncake"],
                 ["--trace", str(TRACES / "burstgpt_sample.csv"), "--trace-format", "parquet"],
                 [],  # --workload trace without a file
                 ["--trace", str(TRACES / "mooncake_sample.jsonl"), "--trace-format", "mooncake", "--time-scale", "0"]]
        for extra in cases:
            result = runner.invoke(app, ["endpoint", "sim", "--endpoint", server.url, "--workload", "trace",
                                         "--out", str(tmp_path / "out"), *extra])
            assert result.exit_code == 2, result.output
            assert result.output.count("\n") == 1 and result.output.startswith("error:"), result.output
        assert server.requests == []  # nothing sent (the trace is read before the endpoint is contacted)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- seeded, shared prefixes
def test_same_seed_same_schedule_and_prompts_another_seed_another():
    entries, _ = wl.read_trace(TRACES / "mooncake_sample.jsonl", "mooncake")
    one = wl.synthesize_trace(entries, 50, seed=3)
    assert one == wl.synthesize_trace(entries, 50, seed=3) and one != wl.synthesize_trace(entries, 50, seed=4)
    assert len(one) == 50 and all(b.arrival_s >= a.arrival_s for a, b in zip(one, one[1:]))
    gaps = {round(b.arrival_s - a.arrival_s, 9) for a, b in zip(entries, entries[1:])}
    assert {round(b.arrival_s - a.arrival_s, 9) for a, b in zip(one, one[1:])} <= gaps  # the trace's own gaps
    assert {(e.input_length, tuple(e.hash_ids)) for e in one} <= {(e.input_length, tuple(e.hash_ids)) for e in entries}
    vocab = wl.vocabulary()
    assert wl.trace_prompts(one, seed=1, block_size=16, vocab=vocab) == wl.trace_prompts(one, seed=1, block_size=16,
                                                                                          vocab=vocab)
    assert wl.trace_prompts(one, seed=1, block_size=16, vocab=vocab) != wl.trace_prompts(one, seed=2, block_size=16,
                                                                                          vocab=vocab)
    conversations = wl.conversations_of(json.loads(line) for line in CONVERSATIONS.read_text().splitlines())
    plan = wl.plan_sessions(conversations, [0.0, 0.5, 1.0, 1.5], max_turns=2, think_time_ms=100, seed=7)
    assert plan == wl.plan_sessions(conversations, [0.0, 0.5, 1.0, 1.5], max_turns=2, think_time_ms=100, seed=7)
    assert plan != wl.plan_sessions(conversations, [0.0, 0.5, 1.0, 1.5], max_turns=2, think_time_ms=100, seed=8)
    assert [len(p.conversation.users) for p in plan] == [2, 2, 1, 2] and [p.first_index for p in plan] == [0, 2, 4, 5]


def test_min_turns_replays_only_conversations_that_long_and_is_checked():
    conversations = wl.conversations_of(json.loads(line) for line in CONVERSATIONS.read_text().splitlines())
    assert [len(c.users) for c in conversations] == [3, 2, 1]
    plan = wl.plan_sessions(conversations, [0.0, 0.5, 1.0], max_turns=3, min_turns=2, think_time_ms=0, seed=0)
    assert [p.conversation.id for p in plan] == ["conv-a", "conv-b", "conv-a"]
    assert [p.first_index for p in plan] == [0, 3, 5]
    with pytest.raises(ConfigError, match="no conversation of the suite has 4 user turns"):
        wl.plan_sessions(conversations, [0.0], max_turns=4, min_turns=4, think_time_ms=0, seed=0)
    with pytest.raises(ConfigError, match="--min-turns"):
        wl.WorkloadOptions(kind="multi-turn", max_turns=2, min_turns=3)
    assert "min_turns" not in wl.WorkloadOptions(kind="multi-turn").to_dict()  # earlier results keep their key
    assert wl.WorkloadOptions(kind="multi-turn", max_turns=3, min_turns=3).to_dict()["min_turns"] == 3
    result = runner.invoke(app, ["endpoint", "sim", "--endpoint", "http://127.0.0.1:9/v1", "--workload", "multi-turn",
                                 "--max-turns", "2", "--min-turns", "3"])
    assert result.exit_code == 2 and "--min-turns (3) must be <= --max-turns (2)" in result.output


def test_written_trace_reads_back_the_same(tmp_path):
    entries, _ = wl.read_trace(TRACES / "mooncake_sample.jsonl", "mooncake")
    wl.write_trace(wl.synthesize_trace(entries, 20, seed=0), tmp_path / "synth.jsonl")
    again, info = wl.read_trace(tmp_path / "synth.jsonl", "mooncake")
    expected = wl.synthesize_trace(entries, 20, seed=0)
    assert [(e.input_length, e.output_length, e.hash_ids) for e in again] == [
        (e.input_length, e.output_length, e.hash_ids) for e in expected] and info["rows"] == 20
    assert [e.arrival_s for e in again] == pytest.approx([e.arrival_s for e in expected], abs=1e-6)


def test_requests_sharing_hash_blocks_get_identical_token_prefixes():
    from tests.conftest import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    entries, _ = wl.read_trace(TRACES / "mooncake_sample.jsonl", "mooncake", block_size=16)
    prompts = wl.trace_prompts(entries, seed=0, block_size=16, vocab=wl.vocabulary(tokenizer))
    words = [p.split() for p in prompts]
    assert [len(w) for w in words] == [e.input_length for e in entries]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    # requests 0 and 1 share hash blocks 0 and 1 (32 tokens), then differ (block 2 vs block 3)
    shared = len(tokenizer(" ".join(words[0][:32]), add_special_tokens=False)["input_ids"])
    assert ids[0][:shared] == ids[1][:shared] and words[0][32:36] != words[1][32:36]
    # request 3 is request 0 plus block 6; requests 2 and 5 share blocks 4 and 5 (the shorter one's 20 words)
    assert ids[3][:len(ids[0])] == ids[0] and words[5][:20] == words[2]
    assert words[4][:12] != words[0][:12]  # block 7 is its own


def test_shared_prefix_requests_are_seeded_and_share_their_system_prompts():
    texts, choice, suite = wl.shared_prefix_requests(12, 5, prefixes=3, prefix_tokens=20, seed=1, vocab=wl.WORDS)
    assert (texts, choice, suite) == wl.shared_prefix_requests(12, 5, prefixes=3, prefix_tokens=20, seed=1,
                                                               vocab=wl.WORDS)
    assert len(texts) == 3 and all(len(t.split()) == 20 for t in texts) and len(set(texts)) == 3
    assert set(choice) <= {0, 1, 2} and suite == [k % 5 for k in range(12)]


# --------------------------------------------------------------------------- multi-turn
def _plans(max_turns=3, think_ms=20.0):
    conversations = wl.conversations_of(json.loads(line) for line in CONVERSATIONS.read_text().splitlines())
    return wl.plan_sessions(conversations[:2], [0.0, 0.01], max_turns=max_turns, think_time_ms=think_ms, seed=0)


def _replay(server, plans, history):
    config = EndpointConfig(url=server.url, served_model="loopback", concurrency=4, stream_usage=True, timeout_s=10)

    async def main():
        async with client_session(config) as session:
            return await asyncio.wait_for(replay_sessions(session, config, plans, 8, history=history), 20)

    return asyncio.run(main())


def test_multi_turn_history_grows_and_feeds_back_the_servers_answers():
    plans = _plans()
    with LoopbackServer(Behaviour(chunks=3)) as server:
        done = _replay(server, plans, "server")
        sent = [r["messages"] for r in server.requests]
    conv_a = [m for m in sent if m[0]["content"] == "alpha one question"]
    assert [len(m) for m in conv_a] == [1, 3, 5]  # the conversation so far, every turn
    # the loopback server answers with the last user message's words: that answer comes back as history
    assert conv_a[1][1] == {"role": "assistant", "content": "alpha one question "}
    assert conv_a[2][3] == {"role": "assistant", "content": "alpha two followup "}
    assert done.turn_of == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1} and done.turns_not_sent == 0
    assert len(done.result.timings) == 5 and not done.result.failures
    by_index = {t.prompt_index: t for t in done.result.timings}
    for plan in plans:  # each later turn is due its think time after the previous answer's last token
        for k in range(1, len(plan.conversation.users)):
            before, after = by_index[plan.first_index + k - 1], by_index[plan.first_index + k]
            assert after.submit_ns - before.token_ns[-1] >= plan.think_s[k - 1] * 1e9 - 1e6
            assert after.start_ns >= after.submit_ns - 2e6  # not sent before it was due


def test_multi_turn_recorded_history_sends_the_conversations_own_answers():
    with LoopbackServer(Behaviour(chunks=3)) as server:
        _replay(server, _plans(max_turns=2), "recorded")
        sent = [r["messages"] for r in server.requests]
    assert [m for m in sent if len(m) == 3][0][1] in ({"role": "assistant", "content": "recorded answer a1"},
                                                      {"role": "assistant", "content": "recorded b1"})
    assert all(m[1]["content"].startswith("recorded") for m in sent if len(m) == 3)


def test_a_failed_turn_ends_its_session():
    with LoopbackServer(Behaviour(chunks=3, fail_every=2)) as server:
        done = _replay(server, _plans(think_ms=0.0), "server")
    assert len(done.result.failures) >= 1 and done.turns_not_sent >= 1
    assert len(done.result.timings) + len(done.result.failures) + done.turns_not_sent == 5


def test_per_turn_aggregation_by_turn_and_history_length():
    def timing(index, ttft_ms, prompt_tokens):
        return RequestTiming(index, 0, prompt_tokens, 0, [int(ttft_ms * 1e6), int(ttft_ms * 1e6) + 1000])

    timings = [timing(0, 10, 30), timing(1, 4, 100), timing(2, 2, 300), timing(3, 20, 40), timing(4, 6, 120),
               timing(5, 30, 50)]
    turns = wl.per_turn(timings, {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 0})
    assert [(r["turn"], r["requests"], r["ttft_ms"]["p50"]) for r in turns["by_turn"]] == [
        (1, 3, 20.0), (2, 2, 5.0), (3, 1, 2.0)]
    assert turns["by_turn"][0]["ttft_ms"]["p90"] == pytest.approx(28.0)
    assert turns["by_turn"][1]["history_tokens_p50"] == 110.0
    assert [(r["history_tokens"], r["requests"], r["ttft_ms"]["p50"]) for r in turns["by_history"]] == [
        ([0, 64], 3, 20.0), ([64, 128], 2, 5.0), ([256, 512], 1, 2.0)]


def test_endpoint_sim_multi_turn_saves_turns_and_sessions(tmp_path):
    with LoopbackServer(Behaviour(chunks=4)) as server:
        result = runner.invoke(app, ["endpoint", "sim", "--endpoint", server.url, "--workload", "multi-turn",
                                     "--suite", str(CONVERSATIONS), "--rates", "40", "--sessions", "3",
                                     "--max-turns", "3", "--think-time-ms", "5", "--max-new-tokens", "4",
                                     "--concurrency", "4", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)[0]
    m = doc["metrics"]
    assert m["sessions"] == 3 and m["turns_sent"] == 6 and m["requests_ok"] == 6 and m["turns_not_sent"] == 0
    assert [r["requests"] for r in m["turns"]["by_turn"]] == [3, 2, 1]
    assert doc["config"]["workload"]["kind"] == "multi-turn" and doc["config"]["workload"]["history"] == "server"
    run = tmp_path / doc["run_id"]
    plans = [json.loads(line) for line in (run / "sessions.jsonl").read_text().splitlines()]
    assert [p["conversation"]["id"] for p in plans] == ["conv-a", "conv-b", "conv-c"]
    outputs = [json.loads(line) for line in (run / "outputs.jsonl").read_text().splitlines()]
    assert {o["reference"] for o in outputs} >= {"recorded answer a1", "recorded b2"}  # one row per turn
    # the report: a per-turn table in the markdown and the HTML
    report = runner.invoke(app, ["leaderboard", str(tmp_path), "--format", "md,html"])
    assert report.exit_code == 0, report.output
    md = (tmp_path / "leaderboard.md").read_text()
    assert "## TTFT by turn" in md and "| turn 3 | 1 |" in md and "| history 0-64 | 6 |" in md
    assert "<h2>TTFT by turn" in (tmp_path / "leaderboard.html").read_text()


def test_endpoint_sim_min_turns_sends_every_turn_of_every_session(tmp_path):
    with LoopbackServer(Behaviour(chunks=2)) as server:
        result = runner.invoke(app, ["endpoint", "sim", "--endpoint", server.url, "--workload", "multi-turn",
                                     "--suite", str(CONVERSATIONS), "--rates", "40", "--sessions", "3",
                                     "--max-turns", "3", "--min-turns", "3", "--think-time-ms", "0",
                                     "--max-new-tokens", "2", "--concurrency", "4", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)[0]
    assert [r["requests"] for r in doc["metrics"]["turns"]["by_turn"]] == [3, 3, 3]
    assert doc["config"]["workload"]["min_turns"] == 3
    plans = [json.loads(line) for line in (tmp_path / doc["run_id"] / "sessions.jsonl").read_text().splitlines()]
    assert {p["conversation"]["id"] for p in plans} == {"conv-a"}


# --------------------------------------------------------------------------- token counts
def test_token_count_check_allows_only_the_end_of_sequence_token():
    def record(events, usage, finish):
        return StreamRecord(delivery_ns=list(range(events)), texts=["x"] * events, finish_reason=finish,
                            usage=None if usage is None else {"completion_tokens": usage})

    assert check_token_count(record(4, 4, "length")) is True
    assert check_token_count(record(4, 5, "stop")) is True  # the server counted its end-of-sequence token
    assert check_token_count(record(4, 5, "length")) is False
    assert check_token_count(record(4, 8, "stop")) is False
    assert check_token_count(record(4, None, "stop")) is None


def test_token_count_mismatches_are_counted_and_warned(tmp_path):
    trace = tmp_path / "even.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 10 * k, "input_length": 6, "output_length": 8}) + "\n"
                             for k in range(6)))
    # the server claims two tokens per streamed event: its usage disagrees with what the client counted
    with LoopbackServer(Behaviour(chunks=4, tokens_per_chunk=2)) as server:
        result = runner.invoke(app, ["endpoint", "sim", "--endpoint", server.url, "--workload", "trace", "--trace",
                                     str(trace), "--trace-format", "jsonl", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    m = json.loads(result.stdout)["metrics"]
    assert m["requests_ok"] == 6 and m["token_count_mismatches"] == 6 and m["token_count_unverified"] == 0
    first = m["token_count_failures"][0]
    assert first["usage_completion_tokens"] == 2 * first["streamed_tokens"]
    assert "token_count_mismatches" in result.stderr
    with LoopbackServer(Behaviour(chunks=4)) as server:
        result = runner.invoke(app, ["endpoint", "sim", "--endpoint", server.url, "--workload", "trace", "--trace",
                                     str(TRACES / "mooncake_sample.jsonl"), "--trace-format", "mooncake",
                                     "--time-scale", "0.1", "--out", str(tmp_path), "--json"])
    m = json.loads(result.stdout)["metrics"]
    assert m["token_count_mismatches"] == 0 and m["token_count_failures"] == []


# --------------------------------------------------------------------------- trace replay end to end
def test_trace_replay_at_its_times_scaled_and_saved_to_replay_exactly(tmp_path):
    with LoopbackServer(Behaviour(chunks=6)) as server:
        result = runner.invoke(app, ["endpoint", "sim", "--endpoint", server.url, "--workload", "trace", "--trace",
                                     str(TRACES / "mooncake_sample.jsonl"), "--trace-format", "mooncake",
                                     "--time-scale", "0.5", "--out", str(tmp_path / "a"), "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        sent = server.requests[-6:]
        schedule = tmp_path / "a" / doc["run_id"] / "schedule.jsonl"
        again = runner.invoke(app, ["endpoint", "sim", "--endpoint", server.url, "--workload", "trace", "--trace",
                                    str(schedule), "--trace-format", "jsonl", "--out", str(tmp_path / "b"), "--json"])
        assert again.exit_code == 0, again.output
        resent = server.requests[-6:]
    m = doc["metrics"]
    assert m["trace_requests"] == 6 and m["trace_span_s"] == pytest.approx(0.355)
    lengths = {len(r["messages"][0]["content"].split()): r["max_tokens"] for r in sent}
    assert lengths == {40: 4, 36: 3, 20: 5, 48: 2, 12: 4, 24: 3}  # each request's own length and output length
    key = lambda r: (json.dumps(r["messages"]), r["max_tokens"])  # noqa: E731 (two requests share a time)
    assert sorted(map(key, resent)) == sorted(map(key, sent))  # the saved schedule replays exactly
    assert json.loads(again.stdout)["metrics"]["trace_span_s"] == pytest.approx(0.355)
    info = doc["config"]["workload"]
    assert info["kind"] == "trace" and info["time_scale"] == 0.5 and info["requests_sharing_first_block"] == 5
    # more requests than the trace has: a synthesized trace with its statistics
    with LoopbackServer(Behaviour(chunks=2)) as server:
        result = runner.invoke(app, ["endpoint", "sim", "--endpoint", server.url, "--workload", "trace", "--trace",
                                     str(TRACES / "burstgpt_sample.csv"), "--trace-format", "burstgpt",
                                     "--requests", "10", "--time-scale", "0.05", "--concurrency", "4",
                                     "--out", str(tmp_path / "c"), "--json"])
    assert result.exit_code == 0, result.output
    m = json.loads(result.stdout)
    assert m["metrics"]["requests_ok"] == 10 and m["config"]["workload"]["synthesized"] is True


def test_shared_prefix_sim_is_seeded_and_sends_the_shared_system_prompts(tmp_path):
    suite = tmp_path / "suite.jsonl"
    suite.write_text("".join(json.dumps({"prompt": f"question number {i}"}) + "\n" for i in range(5)))
    schedules = []
    with LoopbackServer(Behaviour(chunks=2)) as server:
        for out in ("a", "b"):
            result = runner.invoke(app, ["endpoint", "sim", "--endpoint", server.url, "--workload", "shared-prefix",
                                         "--prefixes", "2", "--prefix-tokens", "12", "--suite", str(suite),
                                         "--limit", "5", "--rates", "200", "--requests", "8", "--seed", "5",
                                         "--max-new-tokens", "2", "--out", str(tmp_path / out), "--json"])
            assert result.exit_code == 0, result.output
            doc = json.loads(result.stdout)[0]
            schedules.append((tmp_path / out / doc["run_id"] / "schedule.jsonl").read_text())
        sent = server.requests[-8:]
    assert schedules[0] == schedules[1]  # same seed: same arrivals, same prompts
    systems = {r["messages"][0]["content"] for r in sent}
    assert len(systems) <= 2 and all(len(s.split()) == 12 for s in systems)
    assert doc["config"]["workload"]["kind"] == "shared-prefix" and sum(doc["config"]["workload"][
        "requests_per_prefix"]) == 8
