"""The training objective: sampled positions, per-slot labels (the reply's future tokens), cross-entropy, feature and
soft-label losses, and their intra-batch gradient accumulation (`intra_batch_backward`)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hf_specformer.models.specformer import SpecFormerForDrafting
from hf_specformer.training.data import Batch

IGNORE_INDEX = -100
"""Label of positions without a target token (cross-entropy skips them)."""


def sample_positions(lengths: Sequence[int], prompt_lengths: Sequence[int], per_sequence: int,
                     rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `per_sequence` random positions t per sequence (0: all) whose x_{t+2} lies in the reply, in random order
    -> positions `[B, P]` (padded with 0) and their validity `[B, P]`."""
    chosen = []
    for length, prompt_length in zip(lengths, prompt_lengths):
        valid = range(max(int(prompt_length) - 2, 0), int(length) - 2)
        chosen.append(rng.sample(valid, len(valid) if per_sequence == 0 else min(per_sequence, len(valid))))
    width = max(1, max(len(picked) for picked in chosen))
    positions = torch.zeros((len(chosen), width), dtype=torch.long)
    mask = torch.zeros((len(chosen), width), dtype=torch.bool)
    for row, picked in enumerate(chosen):
        positions[row, : len(picked)] = torch.tensor(picked, dtype=torch.long)
        mask[row, : len(picked)] = True
    return positions, mask


def slot_labels(batch: Batch, positions: torch.Tensor, mask: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Labels `[B, P, l_d]`: x_{t+2+j} for slot j at position t, `-100` outside the reply, past the sequence's end
    or at padded positions."""
    index = positions[..., None] + 2 + torch.arange(num_slots, device=positions.device)  # [B, P, l_d]
    tokens = batch.input_ids.gather(1, index.clamp(max=batch.input_ids.shape[1] - 1).flatten(1)).view_as(index)
    inside = (index < batch.lengths[:, None, None]) & (index >= batch.prompt_lengths[:, None, None])
    return tokens.masked_fill(~(inside & mask[..., None]), IGNORE_INDEX)


def draft_vocab_labels(labels: torch.Tensor, draft_vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """Labels as columns of the draft vocabulary `draft_vocab_ids` `[V_d]`; tokens outside it become -100."""
    if draft_vocab_ids is None:
        raise ValueError("Scoring the draft vocabulary needs one: `set_draft_vocab` (or `draft_vocab_size`).")
    column = torch.full((int(draft_vocab_ids.max()) + 1,), IGNORE_INDEX, dtype=torch.long, device=labels.device)
    column[draft_vocab_ids.to(labels.device)] = torch.arange(draft_vocab_ids.numel(), device=labels.device)
    inside = (labels >= 0) & (labels < column.numel())
    return torch.where(inside, column[labels.clamp(0, column.numel() - 1)], IGNORE_INDEX)


def slot_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (in float32 at least) of logits `[..., V]` against labels `[...]` over the labels != -100
    (0 if there are none)."""
    logits = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    total = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


class SlotLosses(NamedTuple):
    """Losses of one micro-batch (floats): `total = mean_j (cross_entropy[j] + w_f * feature[j] + w_s * soft[j])`."""

    total: float
    cross_entropy: list[float]
    feature: list[float]
    soft: list[float]


def slot_feature_loss(normalized: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean smooth-L1 (summed over d) between normalized slot states `[..., d]` and the target's last hidden states
    `[..., d]` over the entries whose `labels` `[...]` are not -100 (0 if there are none)."""
    dtype = torch.promote_types(normalized.dtype, torch.float32)
    distance = F.smooth_l1_loss(normalized.to(dtype), targets.to(dtype), reduction="none").sum(-1)
    valid = labels != IGNORE_INDEX
    return (distance * valid).sum() / valid.sum().clamp(min=1)


def slot_soft_label_loss(logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean forward KL(p || q) from the target's next-token distribution to the drafter's (`[..., V]` logits each)
    where `labels` are not -100 (DistillSpec, arXiv 2310.08461)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    log_q = logits.to(dtype).log_softmax(-1)
    log_p = target_logits.to(dtype).log_softmax(-1)
    divergence = (log_p.exp() * (log_p - log_q)).sum(-1)
    valid = labels != IGNORE_INDEX
    return (divergence * valid).sum() / valid.sum().clamp(min=1)


def intra_batch_backward(drafter: SpecFormerForDrafting, slot_hidden: torch.Tensor, labels: torch.Tensor,
                         backward: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                         feature_targets: torch.Tensor | None = None, feature_weight: float = 0.0,
                         num_ce_positions: int = 0, soft_label_weight: float = 0.0,
                         draft_vocab_loss: bool = False) -> SlotLosses:
    """Backward of `mean_j (CE_j + w_f * feature_j + w_s * soft_j)`, one slot's `[B, P, V]` logits at a time (paper
    sec. 3): the gradients of the whole loss while only one slot's logits live.

    Args:
        slot_hidden: slot states `[B, P, l_d, d]` still attached to the SpecFormer graph.
        labels: `[B, P, l_d]`, -100 where a slot has no target token.
        backward: `backward(tensor, gradient)` for the final backward (e.g. `accelerator.backward`'s wrapper).
        feature_targets: `[B, P, l_d, d]` the target's last hidden state predicting each slot's label (for w_f, w_s).
        num_ce_positions: the cross-entropy and soft labels cover the first this many of the P positions (0: all).
    """
    num_slots = slot_hidden.shape[2]
    ce_columns = slice(0, num_ce_positions or None)
    detached = slot_hidden.detach().requires_grad_()
    scores = drafter.draft_vocab_logits if draft_vocab_loss else drafter.compute_logits
    head = drafter.draft_head() if draft_vocab_loss else drafter.head_logits
    ce_labels = draft_vocab_labels(labels, drafter.draft_vocab_ids) if draft_vocab_loss else labels
    cross_entropy, feature, soft = [], [], []
    for slot in range(num_slots):
        states, slot_targets = detached[:, :, slot], ce_labels[:, :, slot]
        logits = scores(states[:, ce_columns])
        loss = slot_cross_entropy(logits, slot_targets[:, ce_columns])
        cross_entropy.append(loss.detach())
        if soft_label_weight > 0:
            with torch.no_grad():
                target_logits = head(feature_targets[:, ce_columns, slot].to(logits.dtype))
            soft_loss = slot_soft_label_loss(logits, target_logits, slot_targets[:, ce_columns])
            soft.append(soft_loss.detach())
            loss = loss + soft_label_weight * soft_loss
        if feature_weight > 0:
            feature_loss = slot_feature_loss(drafter.normalize(states), feature_targets[:, :, slot], labels[:, :, slot])
            feature.append(feature_loss.detach())
            loss = loss + feature_weight * feature_loss
        (loss / num_slots).backward()
    (backward or torch.Tensor.backward)(slot_hidden, detached.grad)
    cross_entropy = torch.stack(cross_entropy).tolist()
    feature = torch.stack(feature).tolist() if feature else [0.0] * num_slots
    soft = torch.stack(soft).tolist() if soft else [0.0] * num_slots
    total = sum(ce + feature_weight * f + soft_label_weight * s
                for ce, f, s in zip(cross_entropy, feature, soft)) / num_slots
    return SlotLosses(total, cross_entropy, feature, soft)
