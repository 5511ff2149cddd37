"""Logits processing over ragged prefixes, position by position.

`generate`'s logits processors see `input_ids` = the row's exact prefix (left-padded prompt + generated tokens), and
some read it: repetition penalty gathers it, min-new-tokens reads its length. In speculative decoding every drafted
position has its own prefix (committed tokens + earlier drafts), and rows of one batch have generated different
numbers of tokens. So scores at position j of row b are processed with `tokens[b, :prefix_length[b] + j]`, the
same input plain `generate` would have given that row at that point. Rows sharing a prefix length go in one call,
made with all B0 rows of the original batch in their original order, because some processors keep per-row state
(repetition penalty's per-row prompt padding); the other rows' results are discarded. Processors that never read
`input_ids` (temperature, top-k, top-p, ...) run once on all positions at once.

As in `generate`, logits are upcast to float32 before processing. The processors are applied one by one rather than
through `LogitsProcessorList.__call__`, which reads every processor's signature on every call (12% of the property
test's time on tiny models, where repetition penalty runs per prefix length); `check_logits_processors` has read
each signature once, before any work, and refused a processor that needs more arguments than `(input_ids, scores)`.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .batch import RaggedBatch

PREFIX_FREE_PROCESSORS = (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)


class RaggedLogitsProcessor:
    """Applies a `LogitsProcessorList` to `[B, T, V]` logits whose position j of row b has prefix length
    `prefix_lengths[b] + j` in `batch.tokens`."""

    def __init__(self, logits_processor: LogitsProcessorList | None):
        self.processors = list(logits_processor or [])
        self.reads_prefix = any(not isinstance(p, PREFIX_FREE_PROCESSORS) for p in self.processors)

    def __call__(self, batch: RaggedBatch, logits: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """logits `[B, T, V]` -> processed float32 scores `[B, T, V]`; offset shifts every prefix by `offset`."""
        scores = logits.to(dtype=torch.float32, copy=True)
        if not self.processors:
            return scores
        batch_size, num_positions, vocab = scores.shape
        if not self.reads_prefix:
            dummy_ids = batch.tokens[:1, :1].expand(batch_size * num_positions, 1)
            return self._apply(dummy_ids, scores.view(-1, vocab)).view(batch_size, num_positions, vocab)
        prefix_lengths = batch.prefix_lengths() + offset
        all_rows = scores.new_zeros(batch.tokens.shape[0], vocab)  # processors may keep per-row state (B0 rows)
        for length in prefix_lengths.unique().tolist():
            rows = (prefix_lengths == length).nonzero().squeeze(1)
            token_rows = batch.row_ids[rows]
            for j in range(num_positions):
                all_rows[token_rows] = scores[rows, j]
                scores[rows, j] = self._apply(batch.tokens[:, : length + j], all_rows)[token_rows]
        return scores

    def _apply(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids `[N, L]`, scores `[N, V]` -> every processor applied in order, `[N, V]`."""
        for processor in self.processors:
            scores = processor(input_ids, scores)
        return scores
