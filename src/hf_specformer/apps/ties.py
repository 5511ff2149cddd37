"""Classifying greedy mismatches between speculative and plain decoding in low precision: a tie or a bug.

In bfloat16 a forward of k + 1 tokens rounds differently from one of 1 token, so a near tie can flip the argmax.
`classify_mismatch` reruns the target on the common prefix: a tie when both tokens are within `TIE_ULPS` ulps of the
best logit, else a bug.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

TIE_ULPS = 4
"""Units in the last place (at the best logit's magnitude) within which two logits count as tied (SmolLM2's bfloat16
flips measured 0 to 2.5 of them: docs/log.md)."""


def tie_tolerance(dtype: torch.dtype, best_logit: float) -> float:
    """`TIE_ULPS` ulps of `dtype` at `best_logit`'s magnitude (at least at 1)."""
    return TIE_ULPS * torch.finfo(dtype).eps * max(abs(best_logit), 1.0)


@dataclass
class Mismatch:
    """The first difference between two outputs of one prompt, its logit gap, the tolerance and the verdict."""

    position: int
    expected: int
    actual: int
    gap: float
    tolerance: float
    tie: bool

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def classify_mismatch(target, prompt_ids: torch.LongTensor, prompt_mask: torch.Tensor, expected: torch.LongTensor,
                      actual: torch.LongTensor, pad_token_id: int | None = None) -> Mismatch | None:
    """prompt_ids, prompt_mask `[P]` (left padded), expected and actual `[N]` new tokens of one row -> the first
    mismatch, or None when they agree (positions where both rows hold `pad_token_id` after their end are equal)."""
    differs = (expected != actual).nonzero().flatten()
    if differs.numel() == 0:
        return None
    position = int(differs[0])
    prefix = torch.cat([prompt_ids[prompt_mask.bool()], expected[:position]])
    logits = target(prefix[None]).logits[0, -1].float()
    best = float(logits.max())
    token_a, token_b = int(expected[position]), int(actual[position])
    tolerance = tie_tolerance(target.dtype, best)
    gap = best - min(float(logits[token_a]), float(logits[token_b]))
    tie = gap <= tolerance and token_b != pad_token_id and token_a != pad_token_id
    return Mismatch(position, token_a, token_b, gap, tolerance, tie)


def classify_rows(target, input_ids, attention_mask, expected_sequences, actual_sequences,
                  pad_token_id: int | None = None) -> list[Mismatch]:
    """Every mismatched row of a batch (`[B, P]` prompts, `[B, P + N]` sequences of both runs; the narrower one is
    padded with `pad_token_id` when an EOS flipped)."""
    width = input_ids.shape[1]
    total = max(expected_sequences.shape[1], actual_sequences.shape[1])
    expected_sequences, actual_sequences = (
        torch.nn.functional.pad(s, (0, total - s.shape[1]), value=-1 if pad_token_id is None else pad_token_id)
        for s in (expected_sequences, actual_sequences)
    )
    found = []
    for row in range(input_ids.shape[0]):
        mismatch = classify_mismatch(target, input_ids[row], attention_mask[row], expected_sequences[row, width:],
                                     actual_sequences[row, width:], pad_token_id)
        if mismatch is not None:
            found.append(mismatch)
    return found
