"""`infer-tune quantize` on a tiny random Llama: real low-bit storage, bytes, save/reload, calibration, bad input."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from infer_tune import models
from infer_tune.cli import app
from infer_tune.tuners.quantize import QuantizeConfig
from infer_tune.tuners.quantize.apply import quantize_linear, targeted_linears
from infer_tune.tuners.quantize.calibrate import calibration_batches, collect_activation_stats
from infer_tune.tuners.quantize.modules import Int4Linear, Int8DynamicLinear, Int8StaticLinear
from infer_tune.tuners.quantize.pipeline import bytes_16bit, quantize_in_memory
from infer_tune.tuners.quantize.serialize import load_quantized, save_quantized

runner = CliRunner()


def quantized_copy(loaded, method: str, prompts_file, **kw):
    model = copy.deepcopy(loaded.model)
    config = QuantizeConfig(method=method, calib_suite=str(prompts_file), calib_samples=4, **kw)
    calib = calibration_batches(loaded.tokenizer, str(prompts_file), 4) if config.calibrated else None
    summary = quantize_in_memory(model, config, "torch", calib)
    return model, config, summary


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach(), out.detach()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


@pytest.mark.parametrize("method,cls", [("int8-dynamic", Int8DynamicLinear), ("int8-static", Int8StaticLinear)])
def test_int8_targets_hold_int8_and_halve_bytes(tiny_loaded, prompts_file, method, cls):
    names = list(targeted_linears(tiny_loaded.model))
    model, _, summary = quantized_copy(tiny_loaded, method, prompts_file)
    assert set(summary["layers"]) == set(names)
    fallback = set(summary.get("dynamic_fallback_layers", []))  # int8-static: layers whose static error is too high
    if len(fallback) == len(names):  # every layer over the error budget: only where activations get 7 bits
        from infer_tune.tuners.quantize.kernels import reduce_range

        assert reduce_range(), summary.get("activation_scales")
    for name in names:
        layer = model.get_submodule(name)
        assert isinstance(layer, Int8DynamicLinear if name in fallback else cls)
        assert layer.state_dict()["qweight"].dtype == torch.int8
    assert models.model_bytes(model) <= 0.55 * bytes_16bit(tiny_loaded.model)  # >= 45% below 16-bit


@pytest.mark.parametrize("method,head_bits,share", [("int4-weight", 4, 0.30), ("int4-rtn", 4, 0.30),
                                                     ("int4-rtn", 8, 0.40)])
def test_int4_targets_hold_packed_4bit(tiny_loaded, prompts_file, method, head_bits, share):
    model, _, summary = quantized_copy(tiny_loaded, method, prompts_file, group_size=64, head_bits=head_bits)
    for name, original in targeted_linears(tiny_loaded.model).items():
        layer = model.get_submodule(name)
        assert isinstance(layer, Int4Linear)
        packed = layer.state_dict()["qweight_int4"]
        assert packed.dtype == torch.uint8 and packed.shape == (original.out_features, original.in_features // 2)
    assert summary["embedding"]["bits"] == head_bits
    assert isinstance(model.get_output_embeddings(), Int4Linear if head_bits == 4 else Int8DynamicLinear)
    # the tiny model's embedding table is 28% of its weights: an int8 table keeps it above 30%
    assert models.model_bytes(model) <= share * bytes_16bit(tiny_loaded.model)


@pytest.mark.parametrize("method,kw", [("bf16", {}), ("int8-dynamic", {}), ("int8-static", {}), ("int4-weight", {}),
                                       ("int4-rtn", {"compute_dtype": "bfloat16", "head_bits": 4})])
def test_save_reload_gives_identical_greedy_outputs(tiny_loaded, prompts_file, tmp_path, method, kw):
    model, config, summary = quantized_copy(tiny_loaded, method, prompts_file, **kw)
    save_quantized(model, tiny_loaded.tokenizer, tmp_path / "q",
                   {"method": method, "backend": "torch", "summary": summary,
                    "config": {k: v for k, v in config.to_dict().items() if k != "kind"}})
    reloaded = load_quantized(tmp_path / "q", choose_kernels=False)  # the same kernels as the in-memory model
    ids = tiny_loaded.tokenizer(["Question 3: what is 3 plus 3?"], return_tensors="pt")["input_ids"]
    kwargs = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": tiny_loaded.tokenizer.pad_token_id}
    assert torch.equal(model.generate(ids, **kwargs), reloaded.generate(ids, **kwargs))
    assert models.model_bytes(reloaded) == models.model_bytes(model)
    assert models.load(str(tmp_path / "q")).model.__class__ is reloaded.__class__  # the `bench --model DIR` path
    if kw.get("compute_dtype") == "bfloat16":  # activations in bf16 between the int4 layers, after reload too
        for m in (model, reloaded):
            assert m.model(input_ids=ids).last_hidden_state.dtype == torch.bfloat16
            assert m.model.norm.weight.dtype == torch.bfloat16


def test_calibrated_static_beats_uncalibrated_per_tensor(tiny_loaded, prompts_file):
    """Inject activation outlier channels (as real LLMs have) and compare output SQNR on the same layers."""
    model = copy.deepcopy(tiny_loaded.model)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[:3] *= 40.0
    calib = calibration_batches(tiny_loaded.tokenizer, str(prompts_file), 4)
    ids = torch.cat([c[:, :8] for c in calib if c.shape[1] >= 8])[:2]
    reference = model(input_ids=ids).logits
    targets = targeted_linears(model)
    stats = collect_activation_stats(model, targets, calib)

    def swapped(per_tensor: bool, smooth: bool) -> torch.Tensor:
        candidate = copy.deepcopy(model)
        config = QuantizeConfig(method="int8-static", alpha=0.5)
        for name in targets:
            module, _ = quantize_linear(candidate.get_submodule(name), config, stats[name], per_tensor=per_tensor,
                                        smooth=smooth)
            parent, _, child = name.rpartition(".")
            setattr(candidate.get_submodule(parent), child, module)
        return candidate(input_ids=ids).logits

    calibrated = sqnr_db(reference, swapped(per_tensor=False, smooth=True))
    naive = sqnr_db(reference, swapped(per_tensor=True, smooth=False))
    print(f"SQNR calibrated SmoothQuant {calibrated:.1f} dB, naive per-tensor {naive:.1f} dB")
    assert calibrated > naive + 1.0, (calibrated, naive)


# --------------------------------------------------------------------------- bad input through the CLI
def _invoke(tiny_model_dir, prompts_file, tmp_path, *extra):
    args = ["quantize", "--model", str(tiny_model_dir), "--suite", str(prompts_file), "--limit", "2",
            "--max-new-tokens", "2", "--min-iterations", "1", "--min-duration", "0", "--out", str(tmp_path / "runs"),
            "--calib-suite", str(prompts_file), *extra]
    return runner.invoke(app, args)


def _assert_clean_failure(result, tmp_path, save_dir=None, fragment=""):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "error" in lines[0] and fragment in result.output, result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()
    if save_dir is not None:
        assert not save_dir.exists()


@pytest.mark.parametrize("extra,fragment", [
    (["--method", "int9"], "method must be one of"),
    (["--method", "int8-static", "--calib-samples", "0"], "calib_samples"),
    (["--method", "int4-weight", "--group-size", "128"], "does not divide"),
    (["--sweep", "int8-dynamic,int5"], "unknown method"),
])
def test_bad_options_exit_2_and_write_nothing(tiny_model_dir, prompts_file, tmp_path, extra, fragment):
    save = tmp_path / "saved"
    _assert_clean_failure(_invoke(tiny_model_dir, prompts_file, tmp_path, "--save", str(save), *extra), tmp_path,
                          save, fragment)


def test_empty_calibration_suite(tiny_model_dir, prompts_file, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = _invoke(tiny_model_dir, prompts_file, tmp_path, "--method", "int8-static", "--calib-suite", str(empty))
    _assert_clean_failure(result, tmp_path, fragment="calibration")


def test_existing_save_dir_is_refused_unless_overwrite(tiny_model_dir, prompts_file, tmp_path):
    save = tmp_path / "saved"
    save.mkdir()
    (save / "keep.txt").write_text("mine")
    result = _invoke(tiny_model_dir, prompts_file, tmp_path, "--save", str(save))
    assert result.exit_code == 2 and "already exists" in result.output
    assert (save / "keep.txt").read_text() == "mine" and not (tmp_path / "runs").exists()


def test_model_without_linear_layers(tiny_model_dir, prompts_file, tmp_path, monkeypatch, tiny_loaded):
    class NoLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)

    tiny_loaded.model = NoLinear()
    monkeypatch.setattr(models, "load", lambda *a, **k: tiny_loaded)
    result = _invoke(tiny_model_dir, prompts_file, tmp_path, "--save", str(tmp_path / "saved"))
    _assert_clean_failure(result, tmp_path, tmp_path / "saved", "no nn.Linear layers")


def test_sweep_writes_one_result_per_method_and_claim_check(tiny_model_dir, prompts_file, tmp_path):
    save = tmp_path / "saved"
    result = _invoke(tiny_model_dir, prompts_file, tmp_path, "--sweep", "int8-dynamic,int4-rtn", "--save", str(save),
                     "--json", "--no-ppl")
    assert result.exit_code == 0, result.output
    docs = json.loads(result.stdout)
    assert [d["config"]["method"] for d in docs] == ["int8-dynamic", "int4-rtn"]
    assert all(d["config"]["backend"] == "torch" and "model_bytes" in d["metrics"] for d in docs)
    assert all(d["metrics"]["speedup_vs_baseline"] is not None for d in docs)
    saved = json.loads((tmp_path / "runs" / docs[0]["run_id"] / "result.json").read_text())
    assert saved["metrics"]["claim_check"]["size_held"] is True
    assert (save / "int4-rtn" / "quantization.json").is_file()


def test_claim_check_judges_speed_against_16bit_when_bf16_ran():
    from infer_tune.tuners.quantize.pipeline import claim_check

    def doc(method, tpot, **metrics):
        return {"run_id": method, "config": {"method": method},
                "metrics": {"tpot_ms": {"p50": tpot}, "speedup_vs_baseline": 40.0 / tpot, **metrics}}

    int8 = doc("int8-dynamic", 12.0, bytes_ratio_vs_16bit=0.5, ppl_delta_pct=0.5, bleu_drift=0.1)
    alone = claim_check([int8])
    assert alone["speed_held"] and alone["speedup_judged"] == 40.0 / 12.0 and alone["held"]
    with_bf16 = claim_check([doc("bf16", 22.0), int8])
    assert with_bf16["speedup_vs_16bit"] == 22.0 / 12.0
    assert not with_bf16["speed_held"] and not with_bf16["held"]  # 1.83x vs 16-bit is under 2x


def test_torchao_int4_packs_for_torchs_own_kernel_where_the_config_has_packing_formats():
    """torchao's second int4 config defaults to a packing whose matmul needs a separate kernel package (it was
    missing on an H200 with a plain `pip install torchao`); the tinygemm packing runs on torch's own kernel."""
    from infer_tune.tuners.quantize.library import int4_tinygemm_options

    class Versioned:
        def __init__(self, group_size=128, int4_packing_format="plain", version=2):
            pass

    class Older:
        def __init__(self, group_size=128, use_hqq=False):
            pass

    assert int4_tinygemm_options(Versioned) == {"int4_packing_format": "tile_packed_to_4d"}
    assert int4_tinygemm_options(Older) == {}


def test_a_saved_model_reuses_the_kernel_screen_this_host_kept(tiny_loaded, prompts_file, tmp_path, monkeypatch):
    """Loading a saved model takes the screen `quantize` kept for its shapes on this host (no second screen, whose
    fp32 references of every shape were the load's memory peak); without one it measures and keeps it; one in a
    folder another account could write is not read."""
    import os
    import shutil

    from infer_tune import paths
    from infer_tune.tuners.quantize import kernel_choice

    screens = paths.home() / "kernels" / "screens"
    shutil.rmtree(screens, ignore_errors=True)
    calls = []
    real = kernel_choice.screen_kernels
    monkeypatch.setattr(kernel_choice, "screen_kernels",
                        lambda *a, **kw: calls.append(a[2]) or real(*a, max_rounds=2, min_rounds=2, **kw))
    model, config, summary = quantized_copy(tiny_loaded, "int8-dynamic", prompts_file)  # its screen is kept
    model.infer_tune_kernels = kernel_choice.choose_for_model(model, "int8-dynamic", keep="store")
    assert calls and sorted(screens.glob("*.json"))
    save_quantized(model, tiny_loaded.tokenizer, tmp_path / "q",
                   {"method": "int8-dynamic", "backend": "torch", "summary": summary,
                    "config": {k: v for k, v in config.to_dict().items() if k != "kind"}})
    calls.clear()
    reloaded = load_quantized(tmp_path / "q")
    assert calls == [] and reloaded.infer_tune_kernels["screens_reused"]
    for kind, choice in reloaded.infer_tune_kernels["by_kind"].items():
        assert choice["decode"]["chosen"] == model.infer_tune_kernels["by_kind"][kind]["decode"]["chosen"]
    shutil.rmtree(screens)
    assert "screens_reused" not in load_quantized(tmp_path / "q").infer_tune_kernels and calls  # measured, kept
    calls.clear()
    os.chmod(screens, 0o777)  # another account could have written there: measured again
    try:
        assert "screens_reused" not in load_quantized(tmp_path / "q").infer_tune_kernels and calls
    finally:
        os.chmod(screens, 0o700)
