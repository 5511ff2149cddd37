"""A second candidate for the first draft: a two-branch draft tree verified in the step's one forward (greedy).

SpecFormer drafts every slot from the context in one forward, so slot 1's second-best token costs nothing to draft.
With `alternative_draft=True`, each step that verifies drafts also feeds, after every row's chain (committed token,
drafts), that token as one more input: a branch of its own at slot 1's position, which attends to the committed
prefix and the committed token, never to the chain's drafts (a 4D attention mask). Where a row's first draft is
rejected and its alternative equals the target's correction, the target's token after the alternative is committed
too. Both tokens are the target's own greedy choices on the committed prefix, so the output is what greedy decoding
gives; the step commits one token more.

After verification the alternative's cache column and hidden states are moved to the first draft's place
(`take_alternatives`), so the rest of the step (cache validity, the proposer's context, the companion's state) sees
an ordinary chain that accepted one draft.

Headroom, measured before building it (`examples/draft_tree_headroom.py`, teacher-forced, shipped drafter, k = 3):
kappa 1.646 -> 1.779 on MT-bench's answers, 1.945 -> 2.083 on held-out chat answers.

Choices: the alternative is the best token of the drafter's raw slot-1 logits other than the first draft (whether
the network or a lookup drafted it); which token it is only decides how often it helps, never what is committed.
Greedy decoding without per-row seeds only (sampling would need multi-draft rejection sampling), logits processors
that do not read the prefix (the alternative's prefix is not the chain's), and attention that takes a 4D mask
(`sdpa`, `eager`); `SpeculationConfig` and `generate` refuse the rest. The goodput scheduler's step costs do not
count the extra input, which costs little where steps are bandwidth-bound (B = 1 on the CPU testbed).
"""

from __future__ import annotations

import torch

from .attention import GQA_SDPA
from .caching import PreallocatedCache

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", GQA_SDPA)
"""The target attention implementations that take the alternative's 4D mask (`GQA_SDPA`: SDPA as the engine switches
it in on the CPU, `attention.GroupedQueryAttention`)."""


def check_alternative_draft(model, processor, do_sample: bool) -> None:
    """Raises `ValueError` where the alternative would not be exact (see the module docstring)."""
    if do_sample:
        raise ValueError("alternative_draft=True verifies a second first draft greedily: it needs do_sample=False.")
    if processor.reads_prefix:
        raise ValueError("alternative_draft=True needs logits processors that do not read the prefix (a repetition "
                         "penalty, for one, would score the alternative as if it followed the chain's drafts).")
    implementation = model.config._attn_implementation
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError("alternative_draft=True needs attention that takes a 4D mask (sdpa or eager); "
                         f"the target uses {implementation!r}.")


def alternative_tokens(first_logits: torch.Tensor, first_drafts: torch.LongTensor) -> torch.LongTensor:
    """Slot 1's logits `[B, V]` and first drafts `[B]` -> `[B]` the best token other than the first draft."""
    best_two = first_logits.topk(2, dim=-1).indices
    return torch.where(best_two[:, 0] == first_drafts, best_two[:, 1], best_two[:, 0])


def branch_mask(attention_mask: torch.LongTensor, num_inputs: int, dtype: torch.dtype) -> torch.Tensor:
    """The step's additive mask `[B, 1, T, S + T]` from its 2D one `[B, S + T]` (`RaggedBatch.step_inputs`), for
    T = num_inputs inputs, the last of which is the alternative: causal in cache order minus hidden columns, and the
    alternative blind to the chain's drafts (inputs 1 .. T - 2)."""
    total = attention_mask.shape[1]
    past = total - num_inputs
    device = attention_mask.device
    keys = torch.arange(total, device=device)
    allowed = keys[None, :] <= torch.arange(past, total, device=device)[:, None]  # [T, S + T]
    allowed[-1, past + 1 : total - 1] = False
    allowed = allowed[None] & attention_mask[:, None, :].bool()  # every input sees itself: new columns are visible
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def alternative_inputs(step_ids: torch.LongTensor, attention_mask: torch.LongTensor, position_ids: torch.LongTensor,
                       verified: torch.BoolTensor, alternatives: torch.LongTensor, dtype: torch.dtype):
    """A step's inputs (ids `[B, T - 1]`: committed token and drafts; from `RaggedBatch.step_inputs(T)` the 2D mask
    `[B, S + T]` and positions `[B, T]`; `verified` `[B, T - 1]` on the host) with each row's alternative `[B]`
    appended as input T - 1 -> (ids `[B, T]`, the 4D mask `branch_mask`, positions with the alternative at slot 1's,
    verified `[B, T]`: the alternative where the row verifies drafts)."""
    step_ids = torch.cat([step_ids, alternatives[:, None]], dim=1)
    position_ids = torch.cat([position_ids[:, :-1], position_ids[:, 1:2]], dim=1)
    verified = torch.cat([verified, verified[:, 1:2]], dim=1)
    return step_ids, branch_mask(attention_mask, step_ids.shape[1], dtype), position_ids, verified


def take_alternatives(tokens: torch.LongTensor, num_accepted: torch.LongTensor, alternatives: torch.LongTensor,
                      after_alternative: torch.LongTensor, offered: torch.BoolTensor):
    """A chain's greedy verification (`verify_greedy`: tokens `[B, w + 1]`, num_accepted `[B]`) with the rows'
    alternatives `[B]`, the target's greedy token after each `[B]`, and the rows that fed one `[B]` -> (tokens,
    num_accepted, taken `[B]`): a row whose first draft was rejected and whose alternative equals its correction
    accepts the alternative as its first draft and commits the token after it."""
    taken = offered & (num_accepted == 0) & (alternatives == tokens[:, 0])
    tokens = tokens.clone()
    tokens[:, 1] = torch.where(taken, after_alternative, tokens[:, 1])
    return tokens, num_accepted + taken.long(), taken


def move_alternatives(cache: PreallocatedCache, hidden_states: tuple | None, taken: torch.BoolTensor,
                      num_inputs: int) -> tuple | None:
    """Moves the alternative (the last of the step's `num_inputs` inputs) to the first draft's place (input 1) in the
    rows `taken` `[B]`: in every layer's cache and in the step's recorded hidden states `[B, T, d]` (None, or None
    entries, stay None). Returns the hidden states."""
    cache.move_column(taken, source=-1, target=1 - num_inputs)
    if hidden_states is None:
        return None
    return tuple(None if states is None else
                 torch.cat([states[:, :1], torch.where(taken[:, None], states[:, -1], states[:, 1])[:, None],
                            states[:, 2:]], dim=1)
                 for states in hidden_states)
