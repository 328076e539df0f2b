"""`QuantizeConfig`: which method, which backend, and the method's knobs; validated on construction."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import ClassVar

from infer_tune.errors import ConfigError
from infer_tune.tuners.base import TechniqueConfig
from infer_tune.tuners.quantize.kernels import KERNELS
from infer_tune.tuners.quantize.kernels import family as kernel_family

METHODS = ("bf16", "int8-dynamic", "int8-static", "int4-weight", "int4-rtn")
BACKENDS = ("auto", "torch", "quanto", "torchao")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 CPU kernel accepts
COMPUTE_DTYPES = ("float32", "bfloat16")
ACTIVATIONS = ("bf16", "int8")

# What each backend implements (`auto` resolves to one of these, see `resolve_backend`).
SUPPORTED: dict[str, tuple[str, ...]] = {
    "torch": METHODS,
    "quanto": ("int8-dynamic", "int8-static", "int4-weight", "int4-rtn"),
    "torchao": ("int8-dynamic", "int4-rtn"),
}


@dataclasses.dataclass
class QuantizeConfig(TechniqueConfig):
    """One quantization recipe.

    method: bf16 | int8-dynamic | int8-static | int4-weight | int4-rtn.
    backend: auto picks the kernels measured fastest on the device (torch's int8 / int4 CPU kernels
    on CPU; quanto, or torchao when installed, on CUDA).
    alpha: SmoothQuant migration strength for int8-static (0 = all on activations, 1 = all on weights).
    group_size: weights per 4-bit group for int4-*; must divide every quantized layer's in_features.
        Default 32: on SmolLM2 (itself distributed as GGUF Q4_1, groups of 32) group 32 measured
        +5.2% perplexity against +31.6% for group 64, for 33% instead of 29% of the 16-bit bytes.
    calib_suite / calib_samples: prompts whose activations calibrate int8-static.
    head_bits: bits of the embedding table and output head of int4 methods: 8 (default) stores them int8
        per row, 4 int4 per group like the layers. On SmolLM2 (whose GGUF holds that table as Q8_0),
        int4 layers measured +5.09% perplexity with an int4 table and head, -1.14% with an int8 one;
        the int4 head is faster to read (about 18 instead of 28 MB per token). int8 methods: always 8.
    activations: what the int4 layers multiply their weights with: bf16 (default: torch's int4 kernel rounds
        its input to bf16) or int8 (every input row quantized per block of 32, as llama.cpp's Q4 x Q8 dot
        products do: the w4a8 kernel, modules.Int4A8Linear; lossy on top of the weights, so perplexity and
        BLEU drift say what it costs). int4 methods only; label `...-a8`.
    compute_dtype: dtype of the activations between the quantized layers (norms, attention, residuals):
        float32 (default) or bfloat16 (the int4 kernel takes bf16 activations anyway; without native
        bf16 arithmetic it measured slower here, 8.3 against 5.9 ms/token in the lean path).
    decode_kernel / prefill_kernel: `auto` times the method's candidate kernels on the model's own
        Linear shapes on this host and runs the fastest (recorded in the result's `kernels`); a
        kernel name forces it (int8-dynamic: fbgemm, int_mm, dequant; int8-static: fbgemm, dequant;
        int4-*: int4pack, dequant; int4-* with int8 activations: w4a8, dequant).
    """

    technique: ClassVar[str] = "quantize"

    method: str = "int8-dynamic"
    backend: str = "auto"
    alpha: float = 0.5
    group_size: int = 32
    calib_suite: str = "chat"
    calib_samples: int = 16
    decode_kernel: str = "auto"
    prefill_kernel: str = "auto"
    head_bits: int = 8
    activations: str = "bf16"
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"quantize: method must be one of {', '.join(METHODS)}; got '{self.method}'")
        if self.backend not in BACKENDS:
            raise ConfigError(f"quantize: backend must be one of {', '.join(BACKENDS)}; got '{self.backend}'")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"quantize: alpha must be in [0, 1]; got {self.alpha}")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"quantize: group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}; "
                              f"got {self.group_size}")
        if self.head_bits not in (4, 8):
            raise ConfigError(f"quantize: head_bits must be 4 or 8; got {self.head_bits}")
        if self.head_bits == 4 and not self.method.startswith("int4"):
            raise ConfigError(f"quantize: head_bits 4 needs an int4 method; {self.method} stores the head int8")
        if self.activations not in ACTIVATIONS:
            raise ConfigError(f"quantize: activations must be one of {', '.join(ACTIVATIONS)}; got '{self.activations}'")
        if self.activations == "int8" and not self.method.startswith("int4"):
            raise ConfigError(f"quantize: activations int8 needs an int4 method; {self.method} sets its own")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"quantize: compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}; "
                              f"got '{self.compute_dtype}'")
        if self.calib_samples < 1:
            raise ConfigError(f"quantize: calib_samples must be >= 1; got {self.calib_samples}")
        if not self.calib_suite:
            raise ConfigError("quantize: calib_suite must name a suite or file; got an empty string")
        if self.backend != "auto" and self.method not in SUPPORTED[self.backend]:
            raise ConfigError(f"quantize: backend '{self.backend}' implements {', '.join(SUPPORTED[self.backend])}; "
                              f"got method '{self.method}'")
        for name in ("decode_kernel", "prefill_kernel"):
            value = getattr(self, name)
            allowed = KERNELS.get(kernel_family(self.method, self.activations), ())
            if value != "auto" and value not in allowed:
                choices = ", ".join(allowed) if allowed else f"(none: {self.method} has no kernel choice)"
                raise ConfigError(f"quantize: {name} must be auto or one of {choices}; got '{value}'")
        if self.backend == "torchao" and importlib.util.find_spec("torchao") is None:
            raise ConfigError("quantize: backend 'torchao' is not installed; pip install 'infer-tune[torchao]' "
                              "or use backend torch or quanto")

    @property
    def calibrated(self) -> bool:
        """Whether the method needs activation statistics from the calibration suite."""
        return self.method == "int8-static"

    def label(self) -> str:
        parts = [self.method, self.backend]
        if self.method == "int8-static":
            parts.append(f"a{self.alpha:g}")
        if self.method.startswith("int4"):
            parts.append(f"g{self.group_size}")
            if self.head_bits == 4:
                parts.append("h4")
            if self.activations == "int8":
                parts.append("a8")
        if self.compute_dtype == "bfloat16" and self.method != "bf16":
            parts.append("bf16act")
        if (self.decode_kernel, self.prefill_kernel) != ("auto", "auto"):
            parts.append(f"k{self.decode_kernel}.{self.prefill_kernel}")
        return "-".join(parts)

    def applicable_fields(self) -> tuple[str, ...]:
        """The knobs this method reads: alpha and calibration for int8-static only, group size and head
        bits for int4 methods, kernels where the method has a choice, compute dtype for all but bf16."""
        fields = ["method", "backend"]
        if self.calibrated:
            fields += ["alpha", "calib_suite", "calib_samples"]
        if self.method.startswith("int4"):
            fields += ["group_size", "head_bits", "activations"]
        if KERNELS.get(kernel_family(self.method, self.activations)):
            fields += ["decode_kernel", "prefill_kernel"]
        if self.method != "bf16":
            fields.append("compute_dtype")
        return tuple(fields)

    def forced_kernels(self) -> tuple[str | None, str | None]:
        """(decode, prefill) kernel names the config forces (None: measured choice)."""
        return tuple(None if k == "auto" else k for k in (self.decode_kernel, self.prefill_kernel))


def resolve_backend(config: QuantizeConfig, device: str) -> str:
    """`auto` -> the backend measured fastest for this method on `device` (bench/quantize_speed.py)."""
    if config.backend != "auto":
        return config.backend
    if device.startswith("cuda") and config.method != "bf16":
        if importlib.util.find_spec("torchao") is not None and config.method in SUPPORTED["torchao"]:
            return "torchao"
        return "quanto"
    return "torch"


def parse_sweep(text: str) -> list[str]:
    """`int8-dynamic,int4-weight` -> validated method names (in order, no duplicates)."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise ConfigError(f"a sweep needs comma-separated methods from {', '.join(METHODS)}; got '{text}'")
    for method in methods:
        if method not in METHODS:
            raise ConfigError(f"sweep: unknown method '{method}'; choose from {', '.join(METHODS)}")
    return list(dict.fromkeys(methods))
