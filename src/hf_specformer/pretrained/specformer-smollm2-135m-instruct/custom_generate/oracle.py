"""`OracleProposer`: drafts from a known continuation (e.g. the target's greedy output), the engine's ceiling
whatever the drafter: the benchmark's `--oracle` mode and the tests' exact or corrupted drafts.
"""

from __future__ import annotations

import torch

from .drafting import Proposal, Proposer


class OracleProposer(Proposer):
    """Proposes `continuations[b, n : n + k]` for a row that has generated n tokens; `pad_token_id` past the end.

    Args:
        continuations: `[B0, N]` the tokens each row is expected to generate (e.g. the target's greedy output).
        vocab_size: V of the returned one-hot logits.
    """

    def __init__(self, continuations: torch.LongTensor, num_draft_tokens: int, vocab_size: int, pad_token_id: int):
        super().__init__(num_draft_tokens)
        padding = continuations.new_full((continuations.shape[0], num_draft_tokens + 1), pad_token_id)
        self.continuations = torch.cat([continuations, padding], dim=1)
        self.vocab_size = vocab_size

    def propose(self, batch, hidden_states, position_ids, source_index, draft=True) -> Proposal:
        if not draft:
            return Proposal()
        rows = batch.row_ids
        columns = batch.num_generated[rows, None] + torch.arange(self.num_draft_tokens, device=rows.device)
        columns = columns.clamp(max=self.continuations.shape[1] - 1)
        draft_ids = self.continuations.to(rows.device)[rows[:, None], columns]  # [B, k]
        logits = torch.full((rows.numel(), self.num_draft_tokens, self.vocab_size), float("-inf"), device=rows.device)
        return Proposal(logits.scatter_(2, draft_ids[..., None], 0.0))
