"""Quantized layers that really hold low-bit weights and call real low-bit CPU kernels.

Every module keeps a *portable* form of its weights that `state_dict()` emits (plain int8 / uint8 /
float tensors, so the model saves with safetensors and `models.model_bytes` counts real storage) and
a *runtime* form the kernel wants (fbgemm's prepacked int8 matrix, torch's CPU int4 tile layout).

- `Int8DynamicLinear`: int8 weights per output channel; activations quantized per call at run time
  (`torch.ops.quantized.linear_dynamic`, fbgemm/x86, registered as the custom op
  `infer_tune::fbgemm_linear_dynamic` so a compiled graph can hold it).
- `Int8StaticLinear`: SmoothQuant-smoothed int8 weights and a fixed, calibrated activation scale
  (`torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32`: int8 x int8 GEMM, fp32 out).
- `Int4Linear`: group-wise 4-bit weights (two per byte) with bf16 scale and zero per group
  (`aten._weight_int4pack_mm_for_cpu`; it runs in bf16, measured faster than fp32 matmul here).

Which kernel runs is chosen per regime (decode: one row, prefill: many) by measuring on the host
(`kernel_choice.choose_for_model`); every module can run each of its family's candidates (`set_kernels`).
Embeddings are quantized by wrapping the original module (wrap.py), not by a module of this file.

fbgemm keeps its own prepacked copy next to the quantized weight, so resident memory of int8 layers is
larger than `model_bytes` (which counts the stored weights, as docs/architecture.md defines it).
"""

from __future__ import annotations

import torch
from torch import nn

from infer_tune.tuners.quantize.kernels import prepack_int8, reduce_range  # noqa: F401  (prepack_int8: re-exported)


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


_PACKED = torch.utils.weak.WeakIdKeyDictionary()  # a module's weight_scale tensor -> its fbgemm prepacked weight


@torch.library.custom_op("infer_tune::fbgemm_linear_dynamic", mutates_args=())
def fbgemm_linear_dynamic(x: torch.Tensor, key: torch.Tensor, out_features: int, reduce_range: bool) -> torch.Tensor:
    """fbgemm's dynamic int8 linear as an op torch.compile can put in its graph (the prepacked weight is an
    opaque object dynamo cannot trace; it is found through `key`, the calling module's own scale tensor)."""
    return torch.ops.quantized.linear_dynamic(x, _PACKED[key], reduce_range)


@fbgemm_linear_dynamic.register_fake
def _(x: torch.Tensor, key: torch.Tensor, out_features: int, reduce_range: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class PortableModule(nn.Module):
    """Saves its `portable()` tensors (plain int8 / uint8 / float) instead of parameters; a tied head
    (rebuilt from the embedding's tensors) saves nothing. Runs `decode_kernel` on up to `decode_rows` rows
    (1; a batched decode step whose kernel treats rows independently raises it, tuners/batch/slots.py) and
    `prefill_kernel` on more (set by `set_kernels`, chosen by measuring: kernels.py)."""

    tied = False
    decode_rows = 1
    decode_kernel = "fbgemm"
    prefill_kernel = "fbgemm"
    KERNELS: tuple[str, ...] = ()

    def set_kernels(self, decode: str, prefill: str) -> None:
        for kernel in (decode, prefill):
            if kernel not in self.KERNELS:
                raise ValueError(f"{type(self).__name__} has no kernel '{kernel}'; it has {', '.join(self.KERNELS)}")
        self.decode_kernel, self.prefill_kernel = decode, prefill
        self._prepare_kernels()

    def _prepare_kernels(self) -> None:
        """Build what the chosen kernels read, before any forward (a compiled graph must not mutate it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K]
        rows = x.reshape(-1, x.shape[-1])  # [tokens, K]
        kernel = self.decode_kernel if rows.shape[0] <= self.decode_rows else self.prefill_kernel
        y = getattr(self, f"_run_{kernel}")(rows)  # [tokens, N], float32 or the kernel's bfloat16
        if self.bias_f is not None:
            y = y + self.bias_f
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # the model's compute dtype

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
@torch.library.custom_op("infer_tune::fbgemm_rows_linear_dynamic", mutates_args=())
def fbgemm_rows_linear_dynamic(x: torch.Tensor, key: torch.Tensor, wsum: torch.Tensor, out_features: int,
                               reduce_range: bool) -> torch.Tensor:
    """fbgemm's dynamic int8 linear with each row on its own grid, in one call: row i is mapped onto
    [0, 1] by its own min and range, an anchor row [0, 1, 0, ...] pins the call's grid to [0, 1] whatever
    the other rows hold, and y_i = range_i * W x'_i + min_i * W 1 (`wsum`: W's dequantized row sums).
    So a row's result depends on that row alone: a batch of requests decodes as each would alone."""
    low = x.amin(dim=1, keepdim=True)
    span = (x.amax(dim=1, keepdim=True) - low).clamp(min=1e-12)
    anchor = x.new_zeros(1, x.shape[1])
    anchor[0, min(1, x.shape[1] - 1)] = 1.0
    scaled = torch.cat([(x - low) / span, anchor])
    y = torch.ops.quantized.linear_dynamic(scaled, _PACKED[key], reduce_range)[:-1]
    return y * span + low * wsum


@fbgemm_rows_linear_dynamic.register_fake
def _(x: torch.Tensor, key: torch.Tensor, wsum: torch.Tensor, out_features: int, reduce_range: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class Int8DynamicLinear(PortableModule):
    """int8 per-channel weights, activations quantized per call.

    Kernels: `fbgemm` (torch.ops.quantized.linear_dynamic: one activation scale per call, i.e. per
    token at decode), `int_mm` (per-token symmetric int8 and one int8 x int8 -> int32 GEMM, so an
    outlier token (attention sinks) does not flatten every other token's precision at prefill),
    `dequant` (the weight dequantized per call and an fp32 matmul: weight-only numerics), and
    `fbgemm_rows` (fbgemm with each row on its own grid, rows independent: a batched decode step's
    candidate, tuners/batch/slots.py; not screened for one request, where `fbgemm` is the same thing).
    """

    kind = "int8-dynamic"
    KERNELS = ("fbgemm", "int_mm", "dequant", "fbgemm_rows")
    decode_kernel, prefill_kernel = "fbgemm", "int_mm"

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.weight_scale = scale.float().contiguous()
        self.bias_f = None if bias is None else bias.detach().float().contiguous()
        self._packed = prepack_int8(qweight.contiguous(), self.weight_scale, None)
        _PACKED[self.weight_scale] = self._packed
        self.reduce_range = reduce_range()  # measured on this host: see kernels.saturation_probe
        self.tied = False  # a tied head is rebuilt from the embedding's tensors and stores nothing
        self._prepare_kernels()

    def __setstate__(self, state: dict) -> None:  # a deep copy holds a new scale tensor: register it
        super().__setstate__(state)
        _PACKED[self.weight_scale] = self._packed

    def _run_fbgemm(self, rows: torch.Tensor) -> torch.Tensor:
        return fbgemm_linear_dynamic(rows.float(), self.weight_scale, self.out_features, self.reduce_range)

    def _run_fbgemm_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return fbgemm_rows_linear_dynamic(rows.float(), self.weight_scale, self._weight_sums(), self.out_features,
                                          self.reduce_range)

    def _weight_sums(self) -> torch.Tensor:
        """W 1 of the dequantized weight, [N] (fbgemm_rows adds it back per row), computed once."""
        if getattr(self, "_wsum", None) is None:
            self._wsum = self.qweight().float().sum(1) * self.weight_scale  # [N, K] unpacked for this only
        return self._wsum

    def _run_int_mm(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0  # [tokens, 1]
        xq = torch.clamp(torch.round(rows / scale), -127, 127).to(torch.int8)  # [tokens, K]
        return torch._int_mm(xq, self._weight_t()).float() * scale * self.weight_scale  # [tokens, N]

    def _run_dequant(self, rows: torch.Tensor) -> torch.Tensor:
        weight = self._weight_t().t().float() * self.weight_scale[:, None]  # [N, K], dequantized per call
        return torch.nn.functional.linear(rows.float(), weight)

    def _prepare_kernels(self) -> None:
        if {self.decode_kernel, self.prefill_kernel} & {"int_mm", "dequant"}:
            self._weight_t()
        if "fbgemm_rows" in (self.decode_kernel, self.prefill_kernel):
            self._weight_sums()

    def _weight_t(self) -> torch.Tensor:
        """int8 weight as [K, N], unpacked from fbgemm's copy once (kernels int_mm and dequant read it)."""
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
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, "
                f"kernels decode={self.decode_kernel} prefill={self.prefill_kernel}")


class Int8StaticLinear(Int8DynamicLinear):
    """SmoothQuant int8: x * smooth_inv is quantized with a fixed calibrated scale, int8 GEMM, fp32 out.

    Kernels: `fbgemm` (linear_with_input_q_dq_qweight_dq_output_fp32), `int_mm` (the same activation
    grid shifted to int8, torch._int_mm, exact integer math: traceable by torch.compile) or `dequant`
    (the same grid, fake-quantized, times the dequantized weight in fp32).
    """

    kind = "int8-static"
    KERNELS = ("fbgemm", "int_mm", "dequant")
    decode_kernel, prefill_kernel = "fbgemm", "fbgemm"

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 smooth_inv: torch.Tensor | None, act_scale: float, act_zero_point: int) -> None:
        super().__init__(qweight, scale, bias)
        self.smooth_inv = None if smooth_inv is None else smooth_inv.float().contiguous()
        self.act_scale, self.act_zero_point = float(act_scale), int(act_zero_point)

    def _smoothed(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.float() if self.smooth_inv is None else rows.float() * self.smooth_inv

    def _run_fbgemm(self, rows: torch.Tensor) -> torch.Tensor:
        x = self._smoothed(rows)
        if self.reduce_range:  # the op clamps to 0..255; a saturating host must stay within 0..127
            x = x.clamp((0 - self.act_zero_point) * self.act_scale, (127 - self.act_zero_point) * self.act_scale)
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            x, self.act_scale, self.act_zero_point, self._packed)

    def _quantized_input(self, rows: torch.Tensor) -> torch.Tensor:
        """The activation on the static grid, 0..qmax (uint8 values, held in float)."""
        qmax = 127 if self.reduce_range else 255
        return torch.clamp(torch.round(self._smoothed(rows) / self.act_scale) + self.act_zero_point, 0, qmax)

    def _run_int_mm(self, rows: torch.Tensor) -> torch.Tensor:
        # the same grid as fbgemm's static op, as int8 x int8 -> int32 (traceable by torch.compile):
        # (q - zp) @ W = (q - 128) @ W + (128 - zp) * colsum(W), with q - 128 in int8
        shifted = (self._quantized_input(rows) - 128).to(torch.int8)
        acc = torch._int_mm(shifted, self._weight_t()) + (128 - self.act_zero_point) * self._colsum()
        return acc.float() * (self.act_scale * self.weight_scale)

    def _colsum(self) -> torch.Tensor:
        if getattr(self, "_wq_colsum", None) is None:
            self._wq_colsum = self._weight_t().sum(dim=0, dtype=torch.int32)  # [N]
        return self._wq_colsum

    def _prepare_kernels(self) -> None:
        super()._prepare_kernels()
        if "int_mm" in (self.decode_kernel, self.prefill_kernel):
            self._colsum()

    def _run_dequant(self, rows: torch.Tensor) -> torch.Tensor:
        return super()._run_dequant((self._quantized_input(rows) - self.act_zero_point) * self.act_scale)

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
    """Group-wise 4-bit weights (uint8 holds two), bf16 scale + zero per group.

    Kernels: `int4pack` (aten._weight_int4pack_mm_for_cpu, bf16 activations) or `dequant` (the
    weight dequantized per call, fp32 matmul).
    """

    kind = "int4"
    KERNELS = ("int4pack", "dequant")
    decode_kernel, prefill_kernel = "int4pack", "int4pack"

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.group_size = group_size
        self.packed = packed.contiguous()  # portable layout: what is stored and saved
        self.scale = scale.to(torch.bfloat16).contiguous()  # [N, K/g]
        self.zero = zero.to(torch.bfloat16).contiguous()
        self.bias_f = None if bias is None else bias.detach().float()
        self.tied = False
        self._prepare_kernels()

    def _prepare_kernels(self) -> None:
        if "int4pack" in (self.decode_kernel, self.prefill_kernel) and getattr(self, "_tiles", None) is None:
            self._tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(self.packed), 1)
            self._scales_and_zeros = torch.stack([self.scale.t(), self.zero.t()], dim=-1).contiguous()  # [K/g, N, 2]

    def _run_int4pack(self, rows: torch.Tensor) -> torch.Tensor:  # bf16 out: forward casts to the model's dtype
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(torch.bfloat16), self._tiles, self.group_size,
                                                          self._scales_and_zeros)

    def _run_dequant(self, rows: torch.Tensor) -> torch.Tensor:
        weight = dequantize_int4(self.packed, self.scale, self.zero, self.group_size)  # [N, K] fp32, per call
        return torch.nn.functional.linear(rows.to(torch.bfloat16).float(), weight)  # int4pack's bf16 activations

    def portable(self) -> dict[str, torch.Tensor]:
        return self._with_bias({"qweight_int4": self.packed, "scale": self.scale, "zero": self.zero})

    @classmethod
    def from_portable(cls, t: dict[str, torch.Tensor], *, group_size: int, **_: object) -> Int4Linear:
        return cls(t["qweight_int4"], t["scale"], t["zero"], group_size, t.get("bias"))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 group={self.group_size}, "
                f"kernels decode={self.decode_kernel} prefill={self.prefill_kernel}")


A8_BLOCK = 32  # activations of the a8 numerics are quantized per row in blocks of this many inputs


def fake_quantize_a8(rows: torch.Tensor) -> torch.Tensor:
    """[M, K] -> the a8 activations as floats: per row and block of 32, dx = max|x| / 127 and
    x_hat = dx * round(x / dx) (0 where the block is all zero); the w4a8 kernel's quantization, bit for bit."""
    rows = rows.float()
    blocks = rows.reshape(rows.shape[0], -1, A8_BLOCK)
    dx = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(dx > 0, torch.round(blocks / dx), torch.zeros_like(blocks))
    return (q * dx).reshape(rows.shape)


LANE_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the output in each lane of the w4a8 kernel's vectors


def pack_w4a8(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """The w4a8 kernel's layout of portable int4 weights (infer_tune/native/matmul.cpp): uint8 [N/8, K/g, 32 + 4g],
    per tile of 8 outputs and group: the 8 scales and 8 zeros (bf16, in the kernel's lane order: even outputs'
    scales, their zeros, odd outputs' scales, their zeros), then each block of 32 weights as 4 x 32 bytes: in
    the i-th 32 bytes, lane l (outputs 0 2 4 6 1 3 5 7) holds its output's weights 4i..4i+3 in the low nibbles
    of its 4 bytes and 16+4i..16+4i+3 in the high ones. N is padded with zero rows to a multiple of 8. One
    contiguous stream per tile, read in order."""
    q = unpack_nibbles(packed).to(torch.uint8)  # [N, K]
    scale, zero = scale.to(torch.bfloat16), zero.to(torch.bfloat16)
    n, k = q.shape
    pad = -n % 8
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
        zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
    tiles, groups = (n + pad) // 8, k // group_size
    halves = q.view(tiles, 8, groups, group_size // 32, 2, 4, 4)  # [.., half, i, r]: weight 16 half + 4 i + r
    nibbles = halves[..., 0, :, :] | (halves[..., 1, :, :] << 4)  # [tiles, 8, groups, blocks, i, r]
    nibbles = nibbles[:, LANE_ORDER].permute(0, 2, 3, 4, 1, 5).reshape(tiles, groups, -1)  # [.., i, lane, r]
    s, z = (t.view(tiles, 8, groups).permute(0, 2, 1) for t in (scale, zero))  # [tiles, groups, 8]
    low, high = LANE_ORDER[:4], LANE_ORDER[4:]  # the lanes of the low and the high 128 bits
    sz = torch.cat([s[..., low], z[..., low], s[..., high], z[..., high]], dim=-1).contiguous()
    return torch.cat([sz.view(torch.uint8), nibbles], dim=-1).contiguous()


def unpack_w4a8(w4a8: torch.Tensor, out_features: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The portable int4 tensors (packed uint8 [N, K/2], scale and zero bf16 [N, K/g]) of the w4a8 layout
    `pack_w4a8` made: its exact inverse (the padding rows dropped)."""
    tiles, groups, width = w4a8.shape
    if width != 32 + 4 * group_size:
        raise ValueError(f"a w4a8 tensor of groups of {group_size} has {32 + 4 * group_size} bytes a group, not {width}")
    sz = w4a8[..., :32].contiguous().view(torch.bfloat16)  # [tiles, groups, 16]: low lanes' s, z, high lanes' s, z
    low, high = LANE_ORDER[:4], LANE_ORDER[4:]
    s, z = (sz.new_empty(tiles, groups, 8) for _ in range(2))
    s[..., low], z[..., low], s[..., high], z[..., high] = sz[..., 0:4], sz[..., 4:8], sz[..., 8:12], sz[..., 12:16]
    scale, zero = (t.permute(0, 2, 1).reshape(tiles * 8, groups)[:out_features].contiguous() for t in (s, z))
    nibbles = w4a8[..., 32:].reshape(tiles, groups, group_size // 32, 4, 8, 4)  # [.., i, lane, r]
    nibbles = nibbles.permute(0, 4, 1, 2, 3, 5)[:, [LANE_ORDER.index(o) for o in range(8)]]  # [tiles, 8, g, b, i, r]
    halves = torch.stack([nibbles & 15, nibbles >> 4], dim=4)  # weight 16 half + 4 i + r of its block
    q = halves.reshape(tiles * 8, groups * group_size)[:out_features]
    return pack_nibbles(q), scale, zero


class Int4A8Linear(Int4Linear):
    """int4 weights (as Int4Linear: the same stored tensors) with int8 activations: every row of the input is
    quantized per block of 32 (`fake_quantize_a8`), as llama.cpp's Q4 x Q8 dot products do. Numerics: the
    quantized activations times the dequantized weights.

    Kernels: `w4a8` (the project's C++ kernel, infer_tune/native: integer dot products of the int8 activations with
    the 4-bit weights, scales in fp32; rows independent) or `dequant` (the same quantized activations times
    the weight dequantized per call, fp32 matmul: equal up to fp32 rounding). Both regimes default to `w4a8`
    where it builds, else `dequant`; the kernel screen chooses per regime.
    """

    kind = "int4-a8"
    KERNELS = ("w4a8", "dequant")

    def __init__(self, packed: torch.Tensor | None, scale: torch.Tensor | None, zero: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None = None, *, w4a8: torch.Tensor | None = None,
                 out_features: int | None = None) -> None:
        """From the portable tensors, or from the kernel's layout (`w4a8`, as `pack_w4a8` makes it, e.g. the
        memory-mapped tensor of a saved checkpoint) with `out_features` (its rows before padding)."""
        from infer_tune import native

        kernel = "w4a8" if native.available()[0] else "dequant"
        self.decode_kernel = self.prefill_kernel = kernel
        PortableModule.__init__(self)
        self.group_size = group_size
        self.bias_f = None if bias is None else bias.detach().float()
        self.tied = False
        self._w4a8 = None
        if w4a8 is not None and kernel != "w4a8":  # no native kernels here: the portable form, once
            packed, scale, zero = unpack_w4a8(w4a8, out_features, group_size)
            w4a8 = None
        if w4a8 is not None:
            self._w4a8, self._int4 = w4a8, None
            self.out_features, self.in_features = out_features, w4a8.shape[1] * group_size
        else:
            self._int4 = (packed.contiguous(), scale.to(torch.bfloat16).contiguous(),
                          zero.to(torch.bfloat16).contiguous())
            self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self._prepare_kernels()

    # One copy of the weights: the portable tensors until the w4a8 layout exists, then that layout alone (the
    # native step and the w4a8 kernel read it); the portable ones are unpacked from it when asked for (the
    # dequant kernel, each call).
    def int4_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed, scale, zero): the portable int4 tensors, kept or unpacked from the w4a8 layout."""
        if self._int4 is not None:
            return self._int4
        return unpack_w4a8(self._w4a8, self.out_features, self.group_size)

    packed = property(lambda self: self.int4_tensors()[0])
    scale = property(lambda self: self.int4_tensors()[1])
    zero = property(lambda self: self.int4_tensors()[2])

    def _prepare_kernels(self) -> None:
        if "w4a8" in (self.decode_kernel, self.prefill_kernel) and self._w4a8 is None:
            from infer_tune import native

            native.w4a8()  # builds or loads the kernel; raises KernelUnavailable with the reason
            self._w4a8 = pack_w4a8(*self._int4, self.group_size)
        if self._w4a8 is not None:
            self._int4 = None

    def _run_w4a8(self, rows: torch.Tensor) -> torch.Tensor:
        y = torch.ops.infer_tune_native.w4a8_mm(rows.float().contiguous(), self._w4a8, self.group_size)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]

    def _run_dequant(self, rows: torch.Tensor) -> torch.Tensor:
        weight = dequantize_int4(*self.int4_tensors(), self.group_size)  # [N, K] fp32, per call
        return torch.nn.functional.linear(fake_quantize_a8(rows), weight)

    def portable(self) -> dict[str, torch.Tensor]:
        """The w4a8 layout (what the kernel and the native step read, so a load maps it and copies nothing) and
        the row count before padding."""
        w4a8 = self._w4a8 if self._w4a8 is not None else pack_w4a8(*self._int4, self.group_size)
        return self._with_bias({"qweight_w4a8": w4a8, "out_features": torch.tensor([self.out_features])})

    @classmethod
    def from_portable(cls, t: dict[str, torch.Tensor], *, group_size: int, **_: object) -> Int4A8Linear:
        if "qweight_w4a8" in t:
            return cls(None, None, None, group_size, t.get("bias"), w4a8=t["qweight_w4a8"],
                       out_features=int(t["out_features"][0]))
        return cls(t["qweight_int4"], t["scale"], t["zero"], group_size, t.get("bias"))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", int8 activations per 32"


def pack_w8a8(qweight: torch.Tensor) -> torch.Tensor:
    """The w8a8 kernel's layout of int8 weights [N, K] (infer_tune/native/matmul.cpp): int8 [N/8, K/32, 256], per
    tile of 8 outputs and block of 32 inputs the 8 outputs' 32 weights; N padded with zero rows to a multiple of 8."""
    n, k = qweight.shape
    q = torch.cat([qweight, qweight.new_zeros(-n % 8, k)]) if n % 8 else qweight
    return q.view(-1, 8, k // 32, 32).permute(0, 2, 1, 3).reshape(-1, k // 32, 8 * 32).contiguous()


def unpack_w8a8(w8a8: torch.Tensor, out_features: int) -> torch.Tensor:
    """int8 [N, K] of the w8a8 layout `pack_w8a8` made: its exact inverse (the padding rows dropped)."""
    tiles, blocks, _ = w8a8.shape
    return w8a8.view(tiles, blocks, 8, 32).permute(0, 2, 1, 3).reshape(tiles * 8, blocks * 32)[:out_features]


class Int8A8Linear(PortableModule):
    """int8 weights per output channel with the int8 activations of Int4A8Linear (per row and block of 32):
    the head (and embedding-tied table) of int4 methods with `activations: int8`, so every quantized layer of
    such a model multiplies int8 activations.

    Kernels: `w8a8` (the project's C++ kernel, infer_tune/native) or `dequant` (the same activations times the
    weight dequantized per call, fp32 matmul). Stores what Int8DynamicLinear stores (qweight, weight_scale).
    """

    kind = "int8-a8"
    KERNELS = ("w8a8", "dequant")

    def __init__(self, qweight: torch.Tensor | None, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                 w8a8: torch.Tensor | None = None) -> None:
        """From int8 weights [N, K], or from the kernel's layout (`w8a8`, as `pack_w8a8` makes it, e.g. the
        memory-mapped tensor of a saved checkpoint); `scale` [N] either way."""
        from infer_tune import native

        self.decode_kernel = self.prefill_kernel = "w8a8" if native.available()[0] else "dequant"
        super().__init__()
        self.weight_scale = scale.float().contiguous()
        self.out_features = self.weight_scale.shape[0]
        self.bias_f = None if bias is None else bias.detach().float().contiguous()
        self.tied = False
        self._w8a8 = None
        if w8a8 is not None and self.decode_kernel != "w8a8":  # no native kernels here: the plain form, once
            qweight, w8a8 = unpack_w8a8(w8a8, self.out_features).contiguous(), None
        if w8a8 is not None:
            self._qweight, self.in_features = None, w8a8.shape[1] * 32
            self._w8a8 = (w8a8, self._padded_scale())
        else:
            self._qweight, self.in_features = qweight.to(torch.int8).contiguous(), qweight.shape[1]
        self._prepare_kernels()

    def _padded_scale(self) -> torch.Tensor:
        pad = -self.out_features % 8
        return torch.cat([self.weight_scale, self.weight_scale.new_zeros(pad)]) if pad else self.weight_scale

    def _prepare_kernels(self) -> None:
        if "w8a8" in (self.decode_kernel, self.prefill_kernel) and self._w8a8 is None:
            from infer_tune import native

            native.w4a8()  # builds or loads the kernels; raises KernelUnavailable with the reason
            self._w8a8 = (pack_w8a8(self._qweight), self._padded_scale())
        if self._w8a8 is not None:  # one copy of the weights: the kernel's layout (qweight() unpacks it)
            self._qweight = None

    def _run_w8a8(self, rows: torch.Tensor) -> torch.Tensor:
        y = torch.ops.infer_tune_native.w8a8_mm(rows.float().contiguous(), *self._w8a8)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]

    def _run_dequant(self, rows: torch.Tensor) -> torch.Tensor:
        weight = self.qweight().float() * self.weight_scale[:, None]  # [N, K], per call
        return torch.nn.functional.linear(fake_quantize_a8(rows), weight)

    def qweight(self) -> torch.Tensor:
        """int8 [N, K]: kept, or unpacked from the w8a8 layout (a copy)."""
        return self._qweight if self._qweight is not None else unpack_w8a8(self._w8a8[0], self.out_features)

    def portable(self) -> dict[str, torch.Tensor]:
        """The w8a8 layout (what the kernel and the native step read, so a load maps it) and the scales."""
        w8a8 = self._w8a8[0] if self._w8a8 is not None else pack_w8a8(self._qweight)
        return self._with_bias({"qweight_w8a8": w8a8, "weight_scale": self.weight_scale})

    @classmethod
    def from_portable(cls, t: dict[str, torch.Tensor], **_: object) -> Int8A8Linear:
        if "qweight_w8a8" in t:
            return cls(None, t["weight_scale"], t.get("bias"), w8a8=t["qweight_w8a8"])
        return cls(t["qweight"], t["weight_scale"], t.get("bias"))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, "
                f"int8 activations per 32, kernels decode={self.decode_kernel} prefill={self.prefill_kernel}")


LINEAR_KINDS: dict[str, type] = {cls.kind: cls for cls in (Int8DynamicLinear, Int8StaticLinear, Int4Linear,
                                                            Int4A8Linear, Int8A8Linear)}
