"""The ragged batch: per-row tokens, cache validity and positions, and the rows waiting for a slot.

Every row feeds the same number of inputs; columns of rejected drafts are *holes* hidden by the validity mask, and
positions count each row's valid entries (row 0 accepts 2 of [t, d1, d2]: mask 1 1 1, +3; row 1 none: 1 0 0, +1).
`compact` squeezes holes out; finished rows stay as padding until the batch can shrink.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

ADMISSION_SHARE = 8
"""Waiting rows are admitted once 1 / ADMISSION_SHARE of the slots are free: each admission costs a prefill call."""


def padded_batch_size(num_live: int) -> int:
    """Rows kept while `num_live` still generate: a power of two up to 8, a multiple of 8 above (kernels tile rows,
    and fewer shapes mean fewer graphs)."""
    if num_live <= 8:
        return 1 << (num_live - 1).bit_length() if num_live else 0
    return -(-num_live // 8) * 8


@dataclass
class RaggedBatch:
    """The rows of one call. Shapes: B0 = rows of the call, B = active rows, C = cache capacity; `host_*`, `num_live`,
    `max_length` and `min_length` are as of the last host read."""

    tokens: torch.LongTensor  # [B0, P + max_new_tokens + k + 1] prompts, generated tokens, draft scratch
    prompt_width: int  # P, the left-padded prompts' width
    num_generated: torch.LongTensor  # [B0] committed new tokens per row
    row_ids: torch.LongTensor  # [B] the call's row index of each active row
    valid: torch.LongTensor  # [slots, C] 1 where a cache column holds a valid entry of active row b (0 past `columns`)
    columns: int  # cache columns in use (the same for every row)
    lengths: torch.LongTensor  # [B] valid entries per active row: the position of its next input
    finished: torch.BoolTensor  # [B] rows that ended and stay only as padding
    pad_token_id: int  # what `sequences` puts after each row's end
    prompt_mask: torch.LongTensor  # [B0, P] 1 on the prompts' real tokens
    max_new: torch.LongTensor  # [B0] new tokens each row may generate
    prompt_lengths: list[int] = field(default_factory=list)  # [B0] real prompt tokens (an admission's width, groups)
    host_rows: list[int] = field(default_factory=list)  # `row_ids` on the host
    host_finished: list[bool] = field(default_factory=list)  # `finished` on the host
    num_live: int = 0  # rows not finished
    max_length: int = 0  # the largest of `lengths`
    max_prefix: int = 0  # on the host: bounds of the longest and shortest committed prefix of the live rows
    min_prefix: int = 0
    positions: torch.LongTensor | None = None  # [capacity] 0, 1, ... (for masks and offsets, allocated once)
    causal: dict = field(default_factory=dict)  # (T, dtype) -> [T, C + T] a step's additive causal mask (`_causal`)
    min_length: int = 0  # the smallest of `lengths`

    @classmethod
    def start(cls, input_ids, attention_mask, max_new_tokens: int, new_columns: int, slots: int, capacity: int,
              pad_token_id: int):
        """A batch with no active rows yet, for left-padded prompts `[B0, P]`; tokens hold `new_columns` more."""
        device = input_ids.device
        tokens = torch.full((input_ids.shape[0], input_ids.shape[1] + new_columns), pad_token_id, device=device)
        tokens[:, : input_ids.shape[1]] = input_ids
        empty = torch.zeros(0, dtype=torch.long, device=device)
        prompt_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        return cls(tokens, input_ids.shape[1], torch.zeros_like(input_ids[:, 0]), empty,
                   torch.zeros(slots, capacity, dtype=torch.long, device=device), 0, empty, empty.bool(),
                   pad_token_id, prompt_mask, torch.full_like(input_ids[:, 0], max_new_tokens),
                   prompt_mask.sum(1).tolist(),
                   positions=torch.arange(max(capacity, tokens.shape[1]), device=device))

    @property
    def size(self) -> int:
        """B, the active rows."""
        return self.row_ids.numel()

    @property
    def attention_mask(self) -> torch.LongTensor:
        """`[B, columns]` validity of the used cache columns."""
        return self.valid[: self.size, : self.columns]

    def admission(self, rows: list[int]) -> "RaggedBatch":
        """The waiting `rows` alone, for their prefill over their prompts' last W columns (W: the longest)."""
        row_ids = torch.tensor(rows, device=self.tokens.device)
        width = max(1, max(self.prompt_lengths[row] for row in rows))
        zeros = torch.zeros_like(row_ids)
        return RaggedBatch(self.tokens, self.prompt_width, self.num_generated, row_ids,
                           self.prompt_mask[row_ids, self.prompt_width - width:].clone(), width, zeros, zeros.bool(),
                           self.pad_token_id, self.prompt_mask, self.max_new, self.prompt_lengths, list(rows),
                           [False] * len(rows), len(rows), 0, self.prompt_width, self.prompt_width, self.positions)

    def prefill_groups(self, rows: list[int]) -> list[list[int]]:
        """`rows` in groups of one prefill each, longest first, a group's prompts within twice each other's lengths
        (padding stays under half a prefill)."""
        groups: list[list[int]] = []
        for row in sorted(rows, key=lambda r: -self.prompt_lengths[r]):
            if groups and 2 * self.prompt_lengths[row] >= self.prompt_lengths[groups[-1][0]]:
                groups[-1].append(row)
            else:
                groups.append([row])
        return [sorted(group, key=rows.index) for group in groups]

    def add_prompts(self, rows: list[int], prompts: list[list[int]], max_new: list[int]) -> None:
        """Writes `prompts` (at most P tokens each), left padded, into the call's `rows`, growing the call's rows."""
        grow = max(rows) + 1 - len(self.tokens)
        if grow > 0:
            self.prompt_lengths += [0] * grow
            self.tokens = torch.cat([self.tokens, torch.full_like(self.tokens[:1], self.pad_token_id).expand(grow, -1)])
            self.prompt_mask, self.num_generated, self.max_new = (
                torch.cat([t, t.new_zeros(grow, *t.shape[1:])]) for t in (self.prompt_mask, self.num_generated,
                                                                          self.max_new))
        for row, ids, limit in zip(rows, prompts, max_new, strict=True):
            start = self.prompt_width - len(ids)
            self.tokens[row], self.prompt_mask[row], self.num_generated[row] = self.pad_token_id, 0, 0
            self.tokens[row, start: self.prompt_width] = torch.tensor(ids, device=self.tokens.device)
            self.prompt_mask[row, start:], self.max_new[row], self.prompt_lengths[row] = 1, limit, len(ids)

    def prompt_ids(self) -> torch.LongTensor:
        """`[B, W]` an admission's prompts in their last W columns."""
        return self.tokens[self.row_ids, self.prompt_width - self.columns: self.prompt_width]

    def prompt_position_ids(self) -> torch.LongTensor:
        """`[B, W]` positions of an admission's left-padded prompts (as `generate` counts them)."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def commit_prompt(self) -> None:
        self.lengths = self.attention_mask.sum(-1)

    def join(self, other: "RaggedBatch") -> None:
        """Appends the rows of `other` (an admission after its prefill); columns are matched from the left."""
        start, added = self.size, other.size
        self.valid[start : start + added] = 0
        self.valid[start : start + added, : other.columns] = other.valid
        self.columns = max(self.columns, other.columns)
        self.row_ids = torch.cat([self.row_ids, other.row_ids])
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.finished = torch.cat([self.finished, other.finished])
        self.host_rows, self.host_finished = self.host_rows + other.host_rows, self.host_finished + other.host_finished
        self.num_live += other.num_live
        self.max_length = max(self.max_length, other.columns)
        self.max_prefix = max(self.max_prefix, other.max_prefix)
        self.min_prefix = min(self.min_prefix, other.min_prefix) if start else other.min_prefix

    def prefix_lengths(self) -> torch.LongTensor:
        """`[B]` tokens in each active row's committed prefix."""
        return self.prompt_width + self.num_generated[self.row_ids]

    def step_mask(self, verified: torch.Tensor | int, shape: str = "2d", dtype: torch.dtype | None = None):
        """The forward's mask over the cache and the T new inputs a row verifies (`verified` `[B, T]`, or T for all):
        "2d" `[B, S + T]`, or "float" `[B, 1, T, S + T]`, causal and additive in `dtype`; None for one input without
        holes."""
        start, num_inputs = self.columns, verified if isinstance(verified, int) else verified.shape[1]
        if isinstance(verified, int) and self.min_length == start and (num_inputs == 1 or shape == "float"):
            return None if num_inputs == 1 else \
                self._causal(num_inputs, dtype)[:, -start - num_inputs:].expand(self.size, 1, -1, -1)
        self.valid[: self.size, start : start + num_inputs] = 1 if isinstance(verified, int) else verified
        mask = self.valid[: self.size, : start + num_inputs]
        if shape == "2d":
            return mask
        causal = self._causal(num_inputs, dtype)[:, -start - num_inputs:]  # [T, S + T]
        return causal.masked_fill(mask[:, None, None, :] == 0, torch.finfo(dtype).min)

    def _causal(self, num_inputs: int, dtype: torch.dtype) -> torch.Tensor:
        """`[T, C + T]` additive causal mask (C = capacity); its last S + T columns serve a step at column S."""
        if (num_inputs, dtype) not in self.causal:
            capacity = self.valid.shape[1]
            columns = torch.arange(capacity + num_inputs, device=self.valid.device)
            hidden = columns[None, :] > capacity + columns[:num_inputs, None]
            self.causal[num_inputs, dtype] = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
                hidden, torch.finfo(dtype).min)
        return self.causal[num_inputs, dtype]

    def commit_cache(self, num_valid: torch.LongTensor, num_inputs: int) -> None:
        """After a forward of T inputs, the first `num_valid[b]` new columns of row b are kept."""
        offsets = self.positions[:num_inputs]
        self.valid[: self.size, self.columns : self.columns + num_inputs] = offsets < num_valid[:, None]
        self.columns += num_inputs
        self.lengths = self.lengths + num_valid

    def write(self, tokens: torch.LongTensor, offset: int = 0, generated: torch.LongTensor | None = None) -> None:
        """Writes `[B, n]` tokens, uncommitted, after each active row's prefix (+ offset)."""
        generated = self.num_generated[self.row_ids] if generated is None else generated
        columns = (generated + (self.prompt_width + offset))[:, None] + self.positions[: tokens.shape[1]]
        self.tokens[self.row_ids[:, None], columns] = tokens

    def commit_tokens(self, tokens: torch.LongTensor, counts: torch.LongTensor,
                      generated: torch.LongTensor | None = None) -> None:
        """Appends the first `counts[b]` of `tokens[b]` `[B, n]` to each active row (`generated`: as for `write`)."""
        generated = self.num_generated[self.row_ids] if generated is None else generated
        self.write(tokens, generated=generated)
        self.num_generated[self.row_ids] = generated + counts
        self.max_prefix += tokens.shape[1]
        self.min_prefix += 1  # every live row commits at least one token

    def next_tokens(self, last_accepted: torch.LongTensor, num_inputs: int) -> torch.LongTensor:
        """After a forward of T inputs and its commit: `[B, T]` the token after each input (scratch after the last
        accepted one, `last_accepted` `[B]`)."""
        start = self.prefix_lengths() - 1 - last_accepted
        columns = start[:, None] + torch.arange(num_inputs, device=start.device)
        return self.tokens[self.row_ids[:, None], columns.clamp(max=self.tokens.shape[1] - 1)]

    def select_rows(self, keep: list[int]) -> torch.LongTensor:
        """Keeps the active rows `keep` (host indices); returns them on the device, for the caches."""
        index = torch.tensor(keep, dtype=torch.long, device=self.tokens.device)
        self.valid[: len(keep)] = self.valid[index]
        self.row_ids, self.lengths, self.finished = self.row_ids[index], self.lengths[index], self.finished[index]
        self.host_rows = [self.host_rows[i] for i in keep]
        self.host_finished = [self.host_finished[i] for i in keep]
        self.num_live = self.host_finished.count(False)
        if not keep:
            self.columns = 0
        return index

    def rows_to_keep(self) -> list[int] | None:
        """Every live row and finished ones up to `padded_batch_size`, in order; None: keep them all."""
        size = padded_batch_size(self.num_live)
        if size >= self.size:
            return None
        padding = [i for i, done in enumerate(self.host_finished) if done][: size - self.num_live]
        return sorted([i for i, done in enumerate(self.host_finished) if not done] + padding)

    def live_rows(self) -> list[int]:
        return [i for i, done in enumerate(self.host_finished) if not done]

    def removable_fraction(self) -> float:
        """Share of the used columns beyond the longest row's valid entries (what `compact` removes)."""
        return 1.0 - self.max_length / max(self.columns, 1)

    def compaction_index(self) -> torch.LongTensor:
        """`[B, L]` columns to gather so each row's valid entries are right-aligned in L = `max_length` columns."""
        order = torch.argsort(self.attention_mask, dim=1, stable=True)  # holes first, valid entries in order last
        return order[:, -self.max_length:] if self.max_length else order[:, :0]

    def compact(self, index: torch.LongTensor) -> None:
        """Applies `compaction_index` to the mask (the caller gathers the caches with it)."""
        self.valid[: self.size, : index.shape[1]] = self.attention_mask.gather(1, index)
        self.valid[: self.size, index.shape[1] : self.columns] = 0
        self.columns = index.shape[1]

    def sequences(self) -> torch.LongTensor:
        """`[B0, P + most generated]`: what `generate` returns, padded after each row's end."""
        width = self.prompt_width + int(self.num_generated.max())
        columns = torch.arange(width, device=self.tokens.device)[None, :]
        past_end = columns >= (self.prompt_width + self.num_generated)[:, None]
        return self.tokens[:, :width].masked_fill(past_end, self.pad_token_id)


class Admissions:
    """The rows waiting for a slot, in order; `due` says which join now."""

    def __init__(self, num_rows: int, slots: int):
        if slots < 1:
            raise ValueError(f"slots={slots} must be at least 1.")
        self.slots = slots
        self.min_free = max(1, slots // ADMISSION_SHARE)
        self.waiting = deque(range(num_rows))

    def due(self, num_live: int) -> list[int]:
        """The rows to admit now, with `num_live` rows still generating."""
        free = self.slots - num_live
        if not self.waiting or (free < min(self.min_free, len(self.waiting)) and num_live):
            return []
        return [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]


@dataclass(eq=False)
class NewRow:
    """A request joining a running call through its `RowFeed` (temperature 0: greedy; else sampling seeded by
    `seed`); `row`, its index among the call's rows, is set when the engine takes it."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    row: int | None = None


class RowFeed:
    """A `row_finished` callback that keeps a call running (a server's engine): rows join and are cancelled between
    steps (`poll`), each step's tokens are told (`committed`) and each row's end (`__call__`)."""

    def __init__(self, initial_rows: list[NewRow]):
        self.initial_rows = initial_rows

    def __call__(self, row) -> None:
        """The call's row `row.row` ended (`FinishedRow`)."""

    def poll(self, idle: bool) -> tuple[list[NewRow], list[NewRow]] | None:
        """(rows joining, rows to cancel), which it may wait for while `idle`; None: the call ends once idle."""
        return None

    def committed(self, rows: list[int], tokens: list[list[int]]) -> None:
        """The tokens each of the call's `rows` committed in the last step (its first token, at its admission)."""
