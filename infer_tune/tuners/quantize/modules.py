"""Quantized layers that really hold low-bit weights and call real low-bit CPU kernels.

Every module keeps a *portable* form of its weights that `state_dict()` emits (plain int8 / uint8 /
float tensors, so the model saves with safetensors and `models.model_bytes` counts real storage) and
a *runtime* form the kernel wants (fbgemm's prepacked int8 matrix, torch's CPU int4 tile layout).

- `Int8DynamicLinear`: int8 weights per output channel; activations quantized per call at run time
  (`torch.ops.quantized.linear_dynamic`, fbgemm/x86).
- `Int8StaticLinear`: SmoothQuant-smoothed int8 weights and a fixed, calibrated activation scale
  (`torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32`: int8 x int8 GEMM, fp32 out).
- `Int4Linear`: group-wise 4-bit weights (two per byte) with bf16 scale and zero per group
  (`aten._weight_int4pack_mm_for_cpu`; it runs in bf16, measured faster than fp32 matmul here).
- `QuantEmbedding`: int8 rows or int4 groups; looked-up rows are dequantized (cheap: one row per token).

fbgemm keeps its own prepacked copy next to the quantized weight, so resident memory of int8 layers is
larger than `model_bytes` (which counts the stored weights, as docs/architecture.md defines it).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


def _cpu_has_vnni() -> bool:
    """VNNI int8 dot products do not saturate; without them fbgemm needs 7-bit activations (reduce_range)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            return "vnni" in handle.read(1 << 16)
    except OSError:
        return False


REDUCE_RANGE = not _cpu_has_vnni()
ACT_QMAX = 127 if REDUCE_RANGE else 255  # static activation range, uint8


# --------------------------------------------------------------------------- packing helpers
def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel. weight: [N, K] -> (qweight int8 [N, K], scale fp32 [N])."""
    scale = weight.detach().float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.clamp(torch.round(weight.detach().float() / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


def int8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale for the whole tensor (the uncalibrated reference)."""
    scale = weight.detach().float().abs().amax().clamp(min=1e-8) / 127.0
    q = torch.clamp(torch.round(weight.detach().float() / scale), -127, 127).to(torch.int8)
    return q, scale.expand(weight.shape[0]).clone()


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> uint8 [N, K/2], element 2i in the low nibble (the portable on-disk form)."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int32 [N, K] values 0..15."""
    low, high = (packed & 15).to(torch.int32), (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """w = (q - 8) * scale + zero, per group of `group_size` along K (the int4pack kernel's convention)."""
    q = unpack_nibbles(packed).float()
    n, k = q.shape
    q = q.view(n, k // group_size, group_size)
    return ((q - 8) * scale.float()[..., None] + zero.float()[..., None]).view(n, k)


def _prepack_int8(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    zero_points = torch.zeros(qweight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch.ao deprecation notices are not ours to print
        warnings.simplefilter("ignore")
        qtensor = torch._make_per_channel_quantized_tensor(qweight, scale.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(qtensor, bias)


class PortableModule(nn.Module):
    """Saves its `portable()` tensors (plain int8 / uint8 / float) instead of parameters; a tied head
    (rebuilt from the embedding's tensors) saves nothing."""

    tied = False

    def portable(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _with_bias(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if getattr(self, "bias_f", None) is not None:
            tensors["bias"] = self.bias_f
        return tensors

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        if not self.tied:
            for name, tensor in self.portable().items():
                destination[prefix + name] = tensor


# --------------------------------------------------------------------------- int8
class Int8DynamicLinear(PortableModule):
    """int8 per-channel weights, activations quantized per call (fbgemm dynamic linear)."""

    kind = "int8-dynamic"

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.weight_scale = scale.float().contiguous()
        self.bias_f = None if bias is None else bias.detach().float().contiguous()
        self._packed = _prepack_int8(qweight.contiguous(), self.weight_scale, self.bias_f)
        self.tied = False  # a tied head is rebuilt from the embedding's tensors and stores nothing

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] float32
        rows = x.float().reshape(-1, x.shape[-1])  # [tokens, K]
        if rows.shape[0] == 1:  # decode: one token, the kernel's per-tensor scale is per token
            return torch.ops.quantized.linear_dynamic(x.float(), self._packed, REDUCE_RANGE)
        # Prefill: fbgemm would pick one activation scale for all tokens, so an outlier token (attention
        # sinks) would flatten every other token's precision. Quantize per token (symmetric int8) and
        # run one int8 x int8 -> int32 GEMM instead, rescaled by token scale x channel scale.
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0  # [tokens, 1]
        xq = torch.clamp(torch.round(rows / scale), -127, 127).to(torch.int8)  # [tokens, K]
        y = torch._int_mm(xq, self._weight_t()).float() * scale * self.weight_scale  # [tokens, N]
        if self.bias_f is not None:
            y = y + self.bias_f
        return y.reshape(*x.shape[:-1], self.out_features)

    def _weight_t(self) -> torch.Tensor:
        """int8 weight as [K, N] for `torch._int_mm`, unpacked from fbgemm's copy once, on first prefill."""
        if getattr(self, "_wq_t", None) is None:
            self._wq_t = self.qweight().t().contiguous()
        return self._wq_t

    def qweight(self) -> torch.Tensor:
        return torch.ops.quantized.linear_unpack(self._packed)[0].int_repr()

    def portable(self) -> dict[str, torch.Tensor]:
        return self._with_bias({"qweight": self.qweight(), "weight_scale": self.weight_scale})


    @classmethod
    def from_portable(cls, t: dict[str, torch.Tensor], **_: object) -> Int8DynamicLinear:
        return cls(t["qweight"], t["weight_scale"], t.get("bias"))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Int8StaticLinear(Int8DynamicLinear):
    """SmoothQuant int8: x * smooth_inv is quantized with a fixed calibrated scale, int8 GEMM, fp32 out."""

    kind = "int8-static"

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 smooth_inv: torch.Tensor | None, act_scale: float, act_zero_point: int) -> None:
        super().__init__(qweight, scale, bias)
        self.smooth_inv = None if smooth_inv is None else smooth_inv.float().contiguous()
        self.act_scale, self.act_zero_point = float(act_scale), int(act_zero_point)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() if self.smooth_inv is None else x.float() * self.smooth_inv
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            x, self.act_scale, self.act_zero_point, self._packed)

    def portable(self) -> dict[str, torch.Tensor]:
        tensors = super().portable()
        tensors["act_qparams"] = torch.tensor([self.act_scale, float(self.act_zero_point)], dtype=torch.float64)
        if self.smooth_inv is not None:
            tensors["smooth_inv"] = self.smooth_inv
        return tensors

    @classmethod
    def from_portable(cls, t: dict[str, torch.Tensor], **_: object) -> Int8StaticLinear:
        act = t["act_qparams"].tolist()
        return cls(t["qweight"], t["weight_scale"], t.get("bias"), t.get("smooth_inv"), act[0], int(act[1]))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", static act scale={self.act_scale:.3g} zp={self.act_zero_point}"


# --------------------------------------------------------------------------- int4
class Int4Linear(PortableModule):
    """Group-wise 4-bit weights (uint8 holds two), bf16 scale + zero per group; bf16 int4 GEMM kernel."""

    kind = "int4"

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.group_size = group_size
        self.packed = packed.contiguous()  # portable layout: what is stored and saved
        self.scale = scale.to(torch.bfloat16).contiguous()  # [N, K/g]
        self.zero = zero.to(torch.bfloat16).contiguous()
        self.bias_f = None if bias is None else bias.detach().float()
        self._tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(self.packed), 1)
        self._scales_and_zeros = torch.stack([self.scale.t(), self.zero.t()], dim=-1).contiguous()  # [K/g, N, 2]
        self.tied = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K]
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), self._tiles,
                                                       self.group_size, self._scales_and_zeros)
        y = y.float().reshape(*shape[:-1], self.out_features)
        return y if self.bias_f is None else y + self.bias_f

    def portable(self) -> dict[str, torch.Tensor]:
        return self._with_bias({"qweight_int4": self.packed, "scale": self.scale, "zero": self.zero})


    @classmethod
    def from_portable(cls, t: dict[str, torch.Tensor], *, group_size: int, **_: object) -> Int4Linear:
        return cls(t["qweight_int4"], t["scale"], t["zero"], group_size, t.get("bias"))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group={self.group_size}"


# --------------------------------------------------------------------------- embeddings
class QuantEmbedding(PortableModule):
    """Embedding table stored as int8 rows (scale per row) or int4 groups; rows dequantized at lookup."""

    def __init__(self, tensors: dict[str, torch.Tensor], group_size: int | None = None, padding_idx=None) -> None:
        super().__init__()
        self.tensors = {k: v.contiguous() for k, v in tensors.items()}
        self.group_size = group_size
        self.padding_idx = padding_idx
        q = self.tensors.get("qweight", self.tensors.get("qweight_int4"))
        self.num_embeddings = q.shape[0]

    @property
    def bits(self) -> int:
        return 8 if "qweight" in self.tensors else 4

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [B, T] -> [B, T, H]
        flat = ids.reshape(-1)
        t = self.tensors
        if self.bits == 8:
            rows = t["qweight"][flat].float() * t["weight_scale"][flat, None]
        else:
            rows = dequantize_int4(t["qweight_int4"][flat], t["scale"][flat], t["zero"][flat], self.group_size)
        return rows.view(*ids.shape, -1)

    def portable(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        for name, tensor in self.tensors.items():
            destination[prefix + name] = tensor


LINEAR_KINDS: dict[str, type] = {cls.kind: cls for cls in (Int8DynamicLinear, Int8StaticLinear, Int4Linear)}
