"""Distill a self-draft: teach the target's first N layers to predict the target's own greedy tokens.

An untrained truncated draft is almost never accepted (its hidden state after N layers is not what
the head was trained on). Acceptance under greedy decoding only asks that the draft's argmax equal
the target's, so the draft is trained on exactly that: the target's greedy continuations of real
prompts (end-of-sequence suppressed, as the timed runs decode), with a cross-entropy loss on the
target's chosen token plus a KL term on the target's top-k distribution (knowledge distillation).
Embeddings and head stay frozen (shared with the target's vocabulary); layers and final norm train.

Everything is bounded by a wall-clock budget: data generation gets `data_share` of it, training the
rest; `progress(stage, done, total, info)` reports both (info: loss, samples, steps).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infer_tune.errors import ConfigError
from infer_tune.runners.generation import eos_ids
from infer_tune.tuners.speculate.drafts import self_draft
from infer_tune.workload import encode_batches

DistillProgress = Callable[..., None]


@dataclass
class DistillSettings:
    """How much time, data and which optimizer settings a distillation run uses."""

    layers: int
    minutes: float
    max_new_tokens: int = 64
    data_share: float = 0.4
    gen_batch_size: int = 8
    train_batch_size: int = 4
    lr: float = 3e-4
    top_k: int = 32
    kd_weight: float = 0.5
    seed: int = 0
    max_steps: int | None = None  # stop earlier than the deadline after this many steps (tests, reproducibility)

    def __post_init__(self) -> None:
        if not 0 < self.minutes < float("inf"):
            raise ConfigError(f"distill minutes must be a positive number, got {self.minutes}")
        if self.layers < 1:
            raise ConfigError(f"distill layers must be >= 1, got {self.layers}")
        if not 0 < self.data_share < 1:
            raise ConfigError(f"distill data_share must be between 0 and 1, got {self.data_share}")
        for name in ("max_new_tokens", "gen_batch_size", "train_batch_size", "top_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"distill {name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Sample:
    """One prompt and the target's greedy continuation, with the target's top-k logits per generated token."""

    prompt_id: str
    ids: list[int]  # prompt + generated tokens
    prompt_tokens: int
    top_values: torch.Tensor  # [generated, k]
    top_indices: torch.Tensor  # [generated, k]


def generate_samples(model: torch.nn.Module, tokenizer, prompts: list[tuple[str, str]], settings: DistillSettings,
                     deadline: float, progress: DistillProgress | None = None) -> list[Sample]:
    """The target's greedy continuations of `prompts` ((id, rendered text) pairs) until `deadline`."""
    from transformers import GenerationConfig

    eos = eos_ids(model, tokenizer)
    config = GenerationConfig(max_new_tokens=settings.max_new_tokens, do_sample=False, suppress_tokens=eos or None,
                              pad_token_id=tokenizer.pad_token_id, output_scores=True, return_dict_in_generate=True)
    device = next(model.parameters()).device
    samples: list[Sample] = []
    for start in range(0, len(prompts), settings.gen_batch_size):
        if time.monotonic() >= deadline:
            break
        chunk = prompts[start:start + settings.gen_batch_size]
        batch = encode_batches(tokenizer, [text for _, text in chunk], len(chunk))[0]
        with torch.inference_mode():
            out = model.generate(input_ids=batch["input_ids"].to(device),
                                 attention_mask=batch["attention_mask"].to(device), generation_config=config)
        width = batch["input_ids"].shape[1]
        scores = torch.stack(out.scores, dim=1).float()  # [B, T, V], after the processors (EOS at -inf)
        values, indices = scores.topk(settings.top_k, dim=-1)
        for row, (prompt_id, _) in enumerate(chunk):
            prompt = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
            generated = out.sequences[row, width:].tolist()
            samples.append(Sample(prompt_id, prompt + generated, len(prompt), values[row].cpu(), indices[row].cpu()))
        if progress:
            progress("generate", len(samples), len(prompts), {"samples": len(samples)})
    return samples


def trainable_draft(target: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A copy of the target's first `layers` layers + embeddings, norm and head; embeddings/head frozen."""
    draft = self_draft(target, layers, share=False)
    for param in draft.parameters():
        param.requires_grad_(False)
    base = getattr(draft, draft.base_model_prefix)
    trainable = [m for name, m in base.named_children() if name not in ("embed_tokens", "wte", "wpe", "embed_positions")]
    for module in trainable:
        for param in module.parameters():
            param.requires_grad_(True)
    return draft


def distill_loss(draft: torch.nn.Module, batch: list[Sample], settings: DistillSettings) -> torch.Tensor:
    """Cross-entropy on the target's greedy tokens + kd_weight x KL(target top-k || draft) at generated positions."""
    device = next(draft.parameters()).device
    width = max(len(s.ids) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, sample in enumerate(batch):
        ids[row, :len(sample.ids)] = torch.tensor(sample.ids)
        mask[row, :len(sample.ids)] = 1
    base = getattr(draft, draft.base_model_prefix)
    hidden = base(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state  # [B, S, H]
    rows, cols, targets, top_v, top_i = [], [], [], [], []
    for row, sample in enumerate(batch):
        n = len(sample.ids) - sample.prompt_tokens
        positions = torch.arange(sample.prompt_tokens - 1, sample.prompt_tokens - 1 + n)
        rows.append(torch.full((n,), row))
        cols.append(positions)
        targets.append(torch.tensor(sample.ids[sample.prompt_tokens:]))
        top_v.append(sample.top_values[:n])
        top_i.append(sample.top_indices[:n])
    picked = hidden[torch.cat(rows).to(device), torch.cat(cols).to(device)]  # [N, H]
    logits = draft.get_output_embeddings()(picked).float()  # [N, V]
    hard = torch.nn.functional.cross_entropy(logits, torch.cat(targets).to(device))
    teacher = torch.cat(top_v).to(device).softmax(dim=-1)  # [N, k]
    student = logits.log_softmax(dim=-1).gather(1, torch.cat(top_i).to(device))  # [N, k]
    student = student - student.logsumexp(dim=-1, keepdim=True)  # renormalized over the teacher's top k
    soft = (teacher * (teacher.clamp_min(1e-12).log() - student)).sum(dim=-1).mean()
    return hard + settings.kd_weight * soft


def train(draft: torch.nn.Module, samples: list[Sample], settings: DistillSettings, deadline: float,
          progress: DistillProgress | None = None) -> dict:
    """AdamW steps over shuffled mini-batches until `deadline` (at least one); returns steps, epochs, the
    mean loss of the first and of the last few steps."""
    if not samples:
        raise ConfigError("distill produced no training samples within the time budget; give it more minutes")
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    rng = random.Random(settings.seed)
    order: list[int] = []
    steps, epochs, losses = 0, 0, []
    started = time.monotonic()
    budget = max(deadline - started, 1e-9)
    draft.train()
    while steps == 0 or (time.monotonic() < deadline and (settings.max_steps is None or steps < settings.max_steps)):
        # at least one step, even when generating the data took the whole budget
        if not order:
            order = list(range(len(samples)))
            rng.shuffle(order)
            epochs += 1
        batch = [samples[order.pop()] for _ in range(min(settings.train_batch_size, len(order)))]
        loss = distill_loss(draft, batch, settings)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        steps += 1
        losses.append(float(loss))
        if progress:
            elapsed = time.monotonic() - started
            progress("train", min(elapsed, budget), budget, {"loss": sum(losses[-10:]) / len(losses[-10:]),
                                                           "steps": steps, "epochs": epochs})
    draft.eval()
    for param in draft.parameters():
        param.requires_grad_(False)
    window = max(1, min(10, len(losses) // 4))
    return {"steps": steps, "epochs": epochs, "loss_first": sum(losses[:window]) / window,
            "loss_last": sum(losses[-window:]) / window}
