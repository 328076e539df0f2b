"""Shared fixtures: tiny random models built from a transformers config (no download), and the real
SmolLM2 model for the few integration tests (provisioned by `make test` through `models pull`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`, docs/commands.md). Each worker is
# one process of the two cores: torch gets one intra-op thread there (and in what it starts), and its own temp folder (subprocesses inherit
# it), so a test that checks what it left in the temp folder never sees the other worker's files. The compiled
# graphs stay shared: inductor's cache is pinned to the folder it would use without the worker's TMPDIR.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    import atexit
    import getpass
    import tempfile

    _shared_tmp = tempfile.gettempdir()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_shared_tmp, f"torchinductor_{getpass.getuser()}"))
    # inductor's precompiled C++ header (~6 s to build on this host's 2 cores, one per torch install) goes under the temp
    # folder of the moment its codecache module is imported, not under TORCHINDUCTOR_CACHE_DIR: imported before the
    # worker's TMPDIR is set, both workers share it with every run, instead of each building its own every run
    import torch._inductor.codecache  # noqa: F401
    _worker_tmp = tempfile.mkdtemp(prefix=f"pytest-worker-{XDIST_WORKER}-", dir=_shared_tmp)
    os.environ["TMPDIR"] = _worker_tmp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    atexit.register(shutil.rmtree, _worker_tmp, ignore_errors=True)
    import torch

    torch.set_num_threads(1)
    # and so does every process a test starts (a `transformers serve` server, a CLI subprocess, a rank, a command run
    # in-process: scenarios.common.setup_threads reads it too): two OpenMP threads per process with the other worker
    # on the second core wait at every barrier for a descheduled thread (the two `transformers serve` tests beside
    # one busy core: 116 s with two threads, 35 s with one)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# The files that take longest (two workers on 2 cores, with a cold inductor cache as a fresh clone has it: pytest
# --durations), handed out first under xdist so that no long file starts last and keeps one worker busy while the other
# has finished; the rest follow in collection order. The second file needs no native kernels: its worker keeps busy
# while the first file's worker builds them.
LONGEST_FILES = ("test_batch_slots.py", "test_data_safety.py", "test_native_attention.py", "test_endpoint_server.py",
                 "test_engine_launch.py", "test_tune.py", "test_lean_prefill.py", "test_native_step.py",
                 "test_architecture.py", "test_experts.py", "test_llamacpp_best.py", "test_speculate.py",
                 "test_torchrun.py", "test_random_weights.py", "test_batch.py", "test_loadgen.py", "test_endpoint.py",
                 "test_hostile_local.py")


# A worker that dies takes its stderr with it (pytest-xdist says only "node down: Not properly terminated"). Each
# worker has faulthandler write to a file of the controller's folder instead (SIGSEGV, SIGFPE, SIGABRT, SIGBUS,
# SIGILL, and SIGTERM, which it then lets through), with the test it began last; the controller prints what a dead
# worker left there in its summary.
CRASH_DIR_ENV = "INFER_TUNE_TEST_CRASH_DIR"


def pytest_configure(config):
    if XDIST_WORKER or not getattr(config.option, "numprocesses", None):
        return
    import tempfile

    os.environ[CRASH_DIR_ENV] = tempfile.mkdtemp(prefix="infer-tune-test-crashes-")


def pytest_sessionstart(session):
    folder = os.environ.get(CRASH_DIR_ENV)
    if not (XDIST_WORKER and folder):
        return
    import faulthandler
    import signal

    global _crash_log
    _crash_log = open(os.path.join(folder, f"{XDIST_WORKER}-{os.getpid()}.log"), "w")  # noqa: SIM115 (the process's)
    faulthandler.enable(file=_crash_log, all_threads=True)
    faulthandler.register(signal.SIGTERM, file=_crash_log, all_threads=True, chain=True)


_crash_log = None


def pytest_runtest_logstart(nodeid, location):
    if _crash_log is not None:
        _crash_log.write(f"began {nodeid}\n")
        _crash_log.flush()


def pytest_terminal_summary(terminalreporter):
    folder = os.environ.get(CRASH_DIR_ENV)
    if XDIST_WORKER or not folder or not os.path.isdir(folder):
        return
    for name in sorted(os.listdir(folder)):
        lines = Path(folder, name).read_text(errors="replace").splitlines()
        fault = [i for i, line in enumerate(lines) if not line.startswith("began ")]
        if fault:
            began = [line for line in lines[:fault[0]] if line.startswith("began ")]
            terminalreporter.write_sep("=", f"worker {name}: a fatal signal, after {began[-1] if began else 'no test'}")
            terminalreporter.write_line("\n".join(lines[fault[0]:][:80]))
            terminalreporter.write_line("the worker's tests before it:\n" + "\n".join(began[-12:-1]))
    shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if XDIST_WORKER:  # both workers sort alike: their collections must be the same list
        rank = {name: i for i, name in enumerate(LONGEST_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole files to a worker (their module fixtures are built once), and every file of one `xdist_group` to the
    same worker, one after another (the sandbox tests, which look for any sandboxed program left running)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the order of pytest_collection_modifyitems, not by number of tests

    class FileOrGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # `--dist loadgroup` suffixes marked tests with @group
                return nodeid.split("@")[-1]
            return nodeid.split("::", 1)[0]

    return FileOrGroup(config, log)


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Explain how a key-value cache speeds up autoregressive decoding.",
    "Quantization stores weights in fewer bits per value.",
    "Hello, how are you today? I am fine, thank you!",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model_dir(path: Path, *, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """A random Llama-architecture checkpoint (safetensors + tokenizer) small enough for unit tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture()
def tiny_loaded(tiny_model_dir):
    from infer_tune import models

    return models.load(str(tiny_model_dir))


@pytest.fixture()
def prompts_file(tmp_path) -> Path:
    """A small JSONL suite with prompts and references."""
    import json

    rows = [{"prompt": f"Question {i}: what is {i} plus {i}?", "reference": f"{i} plus {i} is {2 * i}."}
            for i in range(6)]
    path = tmp_path / "suite.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


REAL_HOME = Path(os.environ.get("INFER_TUNE_HOME") or Path.home() / ".cache" / "infer-tune").expanduser()


@pytest.fixture(scope="session")
def _test_home(tmp_path_factory) -> Path:
    """One temporary INFER_TUNE_HOME for the session. Models and suites already provisioned in the
    real cache (SmolLM2, by `make test`) are linked in and only read; everything a test writes
    (bandwidth readings, converted suites, GGUF conversions) stays in the temp home."""
    home = tmp_path_factory.mktemp("infer-tune-home")
    # provisioned entries (and built binaries: bin/llama-server) are linked (read), new ones land in the temp home
    for sub in ("models", "data", "bin"):
        (home / sub).mkdir()
        if (REAL_HOME / sub).is_dir():
            for item in (REAL_HOME / sub).iterdir():
                if not item.name.startswith("."):
                    (home / sub / item.name).symlink_to(item)
    if XDIST_WORKER:  # the native kernels compile once for the whole run: both workers build into one folder
        shared = tmp_path_factory.getbasetemp().parent / "kernels"  # native.build_library's flock: one builder
        shared.mkdir(mode=0o700, exist_ok=True)
        (home / "kernels").symlink_to(shared)
    return home


@pytest.fixture(autouse=True)
def _isolated_home(_test_home, monkeypatch):
    monkeypatch.setenv("INFER_TUNE_HOME", str(_test_home))
    yield


@pytest.fixture(scope="session")
def smollm2_available() -> bool:
    return (REAL_HOME / "models" / "smollm2-135m" / "config.json").exists()


@pytest.fixture
def one_thread():
    """One intra-op thread: tiny models gain nothing from more, and on a busy shared CPU thread hand-offs
    cost milliseconds (`pytestmark = pytest.mark.usefixtures("one_thread")` in modules that time them)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _worker_keeps_one_thread():
    """Under xdist a test that runs a command with `threads` set (RunSpec(threads=2)) leaves torch at that count in
    the worker; the next test gets the worker's one thread back."""
    yield
    if XDIST_WORKER:
        import torch

        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_contention_reruns(monkeypatch):
    """A request batch is never run again for contention in tests (rounds.RERUNS): the suite runs on two
    workers, so the host is always busy, and tests that count runner calls would see a rerun at random. The
    rerun rule's own test sets it back."""
    from infer_tune import rounds

    monkeypatch.setattr(rounds, "RERUNS", 0)


@pytest.fixture(autouse=True)
def few_rounds(request, monkeypatch):
    """Tests check behaviour, not intervals: the engine's rounds are capped at the floor (tiny models' passes take
    milliseconds and their ratios never reach a 2% interval, so every sweep would run its whole round
    budget). A test that checks the stopping rule itself is marked `full_rounds`."""
    if request.node.get_closest_marker("full_rounds"):
        return
    import dataclasses

    from infer_tune import rounds

    original = rounds.run_rounds

    def capped(variants, inputs, workload, protocol, **kwargs):
        cap = max(rounds.MIN_ROUNDS, protocol.min_iterations)
        protocol = dataclasses.replace(protocol, max_rounds=min(protocol.max_rounds, cap))
        return original(variants, inputs, workload, protocol, **kwargs)

    monkeypatch.setattr(rounds, "run_rounds", capped)


@pytest.fixture(scope="session")
def native_kernels() -> str:
    """The project's C++ kernels, built (or loaded from the cache) when the first test needs them, not while
    tests are collected. Skipped only where the host cannot build them (no C++ compiler) or they are turned
    off (INFER_TUNE_NO_NATIVE=1); any other failure to build fails the tests that need them, with the reason."""
    from infer_tune import native

    if os.environ.get(native.DISABLE_ENV) == "1":
        pytest.skip(f"native kernels turned off ({native.DISABLE_ENV}=1)")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on this host to build the native kernels")
    ok, detail = native.available()
    if not ok:
        pytest.fail(f"the native kernels did not build: {detail}")
    return detail
