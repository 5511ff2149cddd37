"""Fused verification kernels: one program per row streams the target's (and the drafter's) distributions over the
vocabulary in blocks of `BLOCK` and writes the row's committed tokens and accepted count.

Both follow their references in `generation/verification.py`; sampling accumulates the CDF in float64 block by
block, so a token can differ from the reference's `torch.cumsum` only within rounding of a CDF step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""Vocabulary entries a program reads per step."""


@triton.jit
def _greedy_kernel(scores_ptr, drafts_ptr, num_drafts_ptr, tokens_ptr, accepted_ptr, num_positions, vocab_size,
                   empty_slot, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    num_slots = num_positions - 1
    verified = tl.load(num_drafts_ptr + row)
    offsets = tl.arange(0, BLOCK)
    still = tl.full((), 1, tl.int32)
    num_accepted = tl.full((), 0, tl.int64)
    for j in range(0, num_positions):
        base = scores_ptr + (row * num_positions + j) * vocab_size
        best_value = tl.full((), float("-inf"), tl.float32)
        best_index = tl.full((), 0, tl.int64)
        for start in range(0, vocab_size, BLOCK):
            columns = start + offsets
            values = tl.load(base + columns, mask=columns < vocab_size, other=float("-inf")).to(tl.float32)
            block_best = tl.max(values, axis=0)
            block_index = tl.argmax(values, axis=0).to(tl.int64) + start
            better = block_best > best_value
            best_index = tl.where(better, block_index, best_index)
            best_value = tl.where(better, block_best, best_value)
        is_slot = j < num_slots
        draft = tl.load(drafts_ptr + row * num_slots + j, mask=is_slot, other=-1)
        match = (draft == best_index) & is_slot & (j < verified) & (still == 1)
        token = tl.where(match, draft, tl.where(still == 1, best_index, empty_slot))
        tl.store(tokens_ptr + row * num_positions + j, token)
        num_accepted += match.to(tl.int64)
        still = tl.where(match, 1, 0)
    tl.store(accepted_ptr + row, num_accepted)


def greedy_verification(draft_ids: torch.LongTensor, target_scores: torch.Tensor, num_drafts: torch.LongTensor,
                        empty_slot: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """draft_ids `[B, k]`, target_scores `[B, k + 1, V]`, num_drafts `[B]` -> tokens `[B, k + 1]`, num_accepted
    `[B]` (see `verify_greedy`)."""
    batch, num_positions, vocab_size = target_scores.shape
    tokens = torch.empty(batch, num_positions, dtype=torch.long, device=target_scores.device)
    accepted = torch.empty(batch, dtype=torch.long, device=target_scores.device)
    if batch:
        _greedy_kernel[(batch,)](target_scores.contiguous(), draft_ids.contiguous(), num_drafts.contiguous(), tokens,
                                 accepted, num_positions, vocab_size, empty_slot,
                                 BLOCK=min(BLOCK, triton.next_power_of_2(vocab_size)))
    return tokens, accepted


@triton.jit
def _sampling_kernel(target_ptr, draft_ptr, drafts_ptr, num_drafts_ptr, uniforms_ptr, last_uniform_ptr, tokens_ptr,
                     accepted_ptr, num_positions, vocab_size, empty_slot, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    num_slots = num_positions - 1
    verified = tl.load(num_drafts_ptr + row)
    offsets = tl.arange(0, BLOCK)
    still = tl.full((), 1, tl.int32)
    num_accepted = tl.full((), 0, tl.int64)
    for j in range(0, num_slots):
        draft = tl.load(drafts_ptr + row * num_slots + j)
        p = tl.load(target_ptr + (row * num_positions + j) * vocab_size + draft).to(tl.float64)
        q = tl.load(draft_ptr + (row * num_slots + j) * vocab_size + draft).to(tl.float64)
        u = tl.load(uniforms_ptr + row * num_slots + j)
        ok = (u * q <= p) & (q > 0) & (j < verified) & (still == 1)
        tl.store(tokens_ptr + row * num_positions + j, tl.where(ok, draft, empty_slot))
        num_accepted += ok.to(tl.int64)
        still = tl.where(ok, 1, 0)
    tl.store(tokens_ptr + row * num_positions + num_slots, empty_slot)

    # The last token: residual max(p - q, 0) at the first rejection (q only where the draft was verified), p after.
    position = num_accepted
    subtract = (position < verified).to(tl.float64)
    draft_position = tl.minimum(position, tl.maximum(num_slots - 1, 0))
    p_base = target_ptr + (row * num_positions + position) * vocab_size
    q_base = draft_ptr + (row * num_slots + draft_position) * vocab_size
    residual_total = tl.full((), 0.0, tl.float64)
    p_total = tl.full((), 0.0, tl.float64)
    for start in range(0, vocab_size, BLOCK):
        columns = start + offsets
        inside = columns < vocab_size
        p = tl.load(p_base + columns, mask=inside, other=0.0).to(tl.float64)
        q = tl.load(q_base + columns, mask=inside, other=0.0).to(tl.float64)
        residual_total += tl.sum(tl.maximum(p - subtract * q, 0.0), axis=0)
        p_total += tl.sum(tl.maximum(p, 0.0), axis=0)
    empty = residual_total <= 0  # p == q exactly: rejection impossible, keep p
    subtract = tl.where(empty, 0.0, subtract)
    goal = tl.load(last_uniform_ptr + row) * tl.where(empty, p_total, residual_total)
    running = tl.full((), 0.0, tl.float64)
    chosen = tl.full((), -1, tl.int64)
    last_positive = tl.full((), 0, tl.int64)
    for start in range(0, vocab_size, BLOCK):
        columns = start + offsets
        inside = columns < vocab_size
        p = tl.load(p_base + columns, mask=inside, other=0.0).to(tl.float64)
        q = tl.load(q_base + columns, mask=inside, other=0.0).to(tl.float64)
        mass = tl.maximum(p - subtract * q, 0.0)
        cdf = running + tl.cumsum(mass, axis=0)
        crossing = (cdf > goal) & (mass > 0) & inside
        first = tl.min(tl.where(crossing, columns.to(tl.int64), vocab_size), axis=0)
        chosen = tl.where((chosen < 0) & (first < vocab_size), first, chosen)
        last_positive = tl.maximum(last_positive, tl.max(tl.where(mass > 0, columns.to(tl.int64), 0), axis=0))
        running += tl.sum(mass, axis=0)
    chosen = tl.where(chosen < 0, last_positive, chosen)
    tl.store(tokens_ptr + row * num_positions + position, chosen)
    tl.store(accepted_ptr + row, num_accepted)


def sampling_verification(draft_ids: torch.LongTensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                          num_drafts: torch.LongTensor, uniforms: torch.Tensor, last_uniforms: torch.Tensor,
                          empty_slot: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """draft_ids `[B, k]`, draft_probs `[B, k, V]`, target_probs `[B, k + 1, V]`, num_drafts `[B]`, uniforms `[B, k]`
    and last_uniforms `[B]` (float64 in [0, 1)) -> tokens `[B, k + 1]`, num_accepted `[B]` (see `verify_sampling`)."""
    batch, num_positions, vocab_size = target_probs.shape
    tokens = torch.empty(batch, num_positions, dtype=torch.long, device=target_probs.device)
    accepted = torch.empty(batch, dtype=torch.long, device=target_probs.device)
    if num_positions == 1:  # no drafts: the kernel still reads a (never used) draft distribution
        draft_probs = target_probs.new_zeros(batch, 1, vocab_size)
    if batch:
        _sampling_kernel[(batch,)](target_probs.contiguous(), draft_probs.contiguous(), draft_ids.contiguous(),
                                   num_drafts.contiguous(), uniforms.contiguous(), last_uniforms.contiguous(), tokens,
                                   accepted, num_positions, vocab_size, empty_slot,
                                   BLOCK=min(BLOCK, triton.next_power_of_2(vocab_size)))
    return tokens, accepted
