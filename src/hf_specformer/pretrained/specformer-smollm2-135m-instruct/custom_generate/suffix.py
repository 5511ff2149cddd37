"""Cross-request suffix drafts (SuffixDecoding, arXiv 2411.04975; vLLM's `suffix` method), on the device.

What followed a row's last n tokens in earlier requests (a `SuffixIndex`) or in the batch is a draft; slot j's
confidence is the share of the latest occurrences agreeing up to j. Matching compares n-gram hashes (a collision only
proposes a wrong draft, which verification rejects).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

import torch

from .acceptance import LOOKUP
from .batch import RaggedBatch
from .proposers import Proposal, Proposer, WrappingProposer, network_confidence

SEPARATOR = -1
"""Token id that ends every sequence of the matched text (never matched, never a draft)."""

HASH_MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)
"""Odd multiplier of the n-gram hash (int64 arithmetic wraps)."""

UNMATCHED = -(1 << 63)
"""Hash given to n-grams that nothing follows (a pattern hashing to it finds only those, which are unusable)."""

MIN_NGRAM_SIZE = 4
"""Shortest n-gram matched by default: shorter ones draft what most often followed them, which the drafter knows
better."""

MAX_INDEX_TOKENS = 65536
"""Default cap of a `SuffixIndex`, in tokens (a call sorts its n-grams once; a step searches them per row)."""


class SuffixIndex:
    """Token sequences of earlier requests (prompts and outputs) that suffix drafts match against; a call with
    `speculation_config={"suffix_index": index}` adds its rows after it. The oldest go beyond `max_tokens`.

    Args:
        max_tokens: the memory bound, in tokens (0: nothing is kept across calls; a call still matches its own
            rows against each other).
    """

    def __init__(self, max_tokens: int = MAX_INDEX_TOKENS):
        if max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens} must be at least 0.")
        self.max_tokens = max_tokens
        self.sequences: deque[torch.LongTensor] = deque()
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, sequences: Iterable[torch.LongTensor]) -> None:
        """Adds 1-D token sequences (kept on the host), then drops the oldest until `max_tokens` holds."""
        for sequence in sequences:
            sequence = sequence.detach().to("cpu", torch.long).flatten()[-self.max_tokens or None:]
            if self.max_tokens and sequence.numel():
                self.sequences.append(sequence)
                self.num_tokens += sequence.numel()
        while self.num_tokens > self.max_tokens:
            self.num_tokens -= self.sequences.popleft().numel()

    def add_generated(self, sequences: torch.LongTensor, prompt_mask: torch.Tensor | None, prompt_width: int,
                      pad_token_id: int | None) -> None:
        """Adds the rows of a `generate` result `[B, P + N]` without their padding (`prompt_mask` `[B, P]` or None,
        and trailing `pad_token_id`s)."""
        for row, sequence in enumerate(sequences.cpu()):
            prompt = sequence[:prompt_width]
            if prompt_mask is not None:
                prompt = prompt[prompt_mask[row].cpu().bool()]
            output = sequence[prompt_width:]
            if pad_token_id is not None:
                kept = (output != pad_token_id).nonzero()
                output = output[: int(kept[-1]) + 1] if kept.numel() else output[:0]
            self.add([torch.cat([prompt, output])])

    def text(self, device: torch.device | str) -> torch.LongTensor:
        """`[M]` every sequence followed by `SEPARATOR`, on `device`."""
        parts = [part for sequence in self.sequences for part in (sequence, torch.tensor([SEPARATOR]))]
        return torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.long, device=device)


def ngram_hashes(text: torch.LongTensor, size: int) -> torch.LongTensor:
    """`[..., M]` tokens -> `[..., M - size + 1]` a hash of each window of `size` tokens."""
    hashes = torch.zeros_like(text[..., : text.shape[-1] - size + 1])
    for offset in range(size):
        hashes = hashes * HASH_MULTIPLIER + text[..., offset : offset + hashes.shape[-1]]
    return hashes


class SortedNgrams(NamedTuple):
    """The n-grams of a text that a token follows, sorted by hash (stable: in text order within a hash)."""

    hashes: torch.LongTensor  # [N] sorted hashes (`UNMATCHED` for n-grams followed by `SEPARATOR`)
    starts: torch.LongTensor  # [N] where each one's continuation begins in the text


def sorted_ngrams(text: torch.LongTensor, size: int) -> SortedNgrams:
    """`[M]` tokens -> its `SortedNgrams` of `size` tokens."""
    window_hash = ngram_hashes(text[:-1], size)  # windows with a token after them
    starts = torch.arange(window_hash.numel(), device=text.device) + size
    window_hash = torch.where(text[starts] != SEPARATOR, window_hash, UNMATCHED)
    hashes, order = window_hash.sort(stable=True)
    return SortedNgrams(hashes, starts[order])


def latest_occurrences(ngrams: SortedNgrams, pattern_hash: torch.LongTensor, limit: int) -> torch.LongTensor:
    """`[B]` n-gram hashes -> `[B, limit]` the continuation starts of their latest occurrences, latest first; -1
    past the last."""
    if ngrams.hashes.numel() == 0:
        return torch.full((pattern_hash.numel(), limit), -1, dtype=torch.long, device=pattern_hash.device)
    first = torch.searchsorted(ngrams.hashes, pattern_hash)
    index = torch.searchsorted(ngrams.hashes, pattern_hash, right=True)[:, None] - 1 \
        - torch.arange(limit, device=pattern_hash.device)
    return torch.where(index >= first[:, None], ngrams.starts[index.clamp(min=0)], -1)


def batch_text(batch: RaggedBatch) -> torch.LongTensor:
    """`[B * (W + 1)]` the active rows' committed prefixes, each padded with `SEPARATOR` to W and followed by one."""
    width = min(batch.max_prefix, batch.tokens.shape[1])
    tokens = batch.tokens[batch.row_ids, :width]
    committed = torch.arange(width, device=tokens.device)[None, :] < batch.prefix_lengths()[:, None]
    tokens = torch.where(committed, tokens, SEPARATOR)
    return torch.cat([tokens, torch.full_like(tokens[:, :1], SEPARATOR)], dim=1).flatten()


def continuation_agreement(continuations: torch.LongTensor, usable: torch.BoolTensor) -> torch.Tensor:
    """Continuations `[B, L, k]` of L occurrences (`usable` `[B, L, k]`: a real token there) -> `[B, L, k]` the
    share of the usable occurrences whose continuation equals occurrence l's up to and including slot j."""
    same = (continuations[:, :, None, :] == continuations[:, None, :, :]) & usable[:, :, None, :] \
        & usable[:, None, :, :]  # [B, L, L, k]
    agree = same.long().cumprod(-1).sum(2).double()  # [B, L, k]
    return agree / usable[:, :, 0].sum(1).clamp(min=1)[:, None, None]


def tokens_at(index_text: torch.LongTensor, rows: torch.LongTensor, columns: torch.LongTensor) -> torch.LongTensor:
    """The tokens at `columns` of `index_text` `[M]` followed by `rows` `[R]` (`SEPARATOR` past the end), without
    joining them."""
    size = index_text.numel()
    tokens = rows[(columns - size).clamp(0, rows.numel() - 1)]
    if size:
        tokens = torch.where(columns < size, index_text[columns.clamp(max=size - 1)], tokens)
    return torch.where(columns < size + rows.numel(), tokens, SEPARATOR)


def suffix_drafts(batch: RaggedBatch, index_text: torch.LongTensor, index_ngrams: dict[int, SortedNgrams],
                  num_draft_tokens: int, max_ngram_size: int, max_candidates: int = 32, min_confidence: float = 0.1,
                  min_ngram_size: int = 2) -> tuple[torch.LongTensor, torch.BoolTensor, torch.Tensor]:
    """Suffix drafts of the active rows from `index_text` `[M]` (with its `sorted_ngrams` per size) and the batch's
    rows, n from `max_ngram_size` down -> drafts `[B, k]`, found `[B, k]`, confidence `[B, k]` (float64)."""
    k, size = num_draft_tokens, batch.size
    rows = batch_text(batch)
    device, prefix = rows.device, batch.prefix_lengths()
    drafts = torch.full((size, k), batch.pad_token_id, dtype=torch.long, device=device)
    confidence = torch.zeros(size, k, dtype=torch.float64, device=device)
    matched = torch.zeros(size, dtype=torch.bool, device=device)
    rows_tokens = batch.tokens[batch.row_ids]
    for n in range(max_ngram_size, min_ngram_size - 1, -1):
        pattern = rows_tokens.gather(1, (prefix[:, None] - n + torch.arange(n, device=device)).clamp(min=0))
        pattern_hash = ngram_hashes(pattern, n)[:, 0]  # [B]
        in_rows = latest_occurrences(sorted_ngrams(rows, n), pattern_hash, max_candidates)
        in_index = latest_occurrences(index_ngrams[n], pattern_hash, max_candidates)
        starts = torch.cat([torch.where(in_rows >= 0, in_rows + index_text.numel(), -1), in_index], dim=1)
        starts = starts.topk(max_candidates, dim=1).values  # [B, L] latest first (the batch's rows come last)
        columns = starts.clamp(min=0)[..., None] + torch.arange(k, device=device)  # [B, L, k]
        continuations = tokens_at(index_text, rows, columns)
        usable = (continuations != SEPARATOR) & (starts >= 0)[..., None]
        usable = usable.long().cumprod(-1).bool() & (prefix >= n)[:, None, None]
        agreement = continuation_agreement(continuations, usable)  # [B, L, k]
        pick = agreement.sum(-1).argmax(1)[:, None, None].expand(size, 1, k)  # the first (latest) of the best
        new = ~matched & usable[:, 0, 0]
        chosen = torch.where(usable, continuations, batch.pad_token_id).gather(1, pick)[:, 0]  # a token id everywhere
        drafts = torch.where(new[:, None], chosen, drafts)
        confidence = torch.where(new[:, None], agreement.gather(1, pick)[:, 0], confidence)
        matched |= new
    found = (confidence >= min_confidence).long().cumprod(1).bool() & (confidence > 0)
    return drafts, found, confidence


def expected_accepted(confidence: torch.Tensor) -> torch.Tensor:
    """`[B, k]` per-slot confidence -> `[B]` drafts expected accepted, sum_j prod_{i <= j} confidence_i."""
    return confidence.double().cumprod(1).sum(1)


class SuffixProposer(WrappingProposer):
    """Another proposer's drafts, replaced by suffix drafts where they promise more and no fixed drafts exist.

    Args:
        proposer: the proposer whose drafts are used where no suffix draft is found.
        index: earlier requests to match against (the batch's own rows are always matched).
        max_ngram_size, min_ngram_size: the longest and shortest n-grams matched.
        max_candidates, min_confidence: see `suffix_drafts`.
    """

    def __init__(self, proposer: Proposer, index: SuffixIndex, max_ngram_size: int = 4, max_candidates: int = 32,
                 min_confidence: float = 0.1, min_ngram_size: int = MIN_NGRAM_SIZE):
        super().__init__(proposer)
        if not 2 <= min_ngram_size <= max_ngram_size:
            raise ValueError(f"The n-grams matched must have 2 <= min_ngram_size ({min_ngram_size}) <= max_ngram_size "
                             f"({max_ngram_size}).")
        self.index, self.max_candidates, self.min_confidence = index, max_candidates, min_confidence
        self.max_ngram_size, self.min_ngram_size = max_ngram_size, min_ngram_size
        self._sorted: tuple[torch.LongTensor, dict[int, SortedNgrams]] | None = None  # built at the first call

    def propose(self, batch, step, caches, draft=True, free=True) -> Proposal:
        proposal = self.proposer.propose(batch, step, caches, draft, free)
        if not free:
            return proposal
        if self._sorted is None:
            text = self.index.text(batch.tokens.device)
            sizes = range(self.min_ngram_size, self.max_ngram_size + 1)
            self._sorted = text, {n: sorted_ngrams(text, n) for n in sizes}
        ids, found, confidence = suffix_drafts(batch, *self._sorted, self.num_draft_tokens, self.max_ngram_size,
                                               self.max_candidates, self.min_confidence, self.min_ngram_size)
        if proposal.drafted:
            network = expected_accepted(network_confidence(proposal.logits))
            found &= (expected_accepted(confidence * found) > network)[:, None]
        sources = proposal.row_sources(ids.shape, ids.device)
        if proposal.ids is not None:
            kept = (sources == LOOKUP)[:, :1]  # a row with fixed drafts keeps them
            ids = torch.where(kept, proposal.ids, ids)
            found = torch.where(kept, sources == LOOKUP, found)
            confidence = torch.where(kept, proposal.fixed_confidence(), confidence)
        return Proposal(proposal.logits, ids, torch.where(found, LOOKUP, sources), confidence)
