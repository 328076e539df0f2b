"""Calibration: activation statistics on a prompt suite, SmoothQuant migration, static activation scales."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from infer_tune.errors import ConfigError, SuiteError
from infer_tune.tuners.quantize.kernels import activation_qmax

Progress = Callable[[str, int, int | None], None]


@dataclass
class ActStats:
    """Per input channel of one Linear, over every calibration token: min, max (and so absmax)."""

    minimum: torch.Tensor  # [K]
    maximum: torch.Tensor  # [K]
    samples: torch.Tensor | None = None  # [rows, K]: evenly spaced calibration rows (to judge a layer's error)

    @property
    def absmax(self) -> torch.Tensor:
        return torch.maximum(self.minimum.abs(), self.maximum.abs())


def calibration_batches(tokenizer, suite: str, samples: int, *, seed: int = 1, chat_template: bool = True,
                        max_tokens: int = 512) -> list[torch.Tensor]:
    """Token ids of the first `samples` prompts of `suite` (seeded apart from the measured prompts)."""
    from infer_tune.suites import SuiteSpec, load_suite
    from infer_tune.workload import render_prompt

    try:
        prompts = load_suite(SuiteSpec(name=suite, seed=seed))
    except SuiteError as exc:
        raise SuiteError(f"calibration suite: {exc}") from None
    batches = []
    for prompt in prompts:
        text = render_prompt(tokenizer, prompt.text, chat_template)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=not chat_template)["input_ids"][:, :max_tokens]
        if ids.shape[1] > 0:
            batches.append(ids)
        if len(batches) >= samples:
            break
    if not batches:
        raise SuiteError(f"calibration suite '{suite}' has no usable prompts; give a calibration suite with text")
    return batches


@torch.no_grad()
def collect_activation_stats(model: nn.Module, targets: dict[str, nn.Linear], batches: list[torch.Tensor],
                             progress: Progress | None = None, *, wiring=None, keep_rows: int = 0) -> dict[str, ActStats]:
    """Run the calibration prompts once and record each target's input range per channel.

    `wiring` (a wrap.NormWiring on the same model) observes which norm feeds which target meanwhile;
    `keep_rows` keeps about that many evenly spaced input rows per target (`ActStats.samples`).
    """
    stats: dict[str, ActStats] = {}
    per_batch = -(-keep_rows // max(len(batches), 1)) if keep_rows else 0

    def hook_for(name: str):
        def hook(_module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])  # [tokens, K]
            lo, hi = x.amin(dim=0), x.amax(dim=0)
            samples = stats[name].samples if name in stats else None
            if name in stats:
                lo, hi = torch.minimum(stats[name].minimum, lo), torch.maximum(stats[name].maximum, hi)
            if per_batch:
                picked = x[torch.linspace(0, x.shape[0] - 1, min(per_batch, x.shape[0])).long()].clone()
                samples = picked if samples is None else torch.cat([samples, picked])
            stats[name] = ActStats(lo, hi, samples)
        return hook

    handles = [module.register_forward_pre_hook(hook_for(name)) for name, module in targets.items()]
    try:
        for i, ids in enumerate(batches):
            model(input_ids=ids, use_cache=False)
            if wiring is not None:
                wiring.step_done()
            if progress:
                progress("calibrating", i + 1, len(batches))
    finally:
        for handle in handles:
            handle.remove()
        if wiring is not None:
            wiring.remove()
    missing = set(targets) - set(stats)
    if missing:
        raise ConfigError(f"calibration never reached {len(missing)} layers (e.g. {sorted(missing)[0]})")
    return stats


def smoothing_factors(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant: s_j = max|X_j|^alpha / max|W_j|^(1-alpha); x / s and W * s leave x @ W.T unchanged."""
    w_absmax = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)  # [K]
    s = act_absmax.clamp(min=1e-5).pow(alpha) / w_absmax.pow(1 - alpha)
    return s.clamp(min=1e-5)


def static_act_qparams(stats: ActStats, smooth: torch.Tensor | None) -> tuple[float, int]:
    """Fixed asymmetric uint8 scale and zero point covering the calibrated range, within the range this
    host's int8 GEMM holds without saturating (0..255, or 0..127 where u8 x s8 pairs saturate int16)."""
    qmax = activation_qmax()
    lo, hi = stats.minimum, stats.maximum
    if smooth is not None:
        lo, hi = lo / smooth, hi / smooth
    lo_v, hi_v = min(float(lo.min()), 0.0), max(float(hi.max()), 0.0)
    scale = max((hi_v - lo_v) / qmax, 1e-8)
    zero_point = int(min(max(round(-lo_v / scale), 0), qmax))
    return scale, zero_point
