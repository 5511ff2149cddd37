"""`generate_batch`: many requests in one speculative call with continuous batching (transformers' own takes no
assistant model); each output is handed over the step it finishes, greedy ones equal to plain `generate`'s.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.utils.logging import tqdm
from transformers import GenerationConfig

from .generate import generate
from .proposers import NoDrafts
from .speculation import SpeculationConfig
from .stats import FinishedRow
from .validation import max_new_tokens, resolved_config, resolved_pad_token_id

FINISH_REASONS = ("eos", "length", "stop")
"""Why a request ended: an end-of-sequence token, `max_new_tokens`, or a stop string / stopping criterion."""


@dataclass
class RequestOutput:
    """One request's result."""

    prompt_ids: list[int]
    generated_tokens: list[int]  # EOS included if it ended on one
    finish_reason: str  # one of `FINISH_REASONS`
    steps: int  # target forwards after its prefill
    accepted_drafts: int

    @property
    def tokens_per_step(self) -> float:
        """kappa of this request: tokens committed per step (1.0 without speculation)."""
        return (self.steps + self.accepted_drafts) / self.steps if self.steps else 1.0


class _Progress:
    """The outputs as they come, a progress bar with tokens/s and kappa, and the caller's `on_output`."""

    def __init__(self, inputs: list[list[int]], eos: set[int], max_new_tokens: int, show: bool,
                 on_output: Callable[[int, RequestOutput], None] | None):
        self.inputs, self.eos, self.max_new_tokens, self.on_output = inputs, eos, max_new_tokens, on_output
        self.outputs: list[RequestOutput | None] = [None] * len(inputs)
        self.bar = tqdm(total=len(inputs), unit="request", desc="generate_batch", disable=not show)
        self.start = time.perf_counter()
        self.tokens = self.steps = self.accepted = 0

    def __call__(self, row: FinishedRow) -> None:
        tokens = row.tokens
        reason = "eos" if tokens and tokens[-1] in self.eos else "length" if len(tokens) >= self.max_new_tokens \
            else "stop"
        output = self.outputs[row.row] = RequestOutput(list(self.inputs[row.row]), tokens, reason, row.steps,
                                                       row.accepted)
        self.tokens, self.steps, self.accepted = self.tokens + len(tokens), self.steps + row.steps, \
            self.accepted + row.accepted
        seconds = time.perf_counter() - self.start
        self.bar.set_postfix(tok_s=f"{self.tokens / seconds:.1f}",
                             kappa=f"{(self.steps + self.accepted) / max(self.steps, 1):.2f}", refresh=False)
        self.bar.update(1)
        if self.on_output is not None:
            self.on_output(row.row, output)


def generate_batch(model, inputs: list[list[int]], generation_config: GenerationConfig | None = None,
                   assistant_model=None, max_batch_size: int | None = 16, progress_bar: bool = True,
                   on_output: Callable[[int, RequestOutput], None] | None = None, seeds: list[int] | None = None,
                   speculation_config: SpeculationConfig | dict | None = None, **kwargs) -> list[RequestOutput]:
    """Speculative generation for `inputs` (token-id lists), `max_batch_size` rows at a time with continuous batching;
    other arguments as `hf_specformer.generate` takes them (no `assistant_model`: plain steps). Returns one
    `RequestOutput` per request, in input order.

    Args:
        on_output: called as `on_output(index, output)` as each request finishes.
        seeds: one int per request (with `do_sample=True`): a sampled text then depends on its own seed alone.
        speculation_config: as `generate` takes it; its `memory_budget` caps the slots at as many as fit (with
            `max_batch_size=None` the budget alone sets them).
    """
    if not inputs or any(not isinstance(ids, (list, tuple)) or not ids for ids in inputs):
        raise ValueError("inputs must be a non-empty list of non-empty token-id lists.")
    config, _ = resolved_config(model, generation_config, dict(kwargs))
    pad = resolved_pad_token_id(config)
    pad = 0 if pad is None else pad
    width = max(map(len, inputs))
    input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in inputs], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in inputs], device=model.device)
    eos = config.eos_token_id
    eos = set() if eos is None else set(eos) if isinstance(eos, list) else {eos}
    progress = _Progress(inputs, eos, max_new_tokens(config, width), progress_bar, on_output)
    speculation = SpeculationConfig(**speculation_config) if isinstance(speculation_config, dict) \
        else speculation_config or SpeculationConfig()
    speculation = dataclasses.replace(speculation, max_batch_size=max_batch_size)
    try:
        generate(model, input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config,
                 assistant_model=NoDrafts() if assistant_model is None else assistant_model,
                 speculation_config=speculation, row_finished=progress, sampling_seeds=seeds,
                 **{**kwargs, "pad_token_id": pad})
    finally:
        progress.bar.close()
    return progress.outputs
