"""Helpers shared by the training tests: tiny learnable targets, datasets, a small training configuration, the
metrics log, a free port, and the one-thread fixture (import it into a test module to apply it there)."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, make_target
from datasets import Dataset

from hf_specformer.training.config import DrafterTrainingConfig

CYCLE = list(range(10, 17))


@pytest.fixture(autouse=True)
def single_thread():
    """One torch thread: on a small, shared CPU, more threads make these tiny models many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def learnable_target() -> torch.nn.Module:
    """The tiny random Llama with its (frozen) lm_head scaled up: at the init std of 0.02 the head's logits span
    about +-1, so no drafter could bring the loss much below log(V)."""
    target = make_target()
    target.lm_head.weight.mul_(25)
    return target


def repetitive_dataset(num_rows: int = 16, response_length: int = 24, seed: int = 0) -> Dataset:
    """Prompts of 3 random tokens; the reply cycles through `CYCLE` from an offset set by the prompt, so every
    future reply token follows from the current one (learnable in a few steps)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        prompt = [1, rng.randrange(3, TINY_VOCAB), rng.randrange(3, TINY_VOCAB)]
        reply = [CYCLE[(prompt[1] + i) % len(CYCLE)] for i in range(response_length)]
        rows.append({"input_ids": prompt + reply, "prompt_length": len(prompt)})
    return Dataset.from_list(rows)


def random_dataset(num_rows: int = 6, length: int = 40, seed: int = 0) -> Dataset:
    """Uniformly random tokens: no drafter can predict them."""
    rng = random.Random(seed)
    rows = [{"input_ids": [rng.randrange(3, TINY_VOCAB) for _ in range(length)], "prompt_length": 5}
            for _ in range(num_rows)]
    return Dataset.from_list(rows)


def make_config(output_dir: Path, **overrides) -> DrafterTrainingConfig:
    """A small, fast configuration for the tiny targets."""
    values = dict(
        data="unused", output_dir=str(output_dir), target="unused", draft_length=4, max_steps=30,
        per_device_batch_size=4, learning_rate=3e-3, min_learning_rate=1e-4, warmup_ratio=0.1, max_length=64,
        positions_per_sequence=8, eval_fraction=0.2, eval_every=0, save_every=0, save_dtype="float32", num_threads=1,
    )
    values.update(overrides)
    return DrafterTrainingConfig(**values)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
