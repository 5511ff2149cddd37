"""How tokens are chosen from processed scores: argmax, a sample, or a seeded sample that depends only on its row.

`TokenSelector` serves the prefill's first token, the drafts and verification. Greedy: argmax, and verification
accepts a draft that equals the target's argmax. Sampling: torch's generator, and verification is rejection
sampling against the drafts' distribution (`verification.verify_sampling`); a row's draws then depend on the whole
batch (which rows share it, what was drafted).

Seeded sampling (`seeds`, one per row) makes a row's text depend only on its seed, its prompt and the model:
Gumbel-max with noise keyed by (seed, generated position, token). The token at generated position n of a row with
seed s is argmax_x(score(x) + G(s, n, x)), with G i.i.d. standard Gumbel noise from a counter-based hash computed on
the device: an exact sample of softmax(score) (logits processors, temperature and top-p included). The noise of a
position is fixed before any draft is seen, so verification is greedy against the perturbed scores: a draft is
accepted iff it is the token the row samples there. The text is then the same whatever was drafted, whichever rows
shared the batch, whether the call speculated at all. Drafts are coupled to the same noise (the drafter's token at a
position is the argmax of its own scores plus that position's noise), so a drafter close to the target proposes the
very token the target will sample. The uniforms have 24 bits (float32), so probabilities below about 2^-24 are
drawn slightly too rarely; the hash costs a few integer operations per (row, position, token) per step.
"""

from __future__ import annotations

import torch

from .batch import RaggedBatch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX_1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX_2 = -7723592293110705685  # 0x94D049BB133111EB


def _shift_right(x: torch.LongTensor, bits: int) -> torch.LongTensor:
    """Logical right shift of int64 values (torch's `>>` is arithmetic on signed integers)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.LongTensor) -> torch.LongTensor:
    """SplitMix64's finaliser on int64 (multiplications wrap around), a bijection that scatters every input bit."""
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    return x ^ _shift_right(x, 31)


def gumbel_noise(seeds: torch.LongTensor, positions: torch.LongTensor, vocab_size: int) -> torch.Tensor:
    """`[B, T, V]` float32 standard Gumbel noise for rows with `seeds` `[B]` at generated `positions` `[B, T]`: the
    same (seed, position, token) always gives the same value, on any device and in any batch."""
    keys = _mix(_mix(seeds[:, None] * _GOLDEN + positions) + _GOLDEN)  # [B, T]
    tokens = torch.arange(vocab_size, device=seeds.device) * _GOLDEN
    bits = _shift_right(_mix(keys[..., None] + tokens), 40)  # [B, T, V], 24 bits
    uniform = (bits.float() + 0.5) * 2.0**-24
    return -torch.log(-torch.log(uniform))


class TokenSelector:
    """Chooses tokens from processed scores: argmax (`do_sample` False), a sample from torch's generator, or seeded.

    Args:
        do_sample: sample rather than take the argmax.
        seeds: `[B0]` one seed per row of the call (None: torch's generator); needs `do_sample` (`generate` checks
            the seeds).
    """

    def __init__(self, do_sample: bool, seeds: torch.LongTensor | None = None):
        self.do_sample = do_sample
        self.seeds = seeds

    @property
    def rejection_sampling(self) -> bool:
        """Whether verification samples against the drafts' distribution (unseeded sampling), rather than greedy
        verification of the (seeded: perturbed) scores."""
        return self.do_sample and self.seeds is None

    def scores_to_verify(self, scores: torch.Tensor, batch: RaggedBatch, offset: int = 0) -> torch.Tensor:
        """`[B, T, V]` scores whose argmax at input j is the token each active row takes at generated position
        `num_generated + offset + j`: the scores themselves, plus the rows' noise when seeded."""
        if self.seeds is None:
            return scores
        rows = batch.row_ids
        positions = batch.num_generated[rows, None] + offset + torch.arange(scores.shape[1], device=rows.device)
        return scores + gumbel_noise(self.seeds[rows], positions, scores.shape[-1])

    def __call__(self, scores: torch.Tensor, batch: RaggedBatch, offset: int = 0) -> torch.LongTensor:
        """`[B, T, V]` scores at generated positions `num_generated + offset + j` -> `[B, T]` tokens."""
        if not self.rejection_sampling:
            return self.scores_to_verify(scores, batch, offset).argmax(-1)
        return torch.multinomial(scores.flatten(0, 1).softmax(-1), 1).view(scores.shape[:2])
