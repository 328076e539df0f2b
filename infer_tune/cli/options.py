"""Shared options, spelled the same on every measuring command (DESIGN.md, "Common options")."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Model = Annotated[str, typer.Option("--model", "-m", help="Built-in alias (smollm2-135m), Hugging Face id, checkpoint dir or .gguf file.")]
Suite = Annotated[str, typer.Option("--suite", "-s", help="`chat` (ShareGPT), `code` (HumanEval), a .jsonl/.csv/.parquet file or a dataset name.")]
Limit = Annotated[int, typer.Option("--limit", "-n", help="Number of prompts, picked deterministically by --seed.")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="Tokens generated per request (pinned for timing).")]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", help="Requests per generate call (left-padded).")]
Threads = Annotated[int | None, typer.Option("--threads", help="torch intra-op threads (default: physical cores).")]
Seed = Annotated[int, typer.Option("--seed", help="Seed for prompt sampling and bootstrap.")]
Warmup = Annotated[int, typer.Option("--warmup", help="Untimed warmup generate calls (the first is reported as first_call_ms).")]
MinIterations = Annotated[int, typer.Option("--min-iterations", help="Minimum timed passes over the workload.")]
MinDuration = Annotated[float, typer.Option("--min-duration", help="Minimum timed seconds; passes repeat until both minimums are met.")]
Out = Annotated[Path, typer.Option("--out", "-o", help="Runs directory; each run writes OUT/<run-id>/result.json.")]
Json = Annotated[bool, typer.Option("--json", help="Print only the result document(s) as JSON on stdout.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]
Lang = Annotated[str, typer.Option("--lang", help="Language of chat prompts: en, zh, ja, ko, ru or any.")]
PromptField = Annotated[str, typer.Option("--prompt-field", help="Prompt column of a file/dataset suite.")]
ReferenceField = Annotated[str | None, typer.Option("--reference-field", help="Reference column of a file/dataset suite.")]
ChatTemplate = Annotated[bool, typer.Option("--chat-template/--no-chat-template", help="Wrap prompts in the model's chat template when it has one.")]
MaxPromptTokens = Annotated[int, typer.Option("--max-prompt-tokens", help="Skip prompts longer than this (in tokens).")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16.")]
Device = Annotated[str, typer.Option("--device", help="cpu, cuda or auto.")]
TrustRemoteCode = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the checkpoint (off by default).")]
Ppl = Annotated[bool, typer.Option("--ppl/--no-ppl", help="Teacher-forced perplexity on the references.")]
Resume = Annotated[bool, typer.Option("--resume", help="Skip configs whose result already exists in --out.")]
Execute = Annotated[bool, typer.Option("--execute", help="code suite: run HumanEval's tests on the outputs (pass@1) in sandboxed subprocesses.")]
