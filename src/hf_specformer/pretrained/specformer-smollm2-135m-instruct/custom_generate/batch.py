"""Ragged-batch state of speculative generation: per-row tokens, cache validity, positions.

Rows accept different numbers of drafts each step. Instead of re-padding or copying the KV cache, every row feeds
the same number of inputs (its last token plus k drafts) and the cache grows by k + 1 columns per step for all rows;
columns of rejected drafts are then *holes*: `attention_mask` hides them from later queries, and positions come from
the per-row count of valid entries (`lengths`), never from the cache column. Example, k = 2, two rows:

    step inputs        row 0: [t, d1, d2] accepts 2 -> mask 1 1 1      row 1: [t, d1, d2] accepts 0 -> mask 1 0 0
    lengths (= next position id)  row 0: +3                              row 1: +1

The holes cost attention over a few extra keys; `compact` squeezes them out when they dominate the cache.
Rows that finish are marked `finished` and dropped from the batch (`select_rows`) once that takes the batch down to
a smaller `padded_batch_size`; until then they stay as padding that commits nothing (as plain `generate` keeps them).
Rows join through `admission` (a batch of the new rows alone, for their prefill) and `join`: every row at the start,
and, when a call decodes fewer rows at once than it holds (continuous batching, `admission.py`), waiting rows as
running ones finish.

Token layout: `tokens[b]` = left-padded prompt (width `prompt_width`) followed by the row's generated tokens
(`num_generated[b]` of them), then scratch space where tentative drafts are written so logits processors can read
a row's exact prefix. Entries past a row's prefix are `pad_token_id` or stale drafts; `sequences` pads them, so it
returns what `generate` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def padded_batch_size(num_live: int) -> int:
    """Rows a batch keeps while `num_live` rows still generate: a power of two up to 8, a multiple of 8 above (0 for
    none); finished rows fill the difference. Dropping a row does not always make a step cheaper (on the CPU a step
    of 3 or 7 rows cost no less than one of 4 or 8; GPU kernels tile rows by 8 and more), and plain `generate` keeps
    every row, so keeping these never costs more than it does."""
    if num_live <= 8:
        return 1 << (num_live - 1).bit_length() if num_live else 0
    return -(-num_live // 8) * 8


@dataclass
class RaggedBatch:
    """State of one speculative `generate` call. Shapes: B0 = rows given, B = rows in the batch, S = cache columns.

    Attributes:
        tokens: `[B0, prompt_width + max_new_tokens + k + 1]` prompt, generated tokens, draft scratch space.
        prompt_width: width of the left-padded prompt.
        num_generated: `[B0]` committed new tokens per row.
        row_ids: `[B]` original row index of each active row.
        attention_mask: `[B, S]` 1 where a cache column holds a valid entry of that row.
        lengths: `[B]` valid cache entries per active row (the position id of the row's next input).
        pad_token_id: what `sequences` puts after each row's end.
        finished: `[B]` rows that have ended and stay only as padding (they verify and commit nothing).
        num_live, max_length: rows not finished and the largest of `lengths`, as of the last `refresh` (host ints;
            `max_length` is an upper bound once rows are dropped).
        max_prefix: an upper bound of the longest committed prefix, kept on the host without reading the device.
        prompt_attention_mask: `[B0, P]` the prompts' attention mask (1 on real tokens), for `admission`.
    """

    tokens: torch.LongTensor
    prompt_width: int
    num_generated: torch.LongTensor
    row_ids: torch.LongTensor
    attention_mask: torch.LongTensor
    lengths: torch.LongTensor
    pad_token_id: int
    finished: torch.BoolTensor
    num_live: int = 0
    max_length: int = 0
    max_prefix: int = 0
    prompt_attention_mask: torch.LongTensor | None = None

    @classmethod
    def start(
        cls, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, capacity: int, pad_token_id: int
    ) -> "RaggedBatch":
        """A batch with no active rows yet (`admission` and `join` bring them in). input_ids `[B0, P]` (left
        padded), attention_mask `[B0, P]` or None (no padding); capacity = new tokens the buffer must hold beyond
        the prompt (max_new_tokens + drafts of one step)."""
        batch, width = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        tokens = torch.full((batch, width + capacity), pad_token_id, dtype=torch.long, device=input_ids.device)
        tokens[:, :width] = input_ids
        empty = torch.zeros(0, dtype=torch.long, device=input_ids.device)
        return cls(
            tokens=tokens,
            prompt_width=width,
            num_generated=torch.zeros(batch, dtype=torch.long, device=input_ids.device),
            row_ids=empty,
            attention_mask=torch.zeros(0, 0, dtype=torch.long, device=input_ids.device),
            lengths=empty,
            pad_token_id=pad_token_id,
            finished=empty.bool(),
            prompt_attention_mask=attention_mask.long(),
        )

    def admission(self, rows: torch.LongTensor, width: int) -> "RaggedBatch":
        """A batch of the rows `rows` (`[n]`, original row indices) alone, for their prefill: it shares `tokens`
        and `num_generated` with this one, and its attention mask is their prompt mask's last `width` columns (the
        columns before hold padding in every one of these rows). `join` adds it to this batch afterwards."""
        attention_mask = self.prompt_attention_mask[rows, self.prompt_width - width:]
        zeros = torch.zeros(rows.numel(), dtype=torch.long, device=rows.device)
        return RaggedBatch(self.tokens, self.prompt_width, self.num_generated, rows, attention_mask, zeros,
                           self.pad_token_id, zeros.bool(), num_live=rows.numel(), max_prefix=self.prompt_width,
                           prompt_attention_mask=self.prompt_attention_mask)

    def prompt_ids(self) -> torch.LongTensor:
        """`[B, w]` the active rows' prompts in the last w = `attention_mask.shape[1]` prompt columns (a batch
        from `admission`, before its prefill)."""
        width = self.attention_mask.shape[1]
        return self.tokens[self.row_ids, self.prompt_width - width: self.prompt_width]

    def join(self, other: "RaggedBatch") -> None:
        """Appends the rows of `other` (an `admission` batch after its prefill) to the active rows. Cache columns
        are matched by position, the shorter mask padded with hidden columns on the right (the caches are joined
        the same way: `PreallocatedCache.append_rows`)."""
        width = max(self.attention_mask.shape[1], other.attention_mask.shape[1])
        self.attention_mask = torch.cat([torch.nn.functional.pad(mask, (0, width - mask.shape[1]))
                                         for mask in (self.attention_mask, other.attention_mask)])
        self.row_ids = torch.cat([self.row_ids, other.row_ids])
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.finished = torch.cat([self.finished, other.finished])
        self.num_live += other.num_live
        self.max_length = max(self.max_length, other.attention_mask.shape[1])
        self.max_prefix = max(self.max_prefix, other.max_prefix)

    @property
    def size(self) -> int:
        """B, the number of active rows."""
        return self.row_ids.numel()

    def prefix_lengths(self) -> torch.LongTensor:
        """`[B]` token count of each active row's committed prefix (prompt width + generated)."""
        return self.prompt_width + self.num_generated[self.row_ids]

    def prompt_position_ids(self) -> torch.LongTensor:
        """`[B, P]` positions of the left-padded prompt: cumulative count of real tokens (as `generate` does)."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def step_inputs(self, num_inputs: int) -> tuple[torch.LongTensor, torch.LongTensor]:
        """Attention mask `[B, S + T]` (new columns visible) and position ids `[B, T]` for T = num_inputs inputs."""
        ones = torch.ones(self.size, num_inputs, dtype=torch.long, device=self.lengths.device)
        offsets = torch.arange(num_inputs, device=self.lengths.device)
        return torch.cat([self.attention_mask, ones], dim=1), self.lengths[:, None] + offsets

    def commit_prompt(self) -> None:
        """Records the prompt's cache columns: valid where the prompt mask is 1."""
        self.lengths = self.attention_mask.sum(-1)

    def commit_cache(self, num_valid: torch.LongTensor, num_inputs: int) -> None:
        """After a forward of T = num_inputs inputs, the first `num_valid[b]` columns of row b are kept."""
        offsets = torch.arange(num_inputs, device=num_valid.device)
        new_columns = (offsets[None, :] < num_valid[:, None]).long()  # [B, T]
        self.attention_mask = torch.cat([self.attention_mask, new_columns], dim=1)
        self.lengths = self.lengths + num_valid

    def write(self, tokens: torch.LongTensor, offset: int = 0) -> None:
        """Writes `[B, n]` tokens of the active rows right after their committed prefix (+ offset), unmasked."""
        columns = self.prefix_lengths()[:, None] + offset + torch.arange(tokens.shape[1], device=tokens.device)
        self.tokens[self.row_ids[:, None], columns] = tokens

    def next_tokens(self, source_index: torch.LongTensor, num_inputs: int) -> torch.LongTensor:
        """After a forward of T = num_inputs inputs and its commit: `[B, T]` the token that follows each input, where
        `source_index` `[B]` is each row's last accepted input (followed by the row's last committed token). Entries
        after it read the scratch space; they belong to rejected inputs, which the caches hide. (A row cut short by
        a stopping criterion is misaligned here, but it is retired before it drafts again.)"""
        start = self.prefix_lengths() - 1 - source_index
        columns = start[:, None] + torch.arange(num_inputs, device=start.device)
        return self.tokens[self.row_ids[:, None], columns.clamp(max=self.tokens.shape[1] - 1)]

    def commit_tokens(self, tokens: torch.LongTensor, counts: torch.LongTensor) -> None:
        """Appends the first `counts[b]` of `tokens[b]` (`[B, n]`) to each active row's generated tokens."""
        self.write(tokens)
        self.num_generated[self.row_ids] += counts
        self.max_prefix += tokens.shape[1]

    def refresh(self, reads: Callable[[torch.Tensor], torch.Tensor], *extra: torch.Tensor) -> list[int]:
        """One host read (`reads`, e.g. `host.HostReads`) of the rows still live, the longest row's valid cache
        entries and the scalar tensors `extra`, returned as ints: what `rows_to_keep`, `removable_fraction` and
        `compaction_index` use until the next refresh."""
        values = reads(torch.stack([(~self.finished).sum(), self.lengths.max(), *extra])).tolist()
        self.num_live, self.max_length = values[0], values[1]
        return values[2:]

    def select_rows(self, keep: torch.LongTensor) -> None:
        """Keeps the active rows at positions `keep` (`[B']`, indices into the active rows); with none left, no cache
        columns either (as the caches do: `PreallocatedLayer.batch_select_indices`)."""
        self.row_ids = self.row_ids[keep]
        self.attention_mask = self.attention_mask[keep, : self.attention_mask.shape[1] if keep.numel() else 0]
        self.lengths = self.lengths[keep]
        self.finished = self.finished[keep]

    def rows_to_keep(self) -> torch.LongTensor | None:
        """`[B']` the rows to keep (every unfinished row, and finished ones up to `padded_batch_size`), or None when
        the batch keeps its size (`num_live` as of the last `refresh`)."""
        num_live = self.num_live
        size = padded_batch_size(num_live)
        if size >= self.size:
            return None
        padding_rank = self.finished.long().cumsum(0)  # 1.. over finished rows
        kept = ~self.finished | (padding_rank <= size - num_live)  # exactly `size` rows: no host read to find them
        return kept.long().argsort(descending=True, stable=True)[:size]  # stable: in row order

    def live_rows(self) -> torch.LongTensor:
        """`[num_live]` the unfinished rows, in order (`num_live` as of the last `refresh`, exact right after it)."""
        return (~self.finished).long().argsort(descending=True, stable=True)[: self.num_live]

    def removable_fraction(self) -> float:
        """Share of cache columns that compaction would remove: those beyond the longest active row's valid entries.
        (Holes of shorter rows stay: a cache is rectangular, so rows of very different lengths keep padding however
        often it is compacted; counting those would compact, i.e. copy the whole cache, on every step.)"""
        return 1.0 - self.max_length / max(self.attention_mask.shape[1], 1)

    def compaction_index(self) -> torch.LongTensor:
        """`[B, L]` cache columns to gather so each row's valid entries are right-aligned in L = max length columns.

        Rows shorter than L are filled on the left with one of their own padding/hole columns (masked anyway).
        """
        width = self.max_length
        order = torch.argsort(self.attention_mask, dim=1, stable=True)  # holes first, valid entries in order last
        return order[:, -width:]

    def compact(self, index: torch.LongTensor) -> None:
        """Applies `compaction_index` to the mask (the caller gathers the KV caches with the same index)."""
        self.attention_mask = torch.gather(self.attention_mask, 1, index)

    def sequences(self) -> torch.LongTensor:
        """`[B0, prompt_width + max generated]`: what `generate` returns (pad after each row's end)."""
        width = self.prompt_width + int(self.num_generated.max())
        columns = torch.arange(width, device=self.tokens.device)[None, :]
        past_end = columns >= (self.prompt_width + self.num_generated)[:, None]
        return self.tokens[:, :width].masked_fill(past_end, self.pad_token_id)
