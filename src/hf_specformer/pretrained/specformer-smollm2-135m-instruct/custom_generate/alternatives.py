"""Other candidates for the first draft: a draft tree of the chain and c branches, verified in the step's one
forward (greedy).

SpecFormer drafts every slot from the context in one forward, so slot 1's next-best tokens cost nothing to draft.
With `alternative_draft=n` (True: 1) and `num_alternatives=c` (default 1), each step that verifies drafts also feeds,
after every row's chain (committed token, drafts d_1 .. d_w), c branches of n inputs: slot 1's 2nd .. (c + 1)-th best
token other than d_1, each followed by the drafter's drafts of slots 2 .. n (the drafter drafts each slot from the
context alone, so they are the tokens it would draft after any first token), at slots 1 .. n's positions. A branch
attends to the committed prefix, the committed token and itself, never to the chain's drafts or another branch (a
4D attention mask). Where a row's first draft is rejected and one of its alternatives (distinct tokens) equals the
target's correction, that branch is verified like a chain: its drafts are accepted while they equal the target's
greedy token after the input before them, and the target's token after the last accepted one is committed. Every
committed token is the target's own greedy choice on the committed prefix, so the output is what greedy decoding
gives; such a step commits one token or more beyond the chain's.

After verification the branch taken has its cache columns and hidden states moved to the chain's drafts' places
(`move_alternatives`), so the rest of the step (cache validity, the proposer's context, the companion's state) sees
an ordinary chain that accepted the branch's drafts.

Headroom, measured before building it (`examples/draft_tree_headroom.py`, teacher-forced, shipped drafter, k = 3):
kappa 1.646 on MT-bench's answers, 1.779 with a branch of 1, 1.817 with a branch of 3, 1.894 with two branches of 3
(held-out chat answers: 1.945, 2.083, 2.127, 2.204).

Choices: the alternatives are the best tokens of the drafter's raw slot-1 logits other than the first draft
(whether the network or a lookup drafted it), and the tails the argmax of its raw logits; which tokens they are only
decides how often a branch helps, never what is committed. A branch is at most as long as the step's widest chain,
and a row verifies at most as many of a branch's inputs as of its chain's. Greedy decoding without per-row seeds only
(sampling would need multi-draft rejection sampling), logits processors that do not read the prefix (a branch's
prefix is not the chain's), and attention that takes a 4D mask (`sdpa`, `eager`); the engine refuses the rest. The
goodput scheduler's step costs and acceptance estimates do not count the branches (a call with them learns its own
steps' costs but does not cache them for later calls). On the CPU testbed at B = 1 a step's fifth input costs about
10 ms against 31 ms for four, so branches do not pay there (within four inputs, k = 2 and a branch of 1, one breaks
even); they are meant for hardware where a step's extra inputs are nearly free.
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


def alternative_branches(logits: torch.Tensor, draft_ids: torch.LongTensor, length: int,
                         count: int) -> torch.LongTensor:
    """The drafter's raw logits `[B, k, V]` and the chain's drafts `[B, w]` -> `count` branches `[B, count, length]`:
    the best slot-1 tokens other than the first draft, best first, each followed by the drafter's own drafts of
    slots 2 .. length (its argmax: where a lookup drafted the chain, the lookup's drafts follow its own first token)."""
    ranked = logits[:, 0].topk(count + 1, dim=-1).indices  # [B, count + 1]
    first_draft_last = (ranked == draft_ids[:, :1]).long().argsort(dim=1, stable=True)
    alternatives = ranked.gather(1, first_draft_last)[:, :count]  # [B, count]
    tail = logits[:, 1:length].argmax(-1)  # [B, length - 1]
    return torch.cat([alternatives[:, :, None], tail[:, None].expand(-1, count, -1)], dim=2)


def branch_mask(attention_mask: torch.LongTensor, chain_inputs: int, count: int, length: int, dtype: torch.dtype):
    """The step's additive mask `[B, 1, T, S + T]` from its 2D one `[B, S + T]` (`RaggedBatch.step_inputs`), for
    T = chain_inputs + count * length inputs: the chain (committed token, drafts), then `count` branches of `length`
    inputs. Causal in cache order minus hidden columns; a branch sees the committed token and itself, never the
    chain's drafts nor another branch."""
    num_inputs = chain_inputs + count * length
    total = attention_mask.shape[1]
    past = total - num_inputs
    device = attention_mask.device
    inputs = torch.arange(num_inputs, device=device)
    groups = torch.where(inputs < chain_inputs, 0, 1 + (inputs - chain_inputs).div(length, rounding_mode="floor"))
    same_group = groups[:, None] == groups[None, :]  # [T, T]; group 0: the chain
    same_group[:, 0] = True  # the committed token
    keys = torch.arange(total, device=device)
    allowed = keys[None, :] <= torch.arange(past, total, device=device)[:, None]  # [T, S + T]
    allowed[:, past:] &= same_group
    allowed = allowed[None] & attention_mask[:, None, :].bool()  # every input sees itself: new columns are visible
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def alternative_inputs(step_ids: torch.LongTensor, attention_mask: torch.LongTensor, position_ids: torch.LongTensor,
                       verified: torch.BoolTensor, branches: torch.LongTensor, dtype: torch.dtype):
    """A step's chain inputs (ids `[B, w + 1]`; from `RaggedBatch.step_inputs(T)` the 2D mask `[B, S + T]` and
    positions `[B, T]`; `verified` `[B, w + 1]` on the host) with the branches `[B, c, m]` appended, T = w + 1 + c * m
    -> (ids `[B, T]`, the 4D mask `branch_mask`, positions with each branch at slots 1 .. m's, verified `[B, T]`: a
    branch input where the chain's input at its slot is)."""
    chain_inputs, (count, length) = step_ids.shape[1], branches.shape[1:]
    position_ids = torch.cat([position_ids[:, :chain_inputs], position_ids[:, 1 : 1 + length].repeat(1, count)],
                             dim=1)
    verified = torch.cat([verified, verified[:, 1 : 1 + length].repeat(1, count)], dim=1)
    mask = branch_mask(attention_mask, chain_inputs, count, length, dtype)
    return torch.cat([step_ids, branches.flatten(1)], dim=1), mask, position_ids, verified


def take_alternatives(tokens: torch.LongTensor, num_accepted: torch.LongTensor, branches: torch.LongTensor,
                      branch_predictions: torch.LongTensor, num_drafts: torch.LongTensor):
    """A chain's greedy verification (`verify_greedy`: tokens `[B, w + 1]`, num_accepted `[B]`) with the branches
    `[B, c, m]`, the target's greedy token after each branch input `[B, c, m]` and the drafts each row verifies `[B]`
    -> (tokens, num_accepted, taken `[B]`, choice `[B]`): a row whose first draft was rejected and one of whose
    alternatives (distinct tokens) equals its correction takes that branch, `choice`, verified as a chain (its input j
    counts where the row verifies j + 1 drafts)."""
    length = branches.shape[2]
    matching = (branches[:, :, 0] == tokens[:, :1]) & ((num_accepted == 0) & (num_drafts > 0))[:, None]  # [B, c]
    taken, choice = matching.any(dim=1), matching.long().argmax(dim=1)
    rows = torch.arange(branches.shape[0], device=branches.device)
    branch, predictions = branches[rows, choice], branch_predictions[rows, choice]  # [B, m] each
    verified = torch.arange(length, device=branch.device)[None, :] < num_drafts[:, None]  # [B, m]
    matches = (predictions[:, :-1] == branch[:, 1:]) & verified[:, 1:]
    accepted = 1 + matches.long().cumprod(dim=1).sum(dim=1)  # [B] in 1 .. m
    last = predictions.gather(1, (accepted - 1)[:, None])  # [B, 1]
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    padded = torch.nn.functional.pad(branch, (0, tokens.shape[1] - length), value=EMPTY_SLOT)
    branch_tokens = torch.where(positions < accepted[:, None], padded, torch.where(positions == accepted[:, None],
                                                                                   last, EMPTY_SLOT))
    return (torch.where(taken[:, None], branch_tokens, tokens), torch.where(taken, accepted, num_accepted), taken,
            choice)


def move_alternatives(cache: PreallocatedCache, hidden_states: tuple | None, taken: torch.BoolTensor,
                      choice: torch.LongTensor, chain_inputs: int, num_inputs: int, length: int) -> tuple | None:
    """Moves each row's branch `choice` `[B]` (of the step's `num_inputs` inputs, those from `chain_inputs + choice *
    length` on) to the chain's drafts' places (inputs 1 .. length) in the rows `taken` `[B]`: in every layer's cache
    and in the step's recorded hidden states `[B, T, d]` (None, or None entries, stay None). Returns the hidden
    states."""
    sources = chain_inputs + choice[:, None] * length + torch.arange(length, device=choice.device)  # [B, m]
    cache.move_columns(taken, sources - num_inputs, target=1 - num_inputs)
    if hidden_states is None:
        return None
    chain = slice(1, 1 + length)
    index = sources[:, :, None]
    return tuple(None if states is None else
                 torch.cat([states[:, :1], torch.where(taken[:, None, None],
                                                       states.gather(1, index.expand(-1, -1, states.shape[2])),
                                                       states[:, chain]),
                            states[:, 1 + length:]], dim=1)
                 for states in hidden_states)
