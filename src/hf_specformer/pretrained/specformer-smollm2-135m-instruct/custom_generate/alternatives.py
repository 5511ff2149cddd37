"""A second candidate for the first draft: a two-branch draft tree verified in the step's one forward (greedy).

SpecFormer drafts every slot from the context in one forward, so slot 1's second-best token costs nothing to draft.
With `alternative_draft=n` (True: 1), each step that verifies drafts also feeds, after every row's chain (committed
token, drafts d_1 .. d_w), a branch of n inputs: that token, then the chain's drafts d_2 .. d_n (the drafter drafts
each slot from the context alone, so they are the tokens it would draft after the alternative too), at slots 1 .. n's
positions. The branch attends to the committed prefix, the committed token and itself, never to the chain's drafts
(a 4D attention mask). Where a row's first draft is rejected and its alternative equals the target's correction,
the branch is verified like a chain: its drafts are accepted while they equal the target's greedy token after the
input before them, and the target's token after the last accepted one is committed. Every committed token is the
target's own greedy choice on the committed prefix, so the output is what greedy decoding gives; such a step commits
one token or more beyond the chain's.

After verification the branch's cache columns and hidden states are moved to the chain's drafts' places
(`move_alternatives`), so the rest of the step (cache validity, the proposer's context, the companion's state) sees
an ordinary chain that accepted the branch's drafts.

Headroom, measured before building it (`examples/draft_tree_headroom.py`, teacher-forced, shipped drafter, k = 3):
kappa 1.646 on MT-bench's answers, 1.779 with a branch of 1, 1.817 with a branch of 3 (held-out chat answers: 1.945,
2.083, 2.127).

Choices: the alternative is the best token of the drafter's raw slot-1 logits other than the first draft (whether
the network or a lookup drafted it); which token it is only decides how often it helps, never what is committed. A
branch is at most as long as the step's widest chain, and a row verifies at most as many of its inputs as of its
chain's. Greedy decoding without per-row seeds only (sampling would need multi-draft rejection sampling), logits
processors that do not read the prefix (the branch's prefix is not the chain's), and attention that takes a 4D mask
(`sdpa`, `eager`); the engine refuses the rest. The goodput scheduler's step costs and acceptance estimates do not
count the branch (a call with it learns its own steps' costs but does not cache them for later calls). On the CPU
testbed at B = 1 a step's fifth input costs about 10 ms against 31 ms for four, so the branch does not pay there
(within four inputs, k = 2 and a branch of 1, it breaks even); it is meant for hardware where a step's extra inputs
are nearly free.
"""

from __future__ import annotations

import torch

from .attention import GQA_SDPA
from .caching import PreallocatedCache
from .verification import EMPTY_SLOT

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", GQA_SDPA)
"""The target attention implementations that take the alternative's 4D mask (`GQA_SDPA`: SDPA as the engine switches
it in on the CPU, `attention.GroupedQueryAttention`)."""


def check_alternative_draft(model, processor, do_sample: bool) -> None:
    """Raises `ValueError` where the alternative would not be exact (see the module docstring)."""
    if do_sample:
        raise ValueError("alternative_draft verifies a second first draft greedily: it needs do_sample=False.")
    if processor.reads_prefix:
        raise ValueError("alternative_draft needs logits processors that do not read the prefix (a repetition "
                         "penalty, for one, would score the alternative as if it followed the chain's drafts).")
    implementation = model.config._attn_implementation
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError("alternative_draft needs attention that takes a 4D mask (sdpa or eager); "
                         f"the target uses {implementation!r}.")


def alternative_branch(first_logits: torch.Tensor, draft_ids: torch.LongTensor, length: int) -> torch.LongTensor:
    """Slot 1's logits `[B, V]` and the chain's drafts `[B, w]` -> the branch `[B, length]`: the best slot-1 token
    other than the first draft, then the drafts of slots 2 .. length."""
    best_two = first_logits.topk(2, dim=-1).indices
    alternatives = torch.where(best_two[:, 0] == draft_ids[:, 0], best_two[:, 1], best_two[:, 0])
    return torch.cat([alternatives[:, None], draft_ids[:, 1:length]], dim=1)


def branch_mask(attention_mask: torch.LongTensor, num_inputs: int, chain_inputs: int, dtype: torch.dtype):
    """The step's additive mask `[B, 1, T, S + T]` from its 2D one `[B, S + T]` (`RaggedBatch.step_inputs`), for
    T = num_inputs inputs of which the first `chain_inputs` are the chain (committed token, drafts) and the others
    the branch: causal in cache order minus hidden columns, and the branch blind to the chain's drafts."""
    total = attention_mask.shape[1]
    past = total - num_inputs
    device = attention_mask.device
    keys = torch.arange(total, device=device)
    allowed = keys[None, :] <= torch.arange(past, total, device=device)[:, None]  # [T, S + T]
    allowed[chain_inputs:, past + 1 : past + chain_inputs] = False
    allowed = allowed[None] & attention_mask[:, None, :].bool()  # every input sees itself: new columns are visible
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def alternative_inputs(step_ids: torch.LongTensor, attention_mask: torch.LongTensor, position_ids: torch.LongTensor,
                       verified: torch.BoolTensor, branch: torch.LongTensor, dtype: torch.dtype):
    """A step's chain inputs (ids `[B, w + 1]`; from `RaggedBatch.step_inputs(T)` the 2D mask `[B, S + T]` and
    positions `[B, T]`; `verified` `[B, w + 1]` on the host) with the branch `[B, m]` appended, T = w + 1 + m ->
    (ids `[B, T]`, the 4D mask `branch_mask`, positions with the branch at slots 1 .. m's, verified `[B, T]`: a
    branch input where the chain's input at its slot is)."""
    chain_inputs, length = step_ids.shape[1], branch.shape[1]
    position_ids = torch.cat([position_ids[:, :chain_inputs], position_ids[:, 1 : 1 + length]], dim=1)
    verified = torch.cat([verified, verified[:, 1 : 1 + length]], dim=1)
    mask = branch_mask(attention_mask, chain_inputs + length, chain_inputs, dtype)
    return torch.cat([step_ids, branch], dim=1), mask, position_ids, verified


def take_alternatives(tokens: torch.LongTensor, num_accepted: torch.LongTensor, branch: torch.LongTensor,
                      branch_predictions: torch.LongTensor, num_drafts: torch.LongTensor):
    """A chain's greedy verification (`verify_greedy`: tokens `[B, w + 1]`, num_accepted `[B]`) with the branch
    `[B, m]`, the target's greedy token after each branch input `[B, m]` and the drafts each row verifies `[B]` ->
    (tokens, num_accepted, taken `[B]`): a row whose first draft was rejected and whose alternative equals its
    correction takes the branch, verified as a chain (its input j counts where the row verifies j + 1 drafts)."""
    length = branch.shape[1]
    verified = torch.arange(length, device=branch.device)[None, :] < num_drafts[:, None]  # [B, m]
    taken = verified[:, 0] & (num_accepted == 0) & (branch[:, 0] == tokens[:, 0])
    matches = (branch_predictions[:, :-1] == branch[:, 1:]) & verified[:, 1:]
    accepted = 1 + matches.long().cumprod(dim=1).sum(dim=1)  # [B] in 1 .. m
    last = branch_predictions.gather(1, (accepted - 1)[:, None])  # [B, 1]
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    padded = torch.nn.functional.pad(branch, (0, tokens.shape[1] - length), value=EMPTY_SLOT)
    branch_tokens = torch.where(positions < accepted[:, None], padded, torch.where(positions == accepted[:, None],
                                                                                   last, EMPTY_SLOT))
    return (torch.where(taken[:, None], branch_tokens, tokens), torch.where(taken, accepted, num_accepted), taken)


def move_alternatives(cache: PreallocatedCache, hidden_states: tuple | None, taken: torch.BoolTensor,
                      num_inputs: int, branch_length: int) -> tuple | None:
    """Moves the branch (the last `branch_length` of the step's `num_inputs` inputs) to the chain's drafts' places
    (inputs 1 .. branch_length) in the rows `taken` `[B]`: in every layer's cache and in the step's recorded hidden
    states `[B, T, d]` (None, or None entries, stay None). Returns the hidden states."""
    for index in range(branch_length):
        cache.move_column(taken, source=index - branch_length, target=1 + index - num_inputs)
    if hidden_states is None:
        return None
    chain = slice(1, 1 + branch_length)
    return tuple(None if states is None else
                 torch.cat([states[:, :1], torch.where(taken[:, None, None], states[:, -branch_length:],
                                                       states[:, chain]),
                            states[:, 1 + branch_length:]], dim=1)
                 for states in hidden_states)
