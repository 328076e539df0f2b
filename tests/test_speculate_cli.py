"""`infer-tune speculate` and `speculate distill` end to end on tiny models: bad input -> one line and exit 2,
a mismatch -> exit 1 with the row marked, the per-suite report; distillation; recommendation and claim
logic; the code-edit suite; pinned-length stops under drafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model_dir
from typer.testing import CliRunner

from infer_tune import models
from infer_tune.cli import app
from infer_tune.runners.generation import _PinLength
from infer_tune.scenarios.speculate import SuiteOutcome, recommend
from infer_tune.suites import SuiteSpec, load_suite
from infer_tune.tuners.speculate import distill, lean
from infer_tune.tuners.speculate.claim import claim_check, render_claim, summarize

runner = CliRunner()
FAST = ["--warmup", "0", "--min-iterations", "1", "--min-duration", "0", "--threads", "1", "--no-chat-template"]


@pytest.fixture(autouse=True)
def _wide_and_one_thread(monkeypatch, one_thread):
    monkeypatch.setenv("COLUMNS", "400")  # the report table, unwrapped (its title holds the temp paths)
    from infer_tune.cli import output

    # the console took its width when it was imported (a pytest-xdist worker has COLUMNS=80 by then)
    monkeypatch.setattr(output.out, "width", 400)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("target"), layers=3)


@pytest.fixture()
def suites(tmp_path) -> list[Path]:
    """Two small file suites: repetitive code (lookup pays) and plain questions."""
    code = tmp_path / "code.jsonl"
    code.write_text("".join(json.dumps({"prompt": f"def add{i}(a, b):\n    return a + b\ndef add{i}(a, b):",
                                        "reference": "return a + b"}) + "\n" for i in range(8)))
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": f"Question {i}: how are you today?", "reference": "fine"}) + "\n"
                            for i in range(8)))
    return [code, chat]


def _invoke(args: list[str]):
    return runner.invoke(app, ["speculate", *args], terminal_width=400)


@pytest.mark.parametrize("args, message", [
    (["--prompt-lookup", "-k", "0"], "--num-draft-tokens must be"),
    (["--prompt-lookup", "-k", "2,-3"], "--num-draft-tokens must be"),
    (["--prompt-lookup", "--batch-size", "4"], "one request at a time"),
    ([], "at least one draft source"),
    (["--self-draft-layers", "0"], "--self-draft-layers must be"),
    (["distill", "--minutes", "0"], "--minutes must be > 0"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    result = _invoke([*args, "--out", str(tmp_path / "runs")] if args[:1] != ["distill"] else args)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_deeper_self_draft_refused_before_anything_is_measured(target_dir, suites, tmp_path):
    result = _invoke(["--model", str(target_dir), "--self-draft-layers", "3", "--suite", str(suites[0]),
                      "--out", str(tmp_path / "runs"), *FAST])
    assert result.exit_code == 2 and "not fewer than the target's 3" in result.output
    assert not (tmp_path / "runs").exists()


def test_draft_with_another_vocabulary_and_no_universal_path_is_refused(target_dir, suites, tmp_path):
    from test_speculate import _model_dir, _other_tokenizer

    other = _model_dir(tmp_path / "other", "llama", layers=1, hidden=32, tokenizer=_other_tokenizer(300),
                       vocab_size=320)  # the target's vocabulary size: transformers would feed ids across
    result = _invoke(["--model", str(target_dir), "--draft", str(other), "--suite", str(suites[0]),
                      "--out", str(tmp_path / "runs"), *FAST])
    assert result.exit_code == 2 and "no universal path" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


def test_sweep_over_suites_json_plot_and_warning(target_dir, suites, tmp_path):
    big = build_tiny_model_dir(tmp_path / "big", layers=4, seed=3)
    out = tmp_path / "runs"
    result = _invoke(["--model", str(target_dir), "--prompt-lookup", "--draft", str(big), "-k", "2,4",
                      "--engine", "lean", "--suite", f"{suites[0]},{suites[1]}", "--limit", "2",
                      "--max-new-tokens", "12", "--out", str(out), "--json", *FAST])
    assert result.exit_code == 0, result.output
    assert "warning: draft" in result.stderr and "not fewer than the target" in result.stderr
    doc = json.loads(result.stdout)
    assert len(doc["results"]) == 8 and len(doc["baselines"]) == 2 and doc["mismatched"] == []
    assert {r["workload"]["suite"] for r in doc["results"]} == {str(s) for s in suites}
    for r in doc["results"]:
        m = r["metrics"]
        assert r["config"]["num_draft_tokens"] in (2, 4) and m["output_mismatches"] == 0
        for key in ("acceptance_rate", "mean_acceptance_length", "acceptance_by_position", "target_forward_passes",
                    "draft_time_share", "speedup_vs_baseline", "draft_target_param_ratio"):
            assert key in m, key
        assert (Path(r["location"]) / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    assert [r["suite"] for r in doc["recommendations"]] == [str(s) for s in suites]
    assert doc["claim"] is None  # no code suite by name: the claim is not judged
    human = _invoke(["--model", str(target_dir), "--prompt-lookup", "-k", "2", "--engine", "lean", "--suite",
                     str(suites[0]), "--limit", "2", "--max-new-tokens", "12", "--out", str(out), *FAST])
    assert human.exit_code == 0 and "recommendation (" in human.stdout and "target alone" in human.stdout


def test_a_changed_output_fails_the_run_with_exit_1(target_dir, suites, tmp_path, monkeypatch):
    """A loop that forgets to roll its KV cache back after a rejected draft must be caught, not reported."""
    monkeypatch.setattr(lean, "crop_to", lambda cache, length: None)
    result = _invoke(["--model", str(target_dir), "--self-draft-layers", "1", "-k", "3", "--engine", "lean",
                      "--suite", str(suites[1]), "--limit", "2", "--max-new-tokens", "12",
                      "--out", str(tmp_path / "runs"), *FAST])
    assert result.exit_code == 1, result.output
    assert "MISMATCH" in result.stdout and "differs from the target alone" in result.stderr


def test_distill_cli_saves_a_usable_draft_and_the_overlap_is_reported(target_dir, suites, tmp_path):
    save = tmp_path / "draft"
    result = _invoke(["distill", "--model", str(target_dir), "--self-draft-layers", "1", "--minutes", "0.03",
                      "--suite", str(suites[1]), "--holdout", "2", "--max-new-tokens", "6", "--save", str(save),
                      "--no-chat-template", "--json"])
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert manifest["steps"] >= 1 and manifest["samples"] >= 1 and manifest["layers"] == 1
    held_out = [p.id for p in load_suite(SuiteSpec(str(suites[1])))[:2]]
    assert not set(held_out) & set(manifest["train_prompt_ids"])
    assert models.load(str(save)).model.config.num_hidden_layers == 1
    again = _invoke(["distill", "--model", str(target_dir), "--minutes", "1", "--save", str(save)])
    assert again.exit_code == 2 and "already exists" in again.output
    result = _invoke(["--model", str(target_dir), "--draft", str(save), "-k", "2", "--suite", str(suites[1]),
                      "--limit", "4", "--max-new-tokens", "6", "--out", str(tmp_path / "runs"), "--json", *FAST])
    assert result.exit_code == 0, result.output
    m = json.loads(result.stdout)["results"][0]["metrics"]
    assert m["draft_distilled"] and m["draft_train_overlap"] == min(2, manifest["samples"])
    assert "distillation data" in result.stderr
    cut = _invoke(["--model", str(target_dir), "--draft", str(save), "-k", "2", "--engine", "lean", "--draft-vocab",
                   "20", "--suite", str(suites[1]), "--limit", "2", "--max-new-tokens", "6",
                   "--out", str(tmp_path / "runs"), "--json", *FAST])
    assert cut.exit_code == 0, cut.output
    m = json.loads(cut.stdout)["results"][0]["metrics"]
    assert m["output_mismatches"] == 0 and 0 < m["draft_vocab_kept"] <= 20 and 0 < m["draft_vocab_coverage"] <= 1
    assert m["draft_steps"] > 0
    no_counts = _invoke(["--model", str(target_dir), "--draft", str(target_dir), "--engine", "lean", "--draft-vocab",
                         "20", "--suite", str(suites[1]), "--out", str(tmp_path / "runs2"), *FAST])
    assert no_counts.exit_code == 2 and "needs a draft made by" in no_counts.output


def test_distillation_raises_acceptance_on_its_prompts(target_dir, suites):
    target = models.load(str(target_dir))
    settings = distill.DistillSettings(layers=1, minutes=5, max_new_tokens=12, lr=3e-3, max_steps=40,
                                       train_batch_size=4)
    prompts = [(p.id, p.text) for p in load_suite(SuiteSpec(str(suites[1])))]
    far = float("inf")
    samples = distill.generate_samples(target.model, target.tokenizer, prompts, settings, far)
    draft = distill.trainable_draft(target.model, 1)
    assert draft.model.layers[0] is not target.model.model.layers[0]  # a copy: training leaves the target alone
    before = _acceptance(target, draft, samples)
    stats = distill.train(draft, samples, settings, far)
    assert stats["steps"] == 40 and stats["loss_last"] < stats["loss_first"]
    assert _acceptance(target, draft, samples) > before


def _acceptance(target, draft, samples) -> float:
    """Share of the target's greedy tokens the draft predicts from the same prefix (what verify accepts)."""
    hits = total = 0
    with torch.inference_mode():
        for s in samples:
            logits = draft(input_ids=torch.tensor([s.ids])).logits[0, s.prompt_tokens - 1:-1]
            hits += int((logits.argmax(-1) == torch.tensor(s.ids[s.prompt_tokens:])).sum())
            total += len(s.ids) - s.prompt_tokens
    return hits / total


def _doc(label, suite, speedup, mismatches=0, ttft=1.0, k=4, kind="model"):
    return {"label": label, "config": {"draft": label, "num_draft_tokens": k, "engine": "lean"},
            "workload": {"suite": suite},
            "metrics": {"speedup_vs_baseline": speedup, "output_mismatches": mismatches, "draft_kind": kind,
                        "ttft_speedup_vs_baseline": ttft, "draft_target_param_ratio": 0.1,
                        "acceptance_rate": 0.5, "mean_acceptance_length": 2.0, "throughput_ratio_vs_baseline": 1.0}}


def test_recommendation_and_claim_logic():
    code = SuiteOutcome("code", {}, [_doc("a", "code", 2.6, mismatches=1), _doc("b", "code", 2.2, ttft=0.95),
                                     _doc("c", "code", 1.2)])
    chat = SuiteOutcome("chat", {}, [_doc("d", "chat", 1.02), _doc("e", "chat", 0.8)])
    rec = recommend(code)
    assert rec["best_label"] == "b"  # the faster row changed the output: never recommended
    assert recommend(chat)["best"] is None and recommend(chat)["verdict"] == "no speedup on this device"
    claim = claim_check({"code": code.docs, "chat": chat.docs})
    assert set(claim["suites"]) == {"code"} and claim["held"] and claim["held_with_draft_model"]
    assert claim["suites"]["code"]["any_source"]["ttft_ratio_vs_baseline"] == pytest.approx(1 / 0.95)
    slow_ttft = claim_check({"code": [_doc("b", "code", 2.2, ttft=0.5)]})
    assert not slow_ttft["held"] and slow_ttft["suites"]["code"]["any_source"]["speed_held"]
    lookup_only = claim_check({"code-edit": [_doc("l", "code-edit", 2.3, kind="prompt-lookup"),
                                             _doc("m", "code-edit", 0.7)]})
    assert lookup_only["held"] and not lookup_only["held_with_draft_model"]
    assert lookup_only["suites"]["code-edit"]["draft_model"]["best"] == "m"
    assert render_claim(lookup_only).startswith("\"2-4x on code, TTFT unchanged\" -> held (with a draft model: did not")
    # the sweep-level hook groups results by the suite they were measured on
    assert summarize(code.docs + chat.docs)["suites"].keys() == {"code"}


def test_code_edit_suite():
    prompts = load_suite(SuiteSpec("code-edit"))
    assert len(prompts) == 164 and [p.extra["kind"] for p in prompts[:3]] == ["rename", "annotate", "rewrite"]
    rename = prompts[0]
    assert "has_close_elements_v2" in rename.reference and "def has_close_elements(" not in rename.reference
    assert "```python" in rename.text and rename.id == "HumanEval/0/rename"


def test_pinned_stop_seen_only_after_a_rejected_draft_is_not_a_stop():
    """The draft (or the target past a rejected draft token) wanting EOS must not cut the output."""
    pin = _PinLength([1], prompt_len=2, batch=1)
    eos_scores = torch.tensor([[0.0, 5.0, 0.0, 0.0]])
    other_scores = torch.tensor([[0.0, 0.0, 5.0, 0.0]])
    pin(torch.tensor([[7, 7, 3]]), eos_scores.clone())  # a draft's call at step 1 after token 3
    pin(torch.tensor([[7, 7, 2, 9]]), eos_scores.clone())  # the target past a rejected token 9
    pin(torch.tensor([[7, 7, 3]]), other_scores.clone())  # the target's verify at the same prefix: no stop
    assert pin.natural_lengths(torch.tensor([[3, 2, 2]])) == [None]
    pin(torch.tensor([[7, 7, 3, 2]]), eos_scores.clone())  # a real stop at step 2
    assert pin.natural_lengths(torch.tensor([[3, 2, 2]])) == [2]
