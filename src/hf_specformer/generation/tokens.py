"""From scores to committed tokens.

- `RaggedLogitsProcessor`: position j of row b is processed with its own prefix `tokens[b, :prefix[b] + j]`, in calls
  over all B0 rows in order (processors may keep per-row state); processors that never read it run once.
- `TokenSelector`: argmax, a sample, or a *seeded* sample: Gumbel-max with noise keyed by (seed, position, token),
  fixed before any draft is seen, so the text does not depend on what was drafted or batched.
- `Committer`: appends tokens, cutting rows exactly where plain `generate` stops.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .batch import RaggedBatch
from .verification import greedy_tokens

PREFIX_FREE_PROCESSORS = (lp.EpsilonLogitsWarper, lp.EtaLogitsWarper, lp.MinPLogitsWarper, lp.TopKLogitsWarper,
                          lp.SuppressTokensLogitsProcessor, lp.TemperatureLogitsWarper, lp.TopPLogitsWarper,
                          lp.TypicalLogitsWarper)
"""Processors that never read `input_ids`: they run once over all positions."""

LENGTH_PROCESSORS = (lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor)
"""Processors that read only the prefix's length (they block EOS below it): applied first, vectorised over all
positions (every other processor leaves a blocked -inf at -inf, and warpers come after them in `generate`)."""

_GOLDEN, _MIX_1, _MIX_2 = -7046029254386353131, -4658895280553007687, -7723592293110705685  # SplitMix64's, as int64


class RaggedLogitsProcessor:
    """Applies processors to `[B, T, V]` logits whose position j of row b has prefix length `prefix[b] + j`."""

    def __init__(self, logits_processor):
        processors = list(logits_processor or [])
        lengths = {}  # EOS ids -> (the length below which they are blocked: the largest of their processors', EOS)
        for p in (p for p in processors if isinstance(p, LENGTH_PROCESSORS)):
            length = p.min_length if isinstance(p, lp.MinLengthLogitsProcessor) else p.prompt_length_to_skip + \
                p.min_new_tokens
            key = tuple(p.eos_token_id.tolist())
            lengths[key] = (max(length, lengths.get(key, (0,))[0]), p.eos_token_id)
        self.min_lengths = list(lengths.values())
        self.processors = [p for p in processors if not isinstance(p, LENGTH_PROCESSORS)]
        self.reads_prefix = any(not isinstance(p, PREFIX_FREE_PROCESSORS) for p in self.processors)

    def __call__(self, batch: RaggedBatch, logits: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """logits `[B, T, V]` -> processed float32 scores `[B, T, V]` (float32 logits are processed in place: the
        engine does not read them again); `offset` shifts every prefix."""
        blocking = [(length, eos) for length, eos in self.min_lengths if batch.min_prefix + offset < length]
        scores = logits if logits.dtype == torch.float32 else logits.float()
        for length, eos in blocking:  # not once every live row's prefix is past every minimum (on the host)
            eos = eos if eos.device == scores.device else eos.to(scores.device)
            if batch.max_prefix + offset + scores.shape[1] <= length:  # every position is below it
                scores.index_fill_(-1, eos, -torch.inf)
                continue
            lengths = batch.prefix_lengths()[:, None] + offset + batch.positions[: scores.shape[1]]
            scores[..., eos] = scores[..., eos].masked_fill((lengths < length)[..., None], -torch.inf)
        if not self.processors:
            return scores
        batch_size, num_positions, vocab = scores.shape
        if not self.reads_prefix:
            dummy_ids = batch.tokens[:1, :1].expand(batch_size * num_positions, 1)
            return self._apply(dummy_ids, scores.view(-1, vocab)).view(batch_size, num_positions, vocab)
        prefix = batch.prefix_lengths() + offset
        all_rows = scores.new_zeros(batch.tokens.shape[0], vocab)
        for length in prefix.unique().tolist():
            rows = (prefix == length).nonzero().squeeze(1)
            token_rows = batch.row_ids[rows]
            for j in range(num_positions):
                all_rows[token_rows] = scores[rows, j]
                scores[rows, j] = self._apply(batch.tokens[:, : length + j], all_rows)[token_rows]
        return scores

    def _apply(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        for processor in self.processors:  # not LogitsProcessorList: it reads every signature on every call
            scores = processor(input_ids, scores)
        return scores


def _shift_right(x: torch.LongTensor, bits: int) -> torch.LongTensor:
    """Logical right shift of int64 values (torch's `>>` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.LongTensor) -> torch.LongTensor:
    """SplitMix64's finaliser (multiplications wrap)."""
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    return x ^ _shift_right(x, 31)


def gumbel_noise(seeds: torch.LongTensor, positions: torch.LongTensor, vocab_size: int) -> torch.Tensor:
    """`[B, T, V]` Gumbel noise for `seeds` `[B]` at generated `positions` `[B, T]`, a function of (seed, position,
    token) alone (24-bit uniforms)."""
    keys = _mix(_mix(seeds[:, None] * _GOLDEN + positions) + _GOLDEN)
    bits = _shift_right(_mix(keys[..., None] + torch.arange(vocab_size, device=seeds.device) * _GOLDEN), 40)
    uniform = ((bits.float() + 0.5) * 2.0**-24).clamp(max=1 - 2.0**-24)  # the largest would round to 1: +inf
    return -torch.log(-torch.log(uniform))


def top_p_filter(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`[B, T, V]` scores outside each row's nucleus (`top_p` `[B]`) set to -inf."""
    ordered, order = scores.sort(-1, descending=True)
    probs = ordered.softmax(-1)
    outside = (probs.cumsum(-1) - probs >= top_p[:, None, None]) & (top_p < 1)[:, None, None]  # nucleus complete
    return scores.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), -torch.inf)


class TokenSelector:
    """Chooses tokens: argmax, a sample, or seeded (`seeds` `[B0]`), with per-row `temperature` and `top_p`."""

    def __init__(self, do_sample: bool, seeds: torch.LongTensor | None = None):
        self.do_sample = do_sample
        self.seeds = seeds
        self.temperature = self.top_p = None
        self.filters_top_p, self.sampled_rows = False, set()  # (on the host) some row's top_p < 1; rows that sample

    def set_rows(self, rows: list[int], seeds: list[int], temperature: list[float], top_p: list[float],
                 device) -> None:
        """Per-row seeded sampling settings of the call's `rows` (growing the tables to hold them)."""
        size, self.filters_top_p = max(rows) + 1, self.filters_top_p or min(top_p) < 1
        self.sampled_rows = (self.sampled_rows - set(rows)) | {row for row, t in zip(rows, temperature) if t > 0}
        for name, values in (("seeds", seeds), ("temperature", temperature), ("top_p", top_p)):
            table = getattr(self, name)
            if table is None:
                table = torch.zeros(0, dtype=torch.long if name == "seeds" else torch.float32, device=device)
            if len(table) < size:
                table = torch.cat([table, table.new_zeros(size - len(table))])
            table[rows] = torch.tensor(values, dtype=table.dtype, device=device)
            setattr(self, name, table)

    @property
    def rejection_sampling(self) -> bool:
        """Whether verification samples against the drafts' distributions (unseeded sampling)."""
        return self.do_sample and self.seeds is None

    def scores_to_verify(self, scores: torch.Tensor, batch: RaggedBatch, offset: int = 0) -> torch.Tensor:
        """`[B, T, V]` scores whose argmax is the token each position takes (seeded: plus the row's noise)."""
        if self.seeds is None:
            return scores
        if self.temperature is not None and self.sampled_rows.isdisjoint(batch.host_rows):
            return scores  # every row is greedy
        rows = batch.row_ids
        positions = batch.num_generated[rows, None] + offset + torch.arange(scores.shape[1], device=rows.device)
        noise = gumbel_noise(self.seeds[rows], positions, scores.shape[-1])
        if self.temperature is None:
            return scores + noise
        temperature, top_p = self.temperature[rows, None, None], self.top_p[rows]
        sampled = temperature > 0
        scores = torch.where(sampled, scores / temperature.clamp(min=1e-6), scores)
        return torch.where(sampled, (top_p_filter(scores, top_p) if self.filters_top_p else scores) + noise, scores)

    def __call__(self, scores: torch.Tensor, batch: RaggedBatch, offset: int = 0) -> torch.LongTensor:
        """`[B, T, V]` scores -> `[B, T]` tokens."""
        if not self.rejection_sampling:
            return greedy_tokens(self.scores_to_verify(scores, batch, offset))
        return torch.multinomial(scores.flatten(0, 1).softmax(-1), 1).view(scores.shape[:2])


def pad_token_id(generation_config: GenerationConfig) -> int:
    pad = generation_config._pad_token_tensor
    return int(pad) if pad is not None else 0


class Committer:
    """Appends committed tokens; other stopping criteria than EOS and length are checked after every token."""

    def __init__(self, stopping_criteria, generation_config: GenerationConfig, streamer=None):
        self.extra_criteria = StoppingCriteriaList(
            c for c in stopping_criteria or [] if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria)))
        self.eos_token_ids = generation_config._eos_token_tensor
        self.pad_token_id = pad_token_id(generation_config)
        self.streamer = streamer

    def __call__(self, batch: RaggedBatch, tokens: torch.LongTensor, counts: torch.LongTensor) -> torch.BoolTensor:
        """Commits the first `counts` `[B]` of `tokens` `[B, n]`, cut at EOS and limits -> finished `[B]`."""
        offsets = batch.positions[: tokens.shape[1]]
        generated = batch.num_generated[batch.row_ids]
        limit = batch.max_new[batch.row_ids] - generated  # [B] tokens a row may take: its remaining new tokens,
        if self.eos_token_ids is not None:  # and up to its first EOS (the count of the position after it)
            after = batch.positions[1: tokens.shape[1] + 1]
            limit = torch.where(torch.isin(tokens, self.eos_token_ids), after, limit[:, None]).amin(1)
        finished = batch.finished | (counts >= limit)
        counts = torch.minimum(counts, limit)
        if self.extra_criteria:
            batch.write(tokens)
            counts, finished = self._apply_extra_criteria(batch, counts, finished)
        batch.commit_tokens(tokens.masked_fill(offsets >= counts[:, None], self.pad_token_id), counts, generated)
        if self.streamer is not None:
            self.streamer.put(tokens[0, : int(counts[0])].cpu())
        return finished

    def _apply_extra_criteria(self, batch, counts, finished):
        prefix = batch.prefix_lengths()
        stopped = torch.zeros_like(finished)
        for j in range(1, int(counts.max()) + 1):
            candidates = (~stopped & (counts >= j)).nonzero().squeeze(1)
            for length in (prefix[candidates] + j).unique().tolist():
                rows = candidates[prefix[candidates] + j == length]
                hit = self.extra_criteria(batch.tokens[batch.row_ids[rows], :length], None).to(rows.device)
                stopped[rows[hit]] = True
                counts[rows[hit]] = j
        return counts, finished | stopped
