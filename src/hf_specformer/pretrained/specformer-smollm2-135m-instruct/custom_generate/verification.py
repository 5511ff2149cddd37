"""Lossless acceptance of a chain of drafts: greedy matching and speculative (rejection) sampling.

*Accepted* drafts are the longest prefix the target keeps; then comes the target's *correction* (at a rejection) or
*bonus* token (after k). Sampling follows Leviathan et al. 2023, Algorithm 1 (u * q <= p in float64; the correction
from norm(max(p - q, 0)) by inverse CDF, as the Triton kernel draws it). Each function returns `tokens [B, k + 1]`
(`EMPTY_SLOT` after the committed ones) and `num_accepted [B]`.
"""

from __future__ import annotations

import torch

try:  # optional fused kernels of the hf_specformer package; absent where this file runs as Hub remote code
    import hf_specformer.kernels as _kernels
except ImportError:
    _kernels = None

KERNEL_BACKENDS = _kernels.BACKENDS if _kernels is not None else ("auto", "torch")
"""Kernel backends (`hf_specformer.kernels`); `triton` needs the installed package, not only this remote code."""

EMPTY_SLOT = -1


def _committed(draft_ids: torch.LongTensor, num_accepted: torch.LongTensor, last_token: torch.LongTensor):
    """drafts `[B, k]`, num_accepted `[B]`, last_token `[B]` (correction/bonus) -> tokens `[B, k + 1]`."""
    batch, k = draft_ids.shape
    positions = torch.arange(k + 1, device=draft_ids.device)[None, :]
    tokens = torch.cat([draft_ids, draft_ids.new_full((batch, 1), EMPTY_SLOT)], dim=1)
    tokens = torch.where(positions == num_accepted[:, None], last_token[:, None], tokens)
    return tokens.masked_fill(positions > num_accepted[:, None], EMPTY_SLOT)


def _verified(draft_ids: torch.LongTensor, num_drafts: torch.LongTensor | None) -> torch.BoolTensor:
    """`[B, k]`: True where position j < num_drafts[b] (everywhere when num_drafts is None)."""
    if num_drafts is None:
        return torch.ones_like(draft_ids, dtype=torch.bool)
    return torch.arange(draft_ids.shape[1], device=draft_ids.device) < num_drafts[:, None]


def _kernels_for(tensor: torch.Tensor, backend: str | None):
    """The fused Triton kernels where installed and `backend` (None: `HF_SPECFORMER_KERNELS`) picks them for
    `tensor`; None: the PyTorch code below."""
    if _kernels is None or not _kernels.use_triton(tensor, backend):
        return None
    return _kernels.load("verification")


def resolved_backend(tensor: torch.Tensor, backend: str | None) -> str:
    """"triton" or "torch" for `tensor` under `backend`, resolved once per call."""
    return "torch" if _kernels_for(tensor, backend) is None else "triton"


def greedy_tokens(scores: torch.Tensor) -> torch.LongTensor:
    """`scores.argmax(-1)` (the first of equal maxima, or the first NaN): through NumPy on the CPU, where it is
    vectorised, else through `max`, both faster than torch's `argmax`."""
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64) and not scores.requires_grad:
        return torch.from_numpy(scores.numpy().argmax(-1))
    return scores.max(dim=-1).indices


def _num_drafts(draft_ids: torch.LongTensor, num_drafts: torch.LongTensor | None) -> torch.LongTensor:
    if num_drafts is not None:
        return num_drafts
    return torch.full(draft_ids.shape[:1], draft_ids.shape[1], dtype=torch.long, device=draft_ids.device)


def verify_greedy(draft_ids: torch.LongTensor, target_scores: torch.Tensor, num_drafts: torch.LongTensor | None = None,
                  kernel_backend: str | None = None):
    """draft_ids `[B, k]`, target_scores `[B, k + 1, V]`, num_drafts `[B]` (None: all k) -> tokens `[B, k + 1]`,
    num_accepted `[B]`. `kernel_backend`: one of `KERNEL_BACKENDS` (None: `HF_SPECFORMER_KERNELS`)."""
    kernels = _kernels_for(target_scores, kernel_backend)
    if kernels is not None:
        return kernels.greedy_verification(draft_ids, target_scores, _num_drafts(draft_ids, num_drafts), EMPTY_SLOT)
    predictions = greedy_tokens(target_scores)  # [B, k + 1]
    if not draft_ids.shape[1]:  # a plain step: nothing to accept
        return predictions, predictions.new_zeros(predictions.shape[0])
    positions = torch.arange(predictions.shape[1], device=predictions.device)
    matches = draft_ids == predictions[:, :-1]
    if num_drafts is not None:
        matches &= positions[:-1] < num_drafts[:, None]
    num_accepted = matches.byte().cumprod(dim=1).sum(dim=1)
    # accepted drafts equal the target's own tokens, so the committed ones are its predictions up to the first miss
    return predictions.masked_fill(positions > num_accepted[:, None], EMPTY_SLOT), num_accepted


def verify_sampling(draft_ids: torch.LongTensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                    num_drafts: torch.LongTensor | None = None, generator: torch.Generator | None = None,
                    kernel_backend: str | None = None):
    """Speculative sampling for a batch of chains.

    Args:
        draft_ids: `[B, k]` drafted tokens (sampled from `draft_probs`; k = 0 is a plain sampling step).
        draft_probs: `[B, k, V]` q, the processed draft distributions the drafts were sampled from.
        target_probs: `[B, k + 1, V]` p, the processed target distributions at the k drafted positions and after.
        num_drafts: `[B]` drafts verified per row (None: all k).
        generator: the source of the uniforms (torch's default generator when None).
        kernel_backend: one of `KERNEL_BACKENDS` (None: `HF_SPECFORMER_KERNELS`).
    Returns:
        tokens `[B, k + 1]`, num_accepted `[B]`.
    """
    batch, k = draft_ids.shape
    uniforms = torch.rand((batch, k + 1), dtype=torch.float64, device=target_probs.device, generator=generator)
    kernels = _kernels_for(target_probs, kernel_backend)
    if kernels is not None:
        return kernels.sampling_verification(draft_ids, draft_probs, target_probs, _num_drafts(draft_ids, num_drafts),
                                             uniforms[:, :k], uniforms[:, k], EMPTY_SLOT)
    p = target_probs[:, :k].gather(2, draft_ids[..., None]).squeeze(2).double()  # [B, k]
    q = draft_probs.gather(2, draft_ids[..., None]).squeeze(2).double()
    verified = _verified(draft_ids, num_drafts)
    accepted = (uniforms[:, :k] * q <= p) & (q > 0) & verified
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)

    # The distribution of the last committed token: residual at the first rejection, p after the verified drafts.
    rows = torch.arange(batch, device=draft_ids.device)
    p_last = target_probs[rows, num_accepted].double()  # [B, V]
    q_last = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, p_last.shape[-1])], dim=1)[rows, num_accepted]
    q_last = q_last.double() * torch.cat([verified, verified.new_zeros(batch, 1)], dim=1)[rows, num_accepted, None]
    residual = (p_last - q_last).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q exactly: rejection impossible, keep p
    residual = torch.where(empty, p_last.clamp(min=0), residual)
    return _committed(draft_ids, num_accepted, _inverse_cdf(residual, uniforms[:, k])), num_accepted


def _inverse_cdf(mass: torch.Tensor, uniform: torch.Tensor) -> torch.LongTensor:
    """mass `[B, V]` (unnormalised, float64), uniform `[B]` in [0, 1) -> `[B]` the first token whose cumulative mass
    exceeds uniform * total (a token of positive mass; the last one where rounding leaves none)."""
    cdf = mass.cumsum(-1)
    chosen = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
    positions = torch.arange(mass.shape[-1], device=mass.device)
    last_positive = torch.where(mass > 0, positions, 0).amax(-1)
    return torch.minimum(chosen, last_positive)
