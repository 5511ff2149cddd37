"""Committing a step's tokens to the rows: EOS, max_new_tokens and the caller's stopping criteria, token by token."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .batch import RaggedBatch


class Committer:
    """Appends committed tokens to rows, cutting them at EOS, at max_new_tokens and at extra stopping criteria.

    `EosTokenCriteria` and `MaxLengthCriteria` are handled here token by token, vectorised; any other criterion
    (stop strings, user criteria) is evaluated on each row's prefix after every committed token, so a row stops at
    exactly the token where plain `generate` would have stopped.
    """

    def __init__(self, stopping_criteria, generation_config: GenerationConfig, max_new_tokens: int, streamer):
        self.extra_criteria = StoppingCriteriaList(
            c for c in stopping_criteria or [] if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))
        )
        self.eos_token_ids = generation_config._eos_token_tensor
        self.pad_token_id = pad_token_id(generation_config)
        self.max_new_tokens = max_new_tokens
        self.streamer = streamer

    def __call__(self, batch: RaggedBatch, tokens: torch.LongTensor, counts: torch.LongTensor) -> torch.BoolTensor:
        """tokens `[B, n]`, counts `[B]` (1..n) -> finished `[B]`; writes the kept tokens into `batch`. Rows already
        `batch.finished` commit nothing."""
        offsets = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        finished = batch.finished.clone()
        counts = counts.masked_fill(finished, 0)
        if self.eos_token_ids is not None:
            is_eos = torch.isin(tokens, self.eos_token_ids.to(tokens.device)) & (offsets < counts[:, None])
            first_eos = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, counts)
            finished |= is_eos.any(1)
            counts = torch.minimum(counts, first_eos)
        remaining = self.max_new_tokens - batch.num_generated[batch.row_ids]
        finished |= counts >= remaining
        counts = torch.minimum(counts, remaining)
        if self.extra_criteria:
            batch.write(tokens)
            counts, finished = self._apply_extra_criteria(batch, counts, finished)
        batch.commit_tokens(tokens.masked_fill(offsets >= counts[:, None], self.pad_token_id), counts)
        if self.streamer is not None:
            self.streamer.put(tokens[0, : int(counts[0])].cpu())
        return finished

    def _apply_extra_criteria(self, batch, counts, finished):
        prefix = batch.prefix_lengths()
        stopped = torch.zeros_like(finished)
        for j in range(1, int(counts.max()) + 1):
            candidates = (~stopped & (counts >= j)).nonzero().squeeze(1)
            for length in (prefix[candidates] + j).unique().tolist():
                rows = candidates[prefix[candidates] + j == length]
                hit = self.extra_criteria(batch.tokens[batch.row_ids[rows], :length], None).to(rows.device)
                stopped[rows[hit]] = True
                counts[rows[hit]] = j
        return counts, finished | stopped


def pad_token_id(generation_config: GenerationConfig) -> int:
    pad = generation_config._pad_token_tensor
    return int(pad) if pad is not None else 0
