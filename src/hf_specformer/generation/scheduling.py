"""How many of each row's k drafts a verification step checks: the drafts' cumulative probability against a threshold.

Every verified draft costs a row of the target forward, accepted or not, and a drafter's later slots are rarely
right (the shipped SmolLM2 drafter on MT-bench at k = 4: acceptance 0.33, 0.08, 0.02, 0.00), while a prompt-lookup
match, when there is one, often runs for many tokens. With a threshold t > 0 a row verifies its drafts 1..n, where n
is the last position j whose cumulative draft probability q_1(d_1) * ... * q_j(d_j) is at least t, and never fewer
than one. That product is the drafter's own estimate of the chance that drafts 1..j are all accepted; a looked-up
draft has probability 1, so a lookup match is verified as far as it goes. (Speculative Verification calibrates
such signals against a companion model; here the drafter's own probability is the signal.) The step's forward is
as wide as its longest row (1 + max n); a shorter row's further drafts are fed but not verified
(`verification.py`), so a batch pays for its most confident row.

Measured on the CPU testbed (SmolLM2 fp32, 2 threads, B = 1, shipped drafter with prompt lookup, 8 MT-bench prompts
one per category, 128 new tokens, plain `generate` interleaved with each setting; speedup, kappa, drafts verified per
step), in three runs:
    k = 4: t = 0: 1.18x / 1.14x (kappa 1.84, 4.00 drafts);  t = 0.1: 1.24x / 1.26x (1.81, 2.09);
           t = 0.3: 1.29x / 1.31x (1.78, 1.82);  t = 0.03: 1.23x (1.82, 2.55)
    k = 6, t = 0.3: 1.25x (1.88, 2.25);  k = 8, t = 0.1: 1.15x (2.01, 2.91)
    k = 3: t = 0: 1.31x (1.77, 3.00);  t = 0.3: 1.29x (1.71, 1.59)
A threshold pays when k is past what the hardware verifies cheaply. On this CPU a forward of 4 inputs costs what
one of 1 or 2 does and 3 or 5 inputs cost more (`products.py`), so k = 3 without a threshold does as well as any
setting, and `CONFIDENCE_THRESHOLD` is 0: verify all k unless asked.
"""

from __future__ import annotations

import torch

CONFIDENCE_THRESHOLD = 0.0
"""Default threshold on a row's cumulative draft probability (0: every row verifies all k drafts)."""


def num_drafts_to_verify(draft_confidence: torch.Tensor, threshold: float) -> torch.LongTensor:
    """draft_confidence `[B, k]` (q_j(d_j), the probability each draft had when it was chosen) -> `[B]` in 1..k: the
    longest prefix whose cumulative probability is at least `threshold`, at least 1."""
    kept = draft_confidence.double().cumprod(dim=1) >= threshold
    return kept.sum(dim=1).clamp(min=1)
