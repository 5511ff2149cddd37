"""Proposers: where drafts come from. They return a `Proposal`; acceptance lives in `verification.py`.

A proposer is called once after every target forward (the prompt's prefill, then each verification step) with what
that forward produced, and returns a `Proposal` for the k tokens that follow each row's newly committed token: its
network's draft logits `[B, k, V]`, which the engine turns into tokens (argmax or sampling, after logits
processing), and/or draft ids fixed by a free source (prompt lookup), with the source of every draft. With
`draft=False` (the goodput scheduler expects no drafts to pay, `scheduling.py`) the network does not draft: the
proposal holds free drafts only, and the proposer may defer its own work to the next call that drafts
(`SpecFormerProposer` does: a step that verifies nothing then costs what a plain decoding step does). Before a step
the schedule wants plain (its first, a re-timing of t_plain, a hand-off), the engine calls `skip` instead: nothing
is proposed, not even free drafts, so the step is plain decoding and nothing more. The engine calls `select_rows`
when rows retire and `flush` before it compacts the caches.

- `SpecFormerProposer`: the SpecFormer drafter, fused with verification (paper: one forward per step). It reads the
  target's hooked hidden states of the forward's T inputs, appends them to its own context-attention cache, and runs
  the slot stage only at each row's last accepted input, whose slot j predicts the (j + 1)-th token after the
  correction/bonus token (which a drafter with `next_token_input` reads).
- `PromptLookupProposer`: wraps another proposer; where a row's last few committed tokens occurred earlier in the
  row (prompt or output), the tokens that followed them replace the wrapped proposer's drafts (prompt lookup).

Bundled into `custom_generate/`: it reaches the drafter only through its `forward`, `config` and `bind_target`.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache

from .acceptance import DRAFTER, LOOKUP, NO_DRAFT
from .batch import RaggedBatch
from .caching import PreallocatedCache, kv_bytes_per_column


@dataclass
class Proposal:
    """The drafts a proposer offers for the next step, k per row.

    Attributes:
        logits: `[B, k, V]` the proposer's network's draft logits, unprocessed (None: the network did not draft).
        ids: `[B, k]` drafts fixed by a free source, read where `sources == LOOKUP` (None: no such drafts). They
            are not logits-processed or sampled: their draft distribution is one-hot, so verification stays lossless.
        sources: `[B, k]` where each draft comes from, `acceptance.DRAFTER`, `LOOKUP` (a free source: prompt
            lookup or suffix drafts) or `NO_DRAFT` (None: the network, everywhere).
        confidence: `[B, k]` the free source's confidence in its drafts, which the acceptance estimates read as a
            drafter's (None: 1, as for prompt lookup; suffix drafts give their frequency, `suffix.py`).
    """

    logits: torch.Tensor | None = None
    ids: torch.LongTensor | None = None
    sources: torch.LongTensor | None = None
    confidence: torch.Tensor | None = None

    @property
    def drafted(self) -> bool:
        """Whether the proposer's network drafted (it costs a forward), rather than free drafts alone."""
        return self.logits is not None

    @property
    def empty(self) -> bool:
        """Whether nothing is proposed."""
        return self.logits is None and self.ids is None

    def fixed_confidence(self) -> torch.Tensor:
        """`[B, k]` the confidence of the free drafts (`confidence`, or 1 where None); needs `ids`."""
        return torch.ones(self.ids.shape, device=self.ids.device) if self.confidence is None else self.confidence

    def select_rows(self, keep: torch.LongTensor) -> "Proposal":
        """The proposal for the rows `keep` (`[B']`)."""
        return Proposal(*(None if tensor is None else tensor[keep]
                          for tensor in (self.logits, self.ids, self.sources, self.confidence)))

    def join(self, other: "Proposal", num_rows: int, other_rows: int, num_draft_tokens: int) -> "Proposal":
        """This proposal's `num_rows` rows followed by `other`'s `other_rows`: both drafted or neither (one call's
        proposals: rows admitted mid-call are proposed for as the running rows are). Free drafts that only one side
        has are filled with none on the other (source `NO_DRAFT`, or `DRAFTER` where the network drafted)."""
        if self.drafted != other.drafted:
            raise ValueError("Proposals join only if both drafted or neither.")
        logits = None if self.logits is None else torch.cat([self.logits, other.logits])
        if self.ids is None and other.ids is None:
            return Proposal(logits)
        device = (self.ids if self.ids is not None else other.ids).device
        sides = [part._free_drafts(rows, num_draft_tokens, device) for part, rows in ((self, num_rows),
                                                                                        (other, other_rows))]
        return Proposal(logits, *(torch.cat(pair) for pair in zip(*sides)))

    def _free_drafts(self, num_rows: int, num_draft_tokens: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(ids, sources, confidence), each `[B, k]`, with none where this proposal has no free drafts."""
        if self.ids is not None:
            sources = self.sources if self.sources is not None else torch.full_like(
                self.ids, DRAFTER if self.drafted else NO_DRAFT)
            return self.ids, sources, self.fixed_confidence()
        shape = (num_rows, num_draft_tokens)
        return (torch.zeros(shape, dtype=torch.long, device=device),
                torch.full(shape, DRAFTER if self.drafted else NO_DRAFT, dtype=torch.long, device=device),
                torch.ones(shape, device=device))


class Proposer(ABC):
    """Base class. Subclasses set `hidden_state_indices` and implement `propose`.

    Attributes:
        num_draft_tokens: k, drafts per row and step.
        hidden_state_indices: the entries of the target's `output_hidden_states` tuple that `propose` reads (the
            target forward records only those, `forwards.recorded_hidden_states`); empty: none.
    """

    hidden_state_indices: frozenset[int] = frozenset()

    def __init__(self, num_draft_tokens: int):
        self.num_draft_tokens = num_draft_tokens

    def start(self, capacity: int) -> None:
        """Resets per-call state before a new `generate` call; `capacity`: cache columns the call can need."""

    def select_rows(self, keep: torch.LongTensor) -> None:
        """Keeps the deferred state of the active rows `keep` (`[B']`); the engine selects the caches' rows."""

    def fork(self, capacity: int) -> "Proposer":
        """A proposer for rows admitted mid-call, started with caches of `capacity` columns for their prefill (the
        engine then flushes it and appends its caches' rows to this one's): same networks and settings, its own
        per-row state. Default: this proposer, for proposers without per-row state."""
        return self

    def flush(self, batch: RaggedBatch) -> None:
        """Runs deferred work, so the caches hold every column the target's has (before compaction)."""

    def caches(self) -> list[Cache]:
        """Caches whose columns follow the target's (the engine drops rows and compacts holes in all of them)."""
        return []

    def cache_bytes_per_column(self) -> int:
        """Bytes one row's column takes in all of `caches()` (`caching.kv_bytes_per_column`)."""
        return 0

    def modules(self) -> list[torch.nn.Module]:
        """Networks the proposer runs (the engine speeds up their few-row linear layers on the CPU)."""
        return []

    def profile_draft(self, batch_size: int) -> None:
        """Runs the drafting work of one step for `batch_size` rows on made-up inputs, changing no state (the
        step-cost model times it). Proposers that cost nothing do nothing."""

    def cost_description(self) -> dict:
        """What determines the drafting cost (part of the key of cached step costs)."""
        return {"proposer": type(self).__name__, "num_draft_tokens": self.num_draft_tokens}

    def skip(
        self, batch: RaggedBatch, hidden_states: tuple[torch.Tensor, ...] | None, position_ids: torch.LongTensor,
        source_index: torch.LongTensor,
    ) -> None:
        """Keeps up with a target forward (arguments as `propose`) after which the next step is a plain one: nothing
        is proposed, not even free drafts. Default: `propose(..., draft=False)` with its result dropped."""
        self.propose(batch, hidden_states, position_ids, source_index, draft=False)

    @abstractmethod
    def propose(
        self,
        batch: RaggedBatch,
        hidden_states: tuple[torch.Tensor, ...] | None,
        position_ids: torch.LongTensor,
        source_index: torch.LongTensor,
        draft: bool = True,
    ) -> Proposal:
        """The drafts that follow a target forward of T inputs per row.

        Args:
            batch: state *after* the forward's commit (`batch.attention_mask` is `[B, S + T]`, rejected inputs hidden).
            hidden_states: the target's L + 1 hidden states (`[B, T, d]` at `hidden_state_indices`, None elsewhere),
                or None if not required.
            position_ids: `[B, T]` positions of the T inputs.
            source_index: `[B]` index in 0..T-1 of each row's last accepted input.
            draft: False when the next step is not expected to verify drafts: the network does not draft (free
                drafts may still be proposed), and the proposer may defer what only drafting needs.
        """


class NoDrafts(Proposer):
    """Proposes nothing (k = 0): plain steps in the engine (continuous batching, seeded rows) without a drafter."""

    def __init__(self):
        super().__init__(0)

    def propose(self, batch, hidden_states, position_ids, source_index, draft=True) -> Proposal:
        return Proposal()


class SpecFormerProposer(Proposer):
    """Drafts with a `SpecFormerForDrafting` bound to the target (see the module docstring).

    A call with `draft=False` defers the context stage: it keeps the step's hooked states, positions and next tokens
    (`[B, T, 4, d]`, `[B, T]`, `[B, T]`) and feeds them, in order, ahead of the next drafting call's own inputs. The
    context attention is causal in cache order with the final mask, so its states at accepted inputs are those of
    feeding each step on its own; the next tokens are taken when each step commits, since later inputs no longer
    follow them in the token sequence where drafts were rejected.
    """

    def __init__(self, drafter: torch.nn.Module, num_draft_tokens: int | None = None):
        super().__init__(drafter.config.num_speculative_tokens if num_draft_tokens is None else num_draft_tokens)
        if not 0 <= self.num_draft_tokens <= drafter.config.draft_length:
            raise ValueError(
                f"num_draft_tokens={self.num_draft_tokens} must be between 0 (plain decoding) and the drafter's "
                f"draft_length={drafter.config.draft_length}."
            )
        self.drafter = drafter
        self.hidden_state_indices = frozenset(drafter.config.hook_layers)
        self.cache: Cache = DynamicCache()
        self.deferred: list[tuple[torch.Tensor, torch.LongTensor, torch.LongTensor]] = []

    def start(self, capacity: int) -> None:
        self.cache = PreallocatedCache(num_layers=1, capacity=capacity)
        self.deferred = []

    def select_rows(self, keep: torch.LongTensor) -> None:
        self.deferred = [tuple(tensor[keep] for tensor in inputs) for inputs in self.deferred] if keep.numel() else []

    def fork(self, capacity: int) -> "SpecFormerProposer":
        forked = copy.copy(self)  # a subclass stays itself
        forked.start(capacity)
        return forked

    def flush(self, batch: RaggedBatch) -> None:
        if self.deferred:
            self._forward(batch, *self._take_deferred(), draft_positions=None)

    def caches(self) -> list[Cache]:
        return [self.cache]

    def cache_bytes_per_column(self) -> int:
        return kv_bytes_per_column(self.drafter.config, 1, self.drafter.dtype)

    def modules(self) -> list[torch.nn.Module]:
        return [self.drafter, self.drafter.draft_head()]

    def cost_description(self) -> dict:
        return {**super().cost_description(), "drafter": self.drafter.config.to_diff_dict(),
                "dtype": str(self.drafter.dtype)}

    def profile_draft(self, batch_size: int) -> None:
        """One drafting forward (a single new position per row, no cache) and the softmax of its drafts."""
        config, device = self.drafter.config, self.drafter.device
        hooked = torch.randn(batch_size, 1, len(config.hook_layers), config.hidden_size, device=device)
        output = self.drafter(
            hooked, position_ids=torch.zeros(batch_size, 1, dtype=torch.long, device=device), use_cache=False,
            num_draft_tokens=self.num_draft_tokens,
            next_token_ids=torch.zeros(batch_size, 1, dtype=torch.long, device=device),
        )
        output.logits.float().softmax(-1)

    def propose(self, batch, hidden_states, position_ids, source_index, draft=True) -> Proposal:
        hooked = torch.stack(self.drafter.select_hooked_states(hidden_states), dim=2)  # [B, T, 4, d]
        self.deferred.append((hooked, position_ids, batch.next_tokens(source_index, position_ids.shape[1])))
        if not draft:
            return Proposal()
        offset = sum(inputs[1].shape[1] for inputs in self.deferred[:-1])
        hooked, position_ids, next_token_ids = self._take_deferred()
        return Proposal(self._forward(batch, hooked, position_ids, next_token_ids, (offset + source_index)[:, None]))

    def _take_deferred(self) -> tuple[torch.Tensor, torch.LongTensor, torch.LongTensor]:
        """The deferred inputs, concatenated along T, and none left."""
        inputs, self.deferred = self.deferred, []
        return tuple(torch.cat(parts, dim=1) for parts in zip(*inputs))

    def _forward(self, batch, hooked, position_ids, next_token_ids, draft_positions) -> torch.Tensor | None:
        """The drafter over T new inputs: its cache grows by T columns; draft logits `[B, k, V]` at `draft_positions`
        `[B, 1]` (None: context only)."""
        output = self.drafter(
            hooked,
            position_ids=position_ids,
            attention_mask=batch.attention_mask,
            past_key_values=self.cache,
            draft_positions=draft_positions if draft_positions is not None else position_ids[:, :0],
            num_draft_tokens=self.num_draft_tokens,
            next_token_ids=next_token_ids,
        )
        return None if draft_positions is None else output.logits[:, 0]  # [B, k, V]


def lookup_drafts(
    batch: RaggedBatch, num_draft_tokens: int, max_ngram_size: int, min_ngram_size: int = 2
) -> tuple[torch.LongTensor, torch.BoolTensor, torch.LongTensor]:
    """Prompt lookup decoding (Saxena, 2023) for the active rows of `batch`: `ngram_lookup` on their committed
    prefixes. Returns drafts `[B, k]`, found `[B, k]` and the matched n `[B]`."""
    width = min(batch.max_prefix, batch.tokens.shape[1])  # no host read: longer than every prefix
    tokens = batch.tokens[batch.row_ids, :width]  # [B, W]; beyond a row's prefix: scratch, never matched
    return ngram_lookup(tokens, batch.prefix_lengths(), num_draft_tokens, max_ngram_size, min_ngram_size)


def ngram_lookup(
    tokens: torch.LongTensor, prefix: torch.LongTensor, num_draft_tokens: int, max_ngram_size: int,
    min_ngram_size: int = 2,
) -> tuple[torch.LongTensor, torch.BoolTensor, torch.LongTensor]:
    """Prompt lookup's drafts: the last n tokens of each row's prefix (`tokens` `[B, W]`, the first `prefix[b]`
    committed, the rest never matched), n = max_ngram_size down to min_ngram_size, are searched among the row's
    earlier tokens; the tokens that followed their latest earlier occurrence are the drafts. Longer n-grams win.

    Returns drafts `[B, k]`, found `[B, k]` (False for rows without a match and past the prefix) and the matched n
    `[B]` (0: no match).
    """
    width = tokens.shape[1]
    continuation = torch.full_like(prefix, -1)  # [B] first column after the matched occurrence
    matched = torch.zeros_like(prefix)  # [B] its n
    for size in range(max_ngram_size, min_ngram_size - 1, -1):
        if width <= size:
            continue
        pattern = tokens.gather(1, (prefix[:, None] - size + torch.arange(size, device=prefix.device)).clamp(min=0))
        ends = torch.arange(size, width + 1, device=prefix.device)  # [W - n + 1] end of each window (exclusive)
        hit = (tokens.unfold(1, size, 1) == pattern[:, None, :]).all(-1) & (ends[None, :] < prefix[:, None])
        latest = torch.where(hit, ends[None, :], -1).amax(1)
        matched = torch.where((continuation < 0) & (latest >= 0), size, matched)
        continuation = torch.where(continuation < 0, latest, continuation)
    columns = continuation[:, None] + torch.arange(num_draft_tokens, device=prefix.device)  # [B, k]
    found = (continuation[:, None] >= 0) & (columns < prefix[:, None])
    return tokens.gather(1, columns.clamp(0, width - 1)), found, matched


LOOKUP_OVERRIDE_CONFIDENCE = (0.0, 0.0, 0.6, 0.7, 0.9)
"""By matched n (index; longer n use the last): the network confidence in its first draft below which a prompt-lookup
match whose first draft differs from the network's replaces the network's drafts. Measured teacher-forced (shipped
drafter, k = 3; `README`): where the two first drafts differ, a 2-gram match's draft is right about 30% of the time,
a 4-gram match's about 70%, and the network's about as often as its confidence says. Chosen on held-out chat answers
(kappa 2.336 with lookup always first, 2.354 with these), then checked on MT-bench's (1.872, 1.880)."""


def network_confidence(logits: torch.Tensor) -> torch.Tensor:
    """The network's unprocessed draft logits `[B, j, V]` -> `[B, j]` its probability of its most likely draft at
    each slot: what its draft is worth against a free source's (a choice of source only; verification stays lossless
    either way)."""
    return logits.float().softmax(-1).amax(-1)


def lookup_overrides(proposal: Proposal, ids: torch.LongTensor, matched: torch.LongTensor) -> torch.BoolTensor:
    """`[B]` the rows whose lookup match (first drafts `ids[:, 0]`, matched n `[B]`) replaces the network's drafts:
    where the network did not draft, its first draft is the lookup's, or its confidence in it is below
    `LOOKUP_OVERRIDE_CONFIDENCE[n]`."""
    if not proposal.drafted:
        return torch.ones_like(matched, dtype=torch.bool)
    limits = torch.tensor(LOOKUP_OVERRIDE_CONFIDENCE, device=matched.device)
    first = proposal.logits[:, :1]  # [B, 1, V]
    agrees = first[:, 0].argmax(-1) == ids[:, 0]
    return agrees | (network_confidence(first)[:, 0] < limits[matched.clamp(max=len(limits) - 1)])


class WrappingProposer(Proposer):
    """A proposer on top of another, `proposer`, whose drafts it replaces where it finds its own. Everything but
    `propose` is the wrapped proposer's: its state, caches, networks and costs (it sees every step); a fork forks
    it. Subclasses implement `propose`."""

    def __init__(self, proposer: Proposer):
        super().__init__(proposer.num_draft_tokens)
        self.proposer = proposer
        self.hidden_state_indices = proposer.hidden_state_indices

    def start(self, capacity: int) -> None:
        self.proposer.start(capacity)

    def select_rows(self, keep: torch.LongTensor) -> None:
        self.proposer.select_rows(keep)

    def fork(self, capacity: int) -> "WrappingProposer":
        forked = copy.copy(self)
        forked.proposer = self.proposer.fork(capacity)
        return forked

    def flush(self, batch: RaggedBatch) -> None:
        self.proposer.flush(batch)

    def caches(self) -> list[Cache]:
        return self.proposer.caches()

    def cache_bytes_per_column(self) -> int:
        return self.proposer.cache_bytes_per_column()

    def modules(self) -> list[torch.nn.Module]:
        return self.proposer.modules()

    def profile_draft(self, batch_size: int) -> None:
        self.proposer.profile_draft(batch_size)

    def cost_description(self) -> dict:
        return self.proposer.cost_description()

    def skip(self, batch, hidden_states, position_ids, source_index) -> None:
        self.proposer.skip(batch, hidden_states, position_ids, source_index)


class PromptLookupProposer(WrappingProposer):
    """Another proposer's drafts, replaced by prompt lookup (`lookup_drafts`) wherever a match supplies them and the
    network, where it drafted, agrees on the first draft or is unsure of its own (`lookup_overrides`).

    Looked-up drafts cost no forward, and text often repeats its prompt or itself (names, code, lists), where a
    learned drafter's later slots rarely reach (n = 4..2 measured best, README). Looked-up drafts are ids
    (`Proposal.ids`): their draft distribution is one-hot, so sampling stays lossless (a draft is accepted with the
    target's probability of that token, and a rejection samples the target's distribution without it), and a step
    with lookup drafts alone builds nothing over the vocabulary.
    The wrapped proposer sees every step (SpecFormer's context cache must see every committed position).

    Args:
        proposer: the proposer whose drafts are used where lookup finds nothing.
        max_ngram_size: the longest n-gram matched (down to 2).
    """

    def __init__(self, proposer: Proposer, max_ngram_size: int = 4):
        super().__init__(proposer)
        if max_ngram_size < 2:
            raise ValueError(
                f"max_ngram_size={max_ngram_size} must be at least 2 (lookup_ngram_size=0 turns lookup off)."
            )
        self.max_ngram_size = max_ngram_size

    def propose(self, batch, hidden_states, position_ids, source_index, draft=True) -> Proposal:
        """The wrapped proposer's proposal (its network drafts when `draft`) with lookup matches as fixed drafts in
        their place."""
        proposal = self.proposer.propose(batch, hidden_states, position_ids, source_index, draft)
        ids, found, matched = lookup_drafts(batch, self.num_draft_tokens, self.max_ngram_size)
        found &= lookup_overrides(proposal, ids, matched)[:, None]
        elsewhere = proposal.sources if proposal.sources is not None else DRAFTER if proposal.drafted else NO_DRAFT
        if proposal.ids is None:
            return Proposal(proposal.logits, ids, torch.where(found, LOOKUP, elsewhere))
        confidence = torch.where(found, 1.0, proposal.fixed_confidence())  # the wrapped free drafts where none found
        return Proposal(proposal.logits, torch.where(found, ids, proposal.ids), torch.where(found, LOOKUP, elsewhere),
                        confidence)
