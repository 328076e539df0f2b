"""Quantize embeddings, heads and norms by wrapping what the original module does, never replacing it.

Model families differ in what their embedding, head and norm modules do beyond the textbook op:
Gemma scales the looked-up rows by sqrt(hidden) inside its embedding module, Gemma's RMSNorm
multiplies by (1 + weight) instead of weight, Gemma2/3 put a norm *after* attention whose output
feeds no projection. A quantized path that swaps in a plain lookup, or divides a norm's weight by
a smoothing vector assuming it multiplies by `weight`, silently breaks those models.

- Embeddings: the module keeps its own class and `forward`; only the lookup underneath
  (`nn.Embedding.forward`) becomes a dequantizing lookup, by giving the instance a subclass whose
  MRO puts `QuantLookup` between the original class and `nn.Embedding`. Whatever the original does
  around `super().forward(ids)` (a scale, say) still runs. The quantized module is checked against
  the original on probe ids; a module that bypasses `super().forward` is kept in float (and why).
- Heads: only a plain `nn.Linear` head is replaced (a subclass may do more than a matmul; it is kept
  in float and the summary says so).
- Norms: SmoothQuant folds 1/s into the norm that feeds a group of projections. Which norm feeds
  which projection is observed (tensor identity during a calibration forward), not guessed from
  names; the weight parametrization (w or c + w) is measured on probe inputs; the fold is verified
  numerically and skipped (keeping an explicit 1/s) when it does not hold.
"""

from __future__ import annotations

import torch
from torch import nn

from infer_tune.tuners.quantize.modules import dequantize_int4

_SWAPPED: dict[type, type] = {}


class QuantLookup(nn.Embedding):
    """The lookup under an embedding module: int8 rows (scale per row) or int4 groups, dequantized per row.

    Never instantiated directly: `wrap_embedding` gives an existing embedding module a subclass of
    (its class, QuantLookup), so the original `forward` runs and its `super().forward` lands here.
    """

    qtensors: dict[str, torch.Tensor]
    group_size: int | None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [B, T] -> [B, T, H]
        flat = ids.reshape(-1)
        t = self.qtensors
        if "qweight" in t:
            rows = t["qweight"][flat].float() * t["weight_scale"][flat, None]
        else:
            rows = dequantize_int4(t["qweight_int4"][flat], t["scale"][flat], t["zero"][flat], self.group_size)
        return rows.to(self.weight.dtype).view(*ids.shape, -1)  # the placeholder's dtype: the model's

    @property
    def bits(self) -> int:
        return 8 if "qweight" in self.qtensors else 4

    def portable(self) -> dict[str, torch.Tensor]:
        return dict(self.qtensors)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        for name, tensor in self.qtensors.items():
            destination[prefix + name] = tensor

    def _apply(self, fn, recurse=True):
        self.qtensors = {k: fn(v) for k, v in self.qtensors.items()}
        probe = fn(self.weight[:1, :1])  # the placeholder follows dtype / device moves without materializing
        self.weight = torch.full((1, 1), float("nan"), dtype=probe.dtype, device=probe.device).expand(
            *self.weight.shape)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int{self.bits} rows (wrapped lookup)"


def quantized_class(cls: type) -> type:
    """(cls, QuantLookup) with the original class first, so its forward wraps the quantized lookup."""
    if cls not in _SWAPPED:
        bases = (QuantLookup,) if cls is nn.Embedding else (cls, QuantLookup)
        _SWAPPED[cls] = type(f"Quantized{cls.__name__}", bases, {"__module__": __name__})
    return _SWAPPED[cls]


def is_wrapped(module: nn.Module) -> bool:
    return isinstance(module, QuantLookup)


def wrap_embedding(module: nn.Embedding, tensors: dict[str, torch.Tensor], group_size: int | None) -> nn.Embedding:
    """Turn `module` (in place) into its quantized-lookup variant holding `tensors`; returns it.

    The float table is dropped. `weight` stays as a zero-stride NaN placeholder of the right shape,
    dtype and device, so code that reads `weight.dtype` (Gemma's scale cast) works and code that
    reads its values produces NaN (caught by `verify_embedding`) instead of plausible garbage.
    """
    weight = module.weight
    # the placeholder lives with the quantized rows (a skeleton's float table is on the meta device)
    dtype, shape = weight.dtype, tuple(weight.shape)
    device = next(iter(tensors.values())).device if weight.is_meta and tensors else weight.device
    original_cls = type(module)
    del module.weight
    module.__class__ = quantized_class(original_cls)
    module.qtensors = {k: v.contiguous() for k, v in tensors.items()}
    module.group_size = group_size
    module.weight = torch.full((1, 1), float("nan"), dtype=dtype, device=device).expand(*shape)
    return module


MAX_EMBEDDING_REL_ERROR = 0.25  # int4 groups of 32 measure ~0.08 on Gaussian rows; a lost scale or NaN is far off


def verify_embedding(original: nn.Module, wrapped: nn.Module, *, probes: int = 64) -> float:
    """Relative error ||wrapped(ids) - original(ids)|| / ||original(ids)|| on probe ids (inf when not finite).

    Relative error, not cosine: a dropped scale (Gemma's sqrt(hidden)) keeps the direction and changes
    the magnitude, and must fail this check.
    """
    n = original.num_embeddings
    ids = torch.linspace(0, n - 1, steps=min(probes, n)).long().view(1, -1).to(original.weight.device)
    with torch.no_grad():
        ref, out = original(ids).float(), wrapped(ids).float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp(min=1e-12))


# --------------------------------------------------------------------------- norms
def norm_like(module: nn.Module) -> bool:
    """A module with a 1-D `weight` that is not a Linear / Embedding: a norm as far as folding cares."""
    w = getattr(module, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 1 and not isinstance(module, (nn.Linear, nn.Embedding))
            and w.is_floating_point())


def fold_scale_into_norm(norm: nn.Module, s: torch.Tensor, *, rtol: float = 1e-3) -> bool:
    """Make `norm(x)` return `norm(x) / s` by editing its weight; True when the fold verifies.

    The parametrization is measured, not assumed: with weight 0 and weight 1 on probe inputs,
    `out = n(x) * (c + w)` gives the offset c (0 for Llama-style norms, 1 for Gemma's 1 + w).
    The edited norm is checked on the probes; on a mismatch the weight is restored and False returned.
    """
    weight = norm.weight
    hidden = weight.shape[0]
    x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    original = weight.data.clone()
    with torch.no_grad():
        reference = norm(x).float()
        weight.data.zero_()
        at_zero = norm(x).float()
        weight.data.fill_(1.0)
        at_one = norm(x).float()
        unit = at_one - at_zero  # n(x)
        offset = (at_zero * unit).sum(0) / (unit * unit).sum(0).clamp(min=1e-12)  # least squares c per channel
        offset = torch.where(offset.abs() < 1e-6, torch.zeros_like(offset), offset)
        weight.data.copy_(((offset + original.float()) / s.float() - offset).to(weight.dtype))
        folded = norm(x).float()
        expected = reference / s.float().to(reference.device)
        ok = bool(torch.allclose(folded, expected, rtol=rtol, atol=rtol * float(expected.abs().max())))
        if not ok:
            weight.data.copy_(original)
    return ok


class NormWiring:
    """Which norm module's output a Linear reads directly, observed during a forward pass.

    Forward hooks keep each norm-like module's output (the tensor object); a Linear pre-hook looks its
    input up by identity. Only a projection that consumes the norm's output as is gets an entry.
    """

    def __init__(self, model: nn.Module, linears: dict[str, nn.Linear]) -> None:
        self.fed_by: dict[str, str] = {}
        self._outputs: dict[int, tuple[str, torch.Tensor]] = {}
        self._handles = []
        for name, module in model.named_modules():
            if norm_like(module):
                self._handles.append(module.register_forward_hook(self._norm_hook(name)))
        for name, module in linears.items():
            self._handles.append(module.register_forward_pre_hook(self._linear_hook(name)))

    def _norm_hook(self, name: str):
        def hook(_module, _args, output):
            if isinstance(output, torch.Tensor):
                self._outputs[id(output)] = (name, output)
        return hook

    def _linear_hook(self, name: str):
        def hook(_module, args):
            x = args[0]
            found = self._outputs.get(id(x))
            if found is not None and found[1] is x:
                self.fed_by[name] = found[0]
        return hook

    def step_done(self) -> None:
        """Drop the kept outputs after each forward (they would pin memory otherwise)."""
        self._outputs.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._outputs.clear()
