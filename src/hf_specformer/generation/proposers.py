"""Proposers: where drafts come from. Two hooks, as `transformers`' `CandidateGenerator` has:

- `propose(batch, step, caches, draft, free)` after every target forward: a `Proposal` of k tokens per row, network
  logits and/or fixed drafts. `draft=False`: the network may defer its work; `free=False`: nothing is proposed.
- `flush(batch, caches)`: runs deferred work before the engine moves the caches' rows or columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import DRAFTER, LOOKUP, NO_DRAFT
from .batch import RaggedBatch
from .cache import kv_bytes_per_column


@dataclass
class TargetStep:
    """What a target forward of T inputs per row gives a proposer."""

    hidden_states: tuple  # the target's L + 1 hidden states, [B, T, d] at the proposer's `hidden_state_indices`
    position_ids: torch.LongTensor  # [B, T] positions of the inputs
    last_accepted: torch.LongTensor  # [B] index in 0..T-1 of each row's last accepted input


@dataclass
class Proposal:
    """The drafts offered for the next step, k per row. Fixed drafts (`ids`) are never processed or sampled: their
    draft distribution is one-hot, so verification stays lossless."""

    logits: torch.Tensor | None = None  # [B, k, V] the network's draft logits, unprocessed (None: it did not draft)
    ids: torch.LongTensor | None = None  # [B, k] fixed drafts, read where `sources == LOOKUP` (None: none)
    sources: torch.LongTensor | None = None  # [B, k] DRAFTER, LOOKUP or NO_DRAFT per draft (None: the network's)
    confidence: torch.Tensor | None = None  # [B, k] what the free source thinks of its drafts (None: 1)

    @property
    def drafted(self) -> bool:
        """Whether the network drafted (it costs a forward), rather than free drafts alone."""
        return self.logits is not None

    @property
    def empty(self) -> bool:
        return self.logits is None and self.ids is None

    def fixed_confidence(self) -> torch.Tensor:
        return torch.ones(self.ids.shape, device=self.ids.device) if self.confidence is None else self.confidence

    def row_sources(self, shape, device) -> torch.LongTensor:
        """`[B, k]` the sources, filled in where None."""
        if self.sources is not None:
            return self.sources
        return torch.full(shape, DRAFTER if self.drafted else NO_DRAFT, dtype=torch.long, device=device)


class Proposer:
    """Base class (see the module docstring). Subclasses implement `propose`, and `flush` if they defer work."""

    hidden_state_indices: frozenset[int] = frozenset()  # the target's hidden states `propose` reads (recorded)
    num_cache_layers: int = 0  # attention layers of the proposer's own cache (0: none)
    cache_bytes_per_column: int = 0  # bytes one row's column takes in that cache (for memory budgets)

    def __init__(self, num_draft_tokens: int):
        self.num_draft_tokens = num_draft_tokens  # k, drafts per row and step

    def propose(self, batch: RaggedBatch, step: TargetStep, caches: list, draft: bool = True,
                free: bool = True) -> Proposal:
        """The drafts after a forward; `batch` is as committed after it (rejected inputs hidden)."""
        raise NotImplementedError

    def flush(self, batch: RaggedBatch, caches: list) -> None:
        """Runs deferred work, so the proposer's caches hold every column the target's does."""


class NoDrafts(Proposer):
    """Proposes nothing (k = 0): the engine's plain steps, without a drafter."""

    def __init__(self):
        super().__init__(0)

    def propose(self, batch, step, caches, draft=True, free=True) -> Proposal:
        return Proposal()


class OracleProposer(Proposer):
    """Proposes `continuations[b, n : n + k]` as fixed drafts for a row that has generated n tokens, `pad_token_id`
    past the end.

    Args:
        continuations: `[B0, N]` the tokens each row is expected to generate (e.g. the target's greedy output).
        num_draft_tokens: k.
        vocab_size: the target's vocabulary (subclasses may draft logits over it).
        pad_token_id: the draft past the end.
    """

    def __init__(self, continuations: torch.LongTensor, num_draft_tokens: int, vocab_size: int, pad_token_id: int):
        super().__init__(num_draft_tokens)
        padding = continuations.new_full((continuations.shape[0], num_draft_tokens + 1), pad_token_id)
        self.continuations = torch.cat([continuations, padding], dim=1)
        self.vocab_size = vocab_size
        self.offsets = torch.arange(num_draft_tokens, device=continuations.device)

    def draft_ids(self, batch: RaggedBatch) -> torch.LongTensor:
        """`[B, k]` the active rows' next k tokens of their continuations."""
        rows = batch.row_ids
        columns = (batch.num_generated[rows, None] + self.offsets).clamp(max=self.continuations.shape[1] - 1)
        return self.continuations[rows[:, None], columns]

    def propose(self, batch, step, caches, draft=True, free=True) -> Proposal:
        if not free:
            return Proposal()
        ids = self.draft_ids(batch)
        return Proposal(ids=ids, sources=torch.full_like(ids, LOOKUP))


class SpecFormerProposer(Proposer):
    """Drafts with a `SpecFormerForDrafting` bound to the target. With `draft=False` the context stage is deferred:
    the step's inputs are fed ahead of the next drafting call's (causal in cache order, so nothing changes)."""

    def __init__(self, drafter: torch.nn.Module, num_draft_tokens: int | None = None):
        config = drafter.config
        super().__init__(config.num_speculative_tokens if num_draft_tokens is None else num_draft_tokens)
        if not 0 <= self.num_draft_tokens <= config.draft_length:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens} must be between 0 (plain decoding) and the "
                             f"drafter's draft_length={config.draft_length}.")
        self.drafter = drafter
        self.hidden_state_indices = frozenset(config.hook_layers)
        self.num_cache_layers = 1
        self.cache_bytes_per_column = kv_bytes_per_column(config, 1, drafter.dtype)
        self.deferred: list[tuple[torch.Tensor, torch.LongTensor, torch.LongTensor]] = []

    def propose(self, batch, step, caches, draft=True, free=True) -> Proposal:
        hooked = torch.stack(self.drafter.select_hooked_states(step.hidden_states), dim=2)  # [B, T, 4, d]
        num_inputs = step.position_ids.shape[1]
        self.deferred.append((hooked, step.position_ids, batch.next_tokens(step.last_accepted, num_inputs)))
        if not draft:
            return Proposal()
        offset = sum(inputs[1].shape[1] for inputs in self.deferred[:-1])
        logits = self._forward(batch, caches[0], (offset + step.last_accepted)[:, None])
        return Proposal(logits=logits)

    def flush(self, batch, caches) -> None:
        if self.deferred:
            self._forward(batch, caches[0], None)

    def _forward(self, batch, cache, draft_positions) -> torch.Tensor | None:
        """The drafter over the deferred inputs (its cache grows by their columns) -> draft logits `[B, k, V]` at
        `draft_positions` `[B, 1]` (None: context only)."""
        inputs, self.deferred = self.deferred, []
        hooked, position_ids, next_token_ids = (torch.cat(parts, dim=1) for parts in zip(*inputs))
        output = self.drafter(hooked, position_ids=position_ids, attention_mask=batch.attention_mask,
                              past_key_values=cache,
                              draft_positions=position_ids[:, :0] if draft_positions is None else draft_positions,
                              num_draft_tokens=self.num_draft_tokens, next_token_ids=next_token_ids)
        return None if draft_positions is None else output.logits[:, 0]


def ngram_lookup(tokens: torch.LongTensor, prefix: torch.LongTensor, num_draft_tokens: int, max_ngram_size: int,
                 min_ngram_size: int = 2):
    """Prompt lookup (Saxena, 2023): what followed the latest earlier occurrence of each row's last n tokens (`tokens`
    `[B, W]`, `prefix[b]` committed), n from `max_ngram_size` down -> drafts `[B, k]`, found `[B, k]`, n `[B]`."""
    width = tokens.shape[1]
    continuation = torch.full_like(prefix, -1)  # [B] first column after the matched occurrence
    matched = torch.zeros_like(prefix)
    for size in range(max_ngram_size, min_ngram_size - 1, -1):
        if width <= size:
            continue
        pattern = tokens.gather(1, (prefix[:, None] - size + torch.arange(size, device=prefix.device)).clamp(min=0))
        ends = torch.arange(size, width + 1, device=prefix.device)
        hit = (tokens.unfold(1, size, 1) == pattern[:, None, :]).all(-1) & (ends[None, :] < prefix[:, None])
        latest = torch.where(hit, ends[None, :], -1).amax(1)
        matched = torch.where((continuation < 0) & (latest >= 0), size, matched)
        continuation = torch.where(continuation < 0, latest, continuation)
    columns = continuation[:, None] + torch.arange(num_draft_tokens, device=prefix.device)
    found = (continuation[:, None] >= 0) & (columns < prefix[:, None])
    return tokens.gather(1, columns.clamp(0, width - 1)), found, matched


LOOKUP_OVERRIDE_CONFIDENCE = (0.0, 0.0, 0.6, 0.7, 0.9)
"""By matched n (longer n use the last): the network's confidence in its first draft below which a lookup match
that disagrees with it replaces its drafts (a 2-gram match is right about 30% of the time there, a 4-gram's 70%)."""


def network_confidence(logits: torch.Tensor) -> torch.Tensor:
    """Unprocessed draft logits `[B, j, V]` -> `[B, j]` the most likely draft's probability (to choose a source)."""
    return logits.float().softmax(-1).amax(-1)


class WrappingProposer(Proposer):
    """A free source on top of another proposer, which keeps its state, caches and hidden states."""

    def __init__(self, proposer: Proposer):
        super().__init__(proposer.num_draft_tokens)
        self.proposer = proposer
        self.hidden_state_indices = proposer.hidden_state_indices
        self.num_cache_layers = proposer.num_cache_layers
        self.cache_bytes_per_column = proposer.cache_bytes_per_column

    def flush(self, batch, caches) -> None:
        self.proposer.flush(batch, caches)


class PromptLookupProposer(WrappingProposer):
    """Another proposer's drafts, replaced by prompt lookup's where a match exists and the network, if it drafted,
    agrees on the first draft or is unsure of its own (looked-up drafts cost no forward).

    Args:
        proposer: the proposer whose drafts are used where lookup finds nothing.
        max_ngram_size: the longest n-gram matched (down to 2).
    """

    def __init__(self, proposer: Proposer, max_ngram_size: int = 4):
        super().__init__(proposer)
        if max_ngram_size < 2:
            raise ValueError(f"max_ngram_size={max_ngram_size} must be at least 2 (lookup_ngram_size=0 turns it off).")
        self.max_ngram_size = max_ngram_size

    def propose(self, batch, step, caches, draft=True, free=True) -> Proposal:
        proposal = self.proposer.propose(batch, step, caches, draft, free)
        if not free:
            return proposal
        width = min(batch.max_prefix, batch.tokens.shape[1])  # no host read: at least every prefix
        ids, found, matched = ngram_lookup(batch.tokens[batch.row_ids, :width], batch.prefix_lengths(),
                                           self.num_draft_tokens, self.max_ngram_size)
        sources = proposal.row_sources(ids.shape, ids.device)
        if proposal.drafted:
            limits = torch.tensor(LOOKUP_OVERRIDE_CONFIDENCE, device=ids.device)
            first = proposal.logits[:, :1]
            agrees = first[:, 0].argmax(-1) == ids[:, 0]
            found &= (agrees | (network_confidence(first)[:, 0] < limits[matched.clamp(max=len(limits) - 1)]))[:, None]
        found &= sources != LOOKUP
        if proposal.ids is None:
            return Proposal(proposal.logits, ids, torch.where(found, LOOKUP, sources))
        return Proposal(proposal.logits, torch.where(found, ids, proposal.ids), torch.where(found, LOOKUP, sources),
                        torch.where(found, 1.0, proposal.fixed_confidence()))

