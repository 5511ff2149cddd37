"""The trainers' optimisation: AdamW parameter groups and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hf_specformer.training.config import DrafterTrainingConfig


def warmup_cosine(total_steps: int, warmup_ratio: float, min_ratio: float) -> Callable[[int], float]:
    """LambdaLR factor: linear warm-up over `ceil(warmup_ratio * total_steps)` steps, then cosine to `min_ratio`."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_optimizer(drafter: torch.nn.Module, config: DrafterTrainingConfig,
                    new_parameters: frozenset[str] = frozenset()) -> torch.optim.AdamW:
    """AdamW with weight decay on the weight matrices only; the parameters named in `new_parameters` at
    `config.new_parameter_learning_rate_scale` times the learning rate."""
    groups = []
    for is_new in (False, True):
        lr = config.learning_rate * (config.new_parameter_learning_rate_scale if is_new else 1.0)
        parameters = [p for name, p in drafter.named_parameters()
                      if p.requires_grad and (name in new_parameters) == is_new]
        groups += [
            {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": config.weight_decay, "lr": lr},
            {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0, "lr": lr},
        ]
    return torch.optim.AdamW([group for group in groups if group["params"]], lr=config.learning_rate,
                             eps=config.adam_eps)
