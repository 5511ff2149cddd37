"""Continuous batching: which waiting rows join the running batch, and when.

A call may hold more rows than it decodes at once (`SpeculationConfig.max_batch_size`, the slots). The engine
starts with the first rows that fit and admits waiting rows as running rows finish (`engine._admit`: their prefill as
a forward of their own, whose caches then join the batch's), so no slot idles while rows wait; plain `generate`
keeps every row of a static batch until its slowest finishes.

When: once at least `min_free` slots are free, an eighth of the slots by default. An admission costs a prefill forward
of its rows (which they need anyway) plus a fixed part: one more forward call, the proposer's deferred work run early,
and the joined caches' copy of the new rows. Admitting as each row finishes would pay that fixed part per row; waiting
for a quarter of the slots would leave an eighth idle on average. Rows are admitted in the order given (the batch
job sorts its prompts by length, so rows admitted together have prompts of similar widths).

How many slots: `max_batch_size`, or with `memory_budget` as many as fit in it at `slot_bytes` each.
"""

from __future__ import annotations

from collections import deque

import torch

from .caching import cache_capacity, kv_bytes_per_column
from .drafting import Proposer

ADMISSION_SHARE = 8
"""Rows are admitted once 1 / ADMISSION_SHARE of the slots (at least one) are free."""


VOCABULARY_COPIES = 4
"""Vocabulary-wide tensors a step holds per verified position at once, counted for a slot's memory: the target's
logits, the processed scores, probabilities, and the drafts' (a conservative count: greedy steps hold fewer)."""


def slot_bytes(model: torch.nn.Module, proposer: Proposer, prompt_width: int, max_new_tokens: int) -> int:
    """Most bytes one slot (a decoding row) takes in a call: its columns of the target's and the proposer's caches
    (`cache_capacity` of them), `VOCABULARY_COPIES` vocabulary-wide tensors per verified position, and the hidden
    states its prefill records at `prompt_width` positions (`forwards.recorded_hidden_states`: those the proposer
    reads, and the last, which a companion reads). The model's weights and the call's token ids are not counted:
    they do not grow with the slots."""
    config = model.config.get_text_config()
    k, size = proposer.num_draft_tokens, model.dtype.itemsize
    per_column = kv_bytes_per_column(config, config.num_hidden_layers, model.dtype) + proposer.cache_bytes_per_column()
    logits = VOCABULARY_COPIES * (k + 1) * config.vocab_size * size
    recorded = proposer.hidden_state_indices | {config.num_hidden_layers}
    prefill_states = len(recorded) * prompt_width * config.hidden_size * size
    return cache_capacity(prompt_width, max_new_tokens, k) * per_column + logits + prefill_states


class Admissions:
    """The rows waiting for a slot, in order.

    Args:
        prompt_lengths: real (unpadded) prompt tokens of every row of the call, on the host.
        slots: the most rows decoded at once.
    """

    def __init__(self, prompt_lengths: list[int], slots: int):
        if slots < 1:
            raise ValueError(f"slots={slots} must be at least 1.")
        self.prompt_lengths = prompt_lengths
        self.slots = slots
        self.min_free = max(1, slots // ADMISSION_SHARE)
        self.waiting = deque(range(len(prompt_lengths)))

    def due(self, num_live: int) -> list[int]:
        """The rows to admit now, given `num_live` rows still generating (none: an empty list)."""
        free = self.slots - num_live
        if not self.waiting or free < min(self.min_free, len(self.waiting)) and num_live:
            return []
        return [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]

    def width(self, rows: list[int]) -> int:
        """Prompt columns the prefill of `rows` needs: their longest prompt (at least 1)."""
        return max(1, max(self.prompt_lengths[row] for row in rows))

    def prompt_mask(self, rows: list[int]) -> torch.BoolTensor:
        """`[n, width(rows)]` on the host: True at the real (left-padded) prompt tokens of `rows` in their prefill."""
        width = self.width(rows)
        lengths = torch.tensor([self.prompt_lengths[row] for row in rows])
        return torch.arange(width) >= width - lengths[:, None]
