"""Classifying greedy mismatches between speculative and plain decoding in low precision: a tie or a bug.

In bfloat16/float16 a verification forward of k + 1 tokens per row and plain decoding's forward of one token run
different kernels (other shapes, other summation orders), so their logits differ by rounding. Where the target's
two best tokens are nearly tied, the argmax can flip and the two outputs diverge from there on: both are correct
greedy decodings of the model, up to the precision it runs in. A true bug (a wrong cache column, a draft accepted
that the target did not choose) instead picks a token the target clearly does not rank first.

`classify_mismatch` finds the first position where two rows differ, runs the target alone on the common prefix
(the prompt's real tokens plus the shared output) in its own dtype, and calls the mismatch a tie when both tokens'
logits are within `tie_tolerance` of the best logit. The tolerance is `TIE_ULPS` units in the last place of the
dtype at the size of the best logit: a few roundings of the final logits, not a gap the model means. (The choice is
ours: the papers are silent; vLLM and SGLang compare low-precision outputs by text similarity instead.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

TIE_ULPS = 4
"""Units in the last place (at the best logit's magnitude) within which two logits count as tied. On SmolLM2 in
bfloat16 (CPU, MT-bench, 128 tokens) the flips measured lie within 0 to 2.5 of them (`bench/smollm2_cpu_bf16.json`)."""


def tie_tolerance(dtype: torch.dtype, best_logit: float) -> float:
    """`TIE_ULPS` ulps of `dtype` at `best_logit`'s magnitude (at least at 1)."""
    return TIE_ULPS * torch.finfo(dtype).eps * max(abs(best_logit), 1.0)


@dataclass
class Mismatch:
    """The first difference between two outputs of one prompt.

    Attributes:
        position: index among the new tokens where they first differ.
        expected, actual: the token ids there (plain, speculative).
        gap: best logit minus the lower of the two tokens' logits, from the target alone on the common prefix.
        tolerance: `tie_tolerance` there.
        tie: whether both tokens are within the tolerance of the best logit.
    """

    position: int
    expected: int
    actual: int
    gap: float
    tolerance: float
    tie: bool

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def classify_mismatch(
    target, prompt_ids: torch.LongTensor, prompt_mask: torch.Tensor, expected: torch.LongTensor,
    actual: torch.LongTensor, pad_token_id: int | None = None,
) -> Mismatch | None:
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
