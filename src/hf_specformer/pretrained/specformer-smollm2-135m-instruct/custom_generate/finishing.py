"""Rows reported as they finish: a call's `row_finished` callback receives each row's tokens the step it ends.

A long call (continuous batching over many prompts, `admission.py`) should hand each answer over as soon as it is
complete, so that a batch job writes it at once (nothing finished is lost on an interruption) and a progress bar
moves row by row. Rows finish on the device; the count of rows still live, which every step reads anyway
(`RaggedBatch.refresh`), shows when some have, and only then are the finished rows read: one more host read on a
step where rows end, none on the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .batch import RaggedBatch
from .stats import SpecStats


@dataclass
class FinishedRow:
    """One row that has ended.

    Attributes:
        row: its index among the call's rows (input order).
        tokens: the tokens it generated, its end-of-sequence token included if it ended on one.
        steps: verification steps it took part in while generating (the prefill is not one).
        accepted: drafts it accepted.
    """

    row: int
    tokens: list[int]
    steps: int
    accepted: int


class FinishedRows:
    """Tells `callback` (None: nobody) of each row once, on the step it finishes."""

    def __init__(self, callback: Callable[[FinishedRow], None] | None):
        self.callback = callback
        self.admitted = 0
        self.reported: set[int] = set()

    def admit(self, num_rows: int) -> None:
        """`num_rows` more rows have joined the batch."""
        self.admitted += num_rows

    def report(self, batch: RaggedBatch, stats: SpecStats, reads: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Calls back for the rows that finished since the last report (`batch.num_live` as of its last refresh;
        finished rows stay in the batch until this has seen them: `RaggedBatch.rows_to_keep` drops them later)."""
        if self.callback is None or self.admitted - batch.num_live <= len(self.reported):
            return
        rows = batch.row_ids
        steps, accepted = stats.row_counts(rows)
        counts = torch.stack([batch.finished.long(), rows, batch.num_generated[rows], steps, accepted], dim=1)
        table = reads(torch.cat([counts, batch.tokens[rows, batch.prompt_width:]], dim=1)).tolist()
        for finished, row, count, row_steps, row_accepted, *tokens in table:
            if finished and row not in self.reported:
                self.reported.add(row)
                self.callback(FinishedRow(row, tokens[:count], row_steps, row_accepted))

    def report_padded(self, generated: torch.LongTensor, eos_token_id, pad_token_id: int) -> None:
        """Calls back for every row of `generated` (`[B, N]`, from transformers' own loop, which pads after each row's
        end; `eos_token_id` an int, a list or None): a row ends after its first end-of-sequence token, else before
        its trailing padding (a row that ended on a stop string and then generated the pad token itself would lose
        it: only that loop knows where its rows ended). Each step committed one token, the first came from the
        prefill."""
        if self.callback is None:
            return
        eos = set() if eos_token_id is None else set(torch.as_tensor(eos_token_id).flatten().tolist())
        for row, tokens in enumerate(generated.tolist()):
            end = next((position + 1 for position, token in enumerate(tokens) if token in eos), None)
            if end is None:
                end = len(tokens)
                while end and tokens[end - 1] == pad_token_id:
                    end -= 1
            self.callback(FinishedRow(row, tokens[:end], max(end - 1, 0), 0))
