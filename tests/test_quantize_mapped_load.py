"""A saved int4 a8 model loads without its float weights and without a second copy of its quantized ones: the
layers hold the memory-mapped bytes of their kernels' layouts (w4a8, w8a8) as the file has them, the loaded
model decodes the tokens the model quantized in process decodes, and a load's private memory stays far below
the weights' bytes (format 1 packed every layer again on load: the mapped file plus a copy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infer_tune.tuners.quantize import QuantizeConfig
from infer_tune.tuners.quantize.modules import (
    Int4A8Linear,
    Int8A8Linear,
    pack_nibbles,
    pack_w4a8,
    pack_w8a8,
    unpack_w4a8,
    unpack_w8a8,
)
from infer_tune.tuners.quantize.pipeline import quantize_in_memory
from infer_tune.tuners.quantize.serialize import load_quantized, save_quantized

CONFIG = QuantizeConfig(method="int4-rtn", activations="int8")


@pytest.mark.parametrize("group", [32, 128])
def test_the_kernel_layouts_unpack_to_what_was_packed(group):
    gen = torch.Generator().manual_seed(group)
    n, k = 13, 256  # 13 rows: padded to 16 in the layouts
    packed = pack_nibbles(torch.randint(0, 16, (n, k), generator=gen))
    scale = torch.rand(n, k // group, generator=gen).to(torch.bfloat16)
    zero = torch.randn(n, k // group, generator=gen).to(torch.bfloat16)
    back = unpack_w4a8(pack_w4a8(packed, scale, zero, group), n, group)
    assert all(torch.equal(a, b) for a, b in zip(back, (packed, scale, zero)))
    weights = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
    assert torch.equal(unpack_w8a8(pack_w8a8(weights), n), weights)


def mapped(path: Path):
    """tensor -> whether its bytes lie in a memory mapping of `path` in this process (/proc/self/maps)."""
    regions = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(" " + str(path.resolve())):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            regions.append((start, end))

    def inside(t: torch.Tensor) -> bool:
        first, last = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        return any(start <= first and last <= end for start, end in regions)
    return inside


def save(model, tokenizer, target: Path) -> Path:
    summary = quantize_in_memory(model, CONFIG, "torch")
    config = {k: v for k, v in CONFIG.to_dict().items() if k != "kind"}
    return save_quantized(model, tokenizer, target, {"method": CONFIG.method, "backend": "torch",
                                                     "config": config, "summary": summary})


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen3", True)])
def test_a_saved_int4_a8_model_loads_mapped_and_decodes_the_same(tmp_path, arch, tied):
    from infer_tune.tuners.lean.loop import LeanDecoder
    from tests.conftest import build_tiny_tokenizer
    from tests.test_native_step import tiny_family

    tokenizer = build_tiny_tokenizer()
    model = tiny_family(tokenizer, arch, tie_word_embeddings=tied)
    save(model, tokenizer, tmp_path / "q")
    loaded = load_quantized(tmp_path / "q", choose_kernels=False)

    layers = [m for m in loaded.modules() if isinstance(m, Int4A8Linear)]
    assert len(layers) == 7 * model.config.num_hidden_layers
    # one copy: the kernel's layout alone, every layer's bytes inside the mapping of the file (no packed copy)
    inside = mapped(tmp_path / "q" / "model.safetensors")
    assert all(m._int4 is None and m._w4a8.dtype == torch.uint8 and inside(m._w4a8) for m in layers)
    head = loaded.get_output_embeddings()
    assert isinstance(head, Int8A8Linear) and head._qweight is None and head.tied == tied
    if not tied:  # an untied head is saved in its kernel's layout and mapped like the layers
        assert inside(head._w8a8[0])
    else:  # a tied head is packed from the embedding's rows, which stay mapped
        assert not inside(head._w8a8[0]) and inside(loaded.get_input_embeddings().qtensors["qweight"])
    # no float copy of any matrix: float tensors are vectors (norms), or the embedding's zero-stride placeholder
    matrices = [name for name, t in (*loaded.named_parameters(), *loaded.named_buffers())
                if t.is_floating_point() and t.dim() > 1 and any(t.stride())]
    assert matrices == []

    ids = torch.randint(3, len(tokenizer), (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    tokens = []
    for m in (model, loaded):
        decoder = LeanDecoder(m, compile=False, native_step=True)
        _, _, out, _ = decoder.generate(ids, 24, [])
        assert decoder.facts["lean_step"] == "native" and len(out) == 24
        tokens.append(out)
    assert tokens[0] == tokens[1]


PROBE = """
import json, sys, torch
import transformers.models.llama.modeling_llama  # imports before the first reading
torch.ops.load_library(sys.argv[2])  # the kernels this test's process loaded: none built again
from infer_tune import native
from infer_tune.tuners.quantize.serialize import load_quantized
native.w4a8()

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmHWM", "RssAnon", "RssFile")}

before = status()
model = load_quantized(sys.argv[1], choose_kernels=False)
with torch.no_grad():
    model(torch.tensor([[1, 5, 9, 13]]))  # every layer's weights read once
after = status()
print(json.dumps({k: after[k] - before[k] for k in before}))
"""


@pytest.mark.usefixtures("native_kernels")
def test_a_load_holds_the_weights_once_as_the_files_pages(tmp_path):
    """In a process of its own: the load and one forward pass add about the int4 weights' bytes as file pages,
    little private memory (under a quarter of them: format 1's packed copy was all of them), and a peak under
    half the float model's bytes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.conftest import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, pad_token_id=0, bos_token_id=2, eos_token_id=1)).eval()
    float_bytes = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    save(model, tokenizer, tmp_path / "q")
    int4_bytes = sum(m._w4a8.numel() for m in model.modules() if isinstance(m, Int4A8Linear))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    library = next(line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                   if line.endswith("infer_tune_native.so"))
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "q"), library], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    grew = json.loads(out.stdout.strip().splitlines()[-1])
    assert grew["RssFile"] >= 0.9 * int4_bytes, (grew, int4_bytes)
    assert grew["RssAnon"] < 0.25 * int4_bytes, (grew, int4_bytes)
    assert grew["VmHWM"] < 0.5 * float_bytes, (grew, float_bytes)
