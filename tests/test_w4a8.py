"""The w4a8 kernel (infer_tune/native/matmul.cpp) and the int4 layers with int8 activations (Int4A8Linear):
the kernel computes what its numerics say, the layers hold 4-bit weights and run it, and the method
survives save / reload and a compiled lean step."""

from __future__ import annotations

import copy

import pytest
import torch

from infer_tune import native
from infer_tune.tuners.quantize import QuantizeConfig
from infer_tune.tuners.quantize.apply import int4_quantize
from infer_tune.tuners.quantize.modules import (
    Int4A8Linear,
    Int8A8Linear,
    dequantize_int4,
    fake_quantize_a8,
    pack_w4a8,
)

needs_kernel = pytest.mark.usefixtures("native_kernels")  # built in the fixture: a failed build fails


def layer(n: int, k: int, group: int = 32, seed: int = 0) -> Int4A8Linear:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    t = int4_quantize(weight, group, hqq=False)
    return Int4A8Linear(t["qweight_int4"], t["scale"], t["zero"], group)


def reference(module: Int4A8Linear, x: torch.Tensor) -> torch.Tensor:
    """x_hat . w_hat in float64: the numerics the kernel promises."""
    w = dequantize_int4(module.packed, module.scale, module.zero, module.group_size).double()
    return fake_quantize_a8(x).double() @ w.t()


def test_fake_quantize_a8_is_per_block_of_32():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-1, 1, 32)
    x[0, 32:] = 1e-3 * torch.linspace(-1, 1, 32)  # a block of tiny values keeps its own scale
    q = fake_quantize_a8(x)
    assert torch.allclose(q[0, :32], x[0, :32], atol=1 / 254 + 1e-7)
    assert torch.allclose(q[0, 32:], x[0, 32:], atol=1e-3 / 254 + 1e-10)
    assert torch.equal(q[1], x[1])  # an all-zero row stays zero (no division by a zero scale)
    levels = (q[0, :32] / (1 / 127)).round()
    assert levels.abs().max() == 127 and len(set(levels.tolist())) > 20


@needs_kernel
@pytest.mark.parametrize("n,k,group", [(64, 64, 32), (40, 96, 32), (12, 128, 64), (24, 256, 128)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_kernel_computes_its_numerics(n, k, group, rows):
    module = layer(n, k, group)
    module.set_kernels("w4a8", "w4a8")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0  # a zero block
    got = module(x)
    expected = reference(module, x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5), (got.double() - expected).abs().max()
    module.set_kernels("dequant", "dequant")  # the other kernel of the same numerics
    assert torch.allclose(module(x).double(), expected, rtol=1e-5, atol=1e-5)
    # rows are independent: a row alone gives what it gives in the batch, bit for bit
    module.set_kernels("w4a8", "w4a8")
    assert torch.equal(module(x[1:2]), got[1:2])


@needs_kernel
@pytest.mark.parametrize("tiles", [1, 3, 8, 9, 37])  # per thread: below, at and past the streams, with leftovers
@pytest.mark.parametrize("threads", [1, 2])
def test_one_row_loop_gives_the_multi_row_loops_values(tiles, threads):
    # one row (decode) runs a loop of its own, a thread's tiles cut into parts streamed side by side; its values
    # are the multi-row loop's (3 rows), bit for bit, whatever the tiles per thread
    module = layer(8 * tiles, 256, 64, seed=tiles)
    module.set_kernels("w4a8", "w4a8")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(tiles))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = module(x)
        rows = [module(x[i:i + 1]) for i in range(3)]
    finally:
        torch.set_num_threads(before)
    assert torch.allclose(batch.double(), reference(module, x), rtol=1e-5, atol=1e-5)
    for i, row in enumerate(rows):
        assert torch.equal(row, batch[i:i + 1]), (i, (row - batch[i:i + 1]).abs().max())


@needs_kernel
def test_prefill_loop_runs_where_the_cpu_has_avx512_vnni():
    from infer_tune import native
    from infer_tune.env import cpu_flags

    # compiled for the host's own ISA (INFER_TUNE_NATIVE_MARCH=haswell builds the AVX2 paths on any host)
    has = {"avx512f", "avx512bw", "avx512_vnni"} <= set(cpu_flags()) and native.march() == "native"
    # from 16 rows the 512-bit prefill loop (tile2_zmm) runs, on hosts with AVX-512 VNNI only
    assert torch.ops.infer_tune_native.w4a8_prefill_rows() == (16 if has else 0)


@needs_kernel
@pytest.mark.parametrize("n,k,group", [(40, 96, 32), (64, 576, 32), (24, 256, 128)])  # 40: an odd count of tiles
@pytest.mark.parametrize("rows", [1, 7, 33, 500])
def test_prefill_rows_compute_their_numerics_and_do_not_depend_on_the_batch(n, k, group, rows):
    module = layer(n, k, group, seed=rows)
    module.set_kernels("w4a8", "w4a8")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0  # a zero block
    got = module(x)
    expected = reference(module, x)
    assert got.shape == (rows, n)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5), (got.double() - expected).abs().max()
    # a row alone (the one-row loop) gives what it gives among 7, 33 or 500 (the prefill loop from 16 rows,
    # in chunks of 64), bit for bit; so does a batch of 17 cut from the end (another chunk alignment)
    for i in (range(rows) if rows <= 33 else (0, 63, 64, 255, 499)):
        assert torch.equal(module(x[i:i + 1]), got[i:i + 1]), i
    if rows > 17:
        assert torch.equal(module(x[-17:]), got[-17:])


@needs_kernel
@pytest.mark.parametrize("n,k", [(64, 64), (20, 96), (8, 576)])
@pytest.mark.parametrize("rows", [1, 5, 12])
def test_int8_head_kernel_computes_its_numerics(n, k, rows):
    from infer_tune.tuners.quantize.modules import int8_per_channel

    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.05
    q, scale = int8_per_channel(weight)
    module = Int8A8Linear(q, scale)
    assert module.decode_kernel == "w8a8" and module.qweight().dtype == torch.int8
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = fake_quantize_a8(x).double() @ (q.double() * scale.double()[:, None]).t()
    got = module(x)
    assert got.shape == (rows, n) and torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)
    # a row alone gives what it gives among 5 or 12, bit for bit (on AVX-512 a row alone and 5 rows take the
    # 512-bit loop, 12 rows the 256-bit one: the two must agree exactly)
    assert torch.equal(module(x[-1:]), got[-1:])
    module.set_kernels("dequant", "dequant")
    assert torch.allclose(module(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_kernel_differs_from_bf16_activations_and_padding_is_cut():
    module = layer(20, 64)  # 20 outputs: packed to 24, the kernel's tiles of 8
    assert module._w4a8.shape == (3, 2, 32 + 4 * 32) and module._w4a8.dtype == torch.uint8
    x = torch.randn(1, 64)
    a8 = module(x)
    weight = dequantize_int4(module.packed, module.scale, module.zero, 32)
    bf16 = torch.nn.functional.linear(x.bfloat16().float(), weight)  # Int4Linear's numerics
    assert a8.shape == (1, 20) and not torch.equal(a8, bf16)  # another numerics, not a relabel
    assert torch.allclose(a8, bf16, rtol=0.05, atol=0.05)


def test_pack_layout_puts_four_weights_of_one_output_in_each_lane():
    q = torch.arange(32).remainder(16).repeat(8, 1)  # one 32-block per row: 0..15, 0..15
    from infer_tune.tuners.quantize.modules import pack_nibbles

    scale = torch.arange(1, 9, dtype=torch.float32)[:, None]  # one group per output: scale t + 1, zero 0
    tiles = pack_w4a8(pack_nibbles(q), scale, torch.zeros(8, 1), 32)
    assert tiles.dtype == torch.uint8 and tiles.shape == (1, 1, 32 + 128)
    slots = tiles[0, 0, :32].view(torch.bfloat16).tolist()  # even outputs' scales, zeros, odd outputs' ...
    assert slots[0:4] == [1.0, 3.0, 5.0, 7.0] and slots[8:12] == [2.0, 4.0, 6.0, 8.0]
    assert slots[4:8] == slots[12:16] == [0.0] * 4
    q = (torch.arange(32) + 32 * torch.arange(8)[:, None]).remainder(16)  # output t's weight j: (32 t + j) % 16
    tiles = pack_w4a8(pack_nibbles(q), scale, torch.zeros(8, 1), 32)
    block = tiles[0, 0, 32:].view(4, 8, 4)  # [i, lane, r]: weight 4i + r (low nibble), 16 + 4i + r (high)
    for lane, t in enumerate([0, 2, 4, 6, 1, 3, 5, 7]):
        for i in range(4):
            assert block[i, lane].tolist() == [int(q[t, 4 * i + r]) | int(q[t, 16 + 4 * i + r]) << 4 for r in range(4)]


def test_config_label_and_validation():
    from infer_tune.errors import ConfigError

    config = QuantizeConfig(method="int4-rtn", activations="int8")
    assert config.label() == "int4-rtn-auto-g32-a8" and "activations" in config.applicable_fields()
    with pytest.raises(ConfigError, match="activations"):
        QuantizeConfig(method="int8-dynamic", activations="int8")
    with pytest.raises(ConfigError, match="activations"):
        QuantizeConfig(method="int4-rtn", activations="fp8")
    with pytest.raises(ConfigError, match="decode_kernel"):
        QuantizeConfig(method="int4-rtn", activations="int8", decode_kernel="int4pack")
    assert QuantizeConfig(method="int4-rtn", activations="int8", decode_kernel="w4a8").decode_kernel == "w4a8"


def test_a8_model_saves_reloads_and_holds_4bit_weights(tiny_loaded, tmp_path):
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory
    from infer_tune.tuners.quantize.serialize import load_quantized, save_quantized

    config = QuantizeConfig(method="int4-rtn", activations="int8")
    model = copy.deepcopy(tiny_loaded.model)
    summary = quantize_in_memory(model, config, "torch")
    assert set(summary["layers"].values()) == {"int4-a8"} and summary["head"]["kind"] == "int8-a8"
    save_quantized(model, tiny_loaded.tokenizer, tmp_path / "q",
                   {"method": config.method, "backend": "torch", "summary": summary,
                    "config": {k: v for k, v in config.to_dict().items() if k != "kind"}})
    reloaded = load_quantized(tmp_path / "q", choose_kernels=False)
    layers = [m for m in reloaded.modules() if isinstance(m, Int4A8Linear)]
    assert layers and all(m.packed.dtype == torch.uint8 and m.packed.shape[1] * 2 == m.in_features for m in layers)
    assert isinstance(reloaded.get_output_embeddings(), Int8A8Linear)
    ids = tiny_loaded.tokenizer(["the quick brown fox"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


@needs_kernel
def test_w4a8_merges_and_runs_in_a_captured_lean_step(tiny_loaded):
    """The compiled lean step holds the kernel as an extern call, merges q/k/v and gate/up like int4pack's,
    and decodes the same greedy tokens as the eager step on the same weights."""
    from infer_tune.runners.generation import eos_ids
    from infer_tune.tuners.lean.loop import LeanDecoder
    from infer_tune.tuners.quantize.pipeline import quantize_in_memory

    model = copy.deepcopy(tiny_loaded.model)
    quantize_in_memory(model, QuantizeConfig(method="int4-rtn", activations="int8"), "torch")
    for m in model.modules():
        if isinstance(m, Int4A8Linear):
            m.set_kernels("w4a8", "w4a8")
    ids = tiny_loaded.tokenizer(["Question 3: what is 3 plus 3?"], return_tensors="pt")["input_ids"]
    eos = eos_ids(model, tiny_loaded.tokenizer)
    _, _, eager, _ = LeanDecoder(model, compile=False).generate(ids, 12, eos)
    compiled = LeanDecoder(model, compile=True)
    _, _, tokens, _ = compiled.generate(ids, 12, eos)
    assert compiled.facts["lean_step"] == "captured", compiled.facts
    assert compiled.facts["lean_fused_int4_calls"] >= 3 * 2, compiled.facts  # (q, k, v) and (gate, up) per layer
    assert tokens == eager


def test_unavailable_kernel_is_excluded_with_its_reason(monkeypatch):
    from infer_tune.tuners.quantize import kernels

    monkeypatch.setattr(native, "available", lambda: (False, "no C++ compiler (c++) on PATH"))
    assert kernels.excluded("int4-a8", "decode") == {"w4a8": "no C++ compiler (c++) on PATH"}
    fallback = layer(8, 32)
    assert fallback.decode_kernel == "dequant" and fallback(torch.randn(1, 32)).shape == (1, 8)
