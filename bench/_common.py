"""Shared set-up for the toolkit's own benchmarks (not tests): model, prompts and batches."""

from __future__ import annotations

import argparse

from infer_tune import models
from infer_tune.scenarios.common import setup_threads
from infer_tune.sweep import prepare_inputs
from infer_tune.workload import Workload


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--suite", default="chat")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    return p


def setup(args):
    setup_threads(args.threads)
    loaded = models.load(args.model)
    workload = Workload(suite=args.suite, limit=args.limit, max_new_tokens=args.max_new_tokens)
    return loaded, prepare_inputs(loaded, workload)
