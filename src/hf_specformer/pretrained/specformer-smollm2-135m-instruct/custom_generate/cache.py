"""A KV cache allocated once per call (`[slots, H, capacity, D]` per layer), written in place where `DynamicCache`
concatenates; sliding-window layers are served as full ones, only while the cache fits the window."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


def cache_capacity(prompt_width: int, max_new_tokens: int, num_draft_tokens: int) -> int:
    """Columns a call's caches hold: the prompt, and twice the new tokens and a step's drafts (room for holes)."""
    return prompt_width + 2 * (max_new_tokens + num_draft_tokens + 1)


def kv_bytes_per_column(config, num_layers: int, dtype: torch.dtype) -> int:
    """Bytes one row's cache column takes in `num_layers` attention layers of a model with `config`."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return num_layers * 2 * heads * head_dim * dtype.itemsize


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers `[slots, H, capacity, D]`; `keys`/`values` view the used columns."""

    def __init__(self, capacity: int, is_sliding: bool = False, slots: int | None = None):
        super().__init__()
        self.capacity, self.is_sliding, self.slots = capacity, is_sliding, slots
        self.length = 0
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, slots: int | None = None):
        """Buffers for `slots` rows, uninitialised: every column attention reads is written first."""
        slots = slots or self.slots or key_states.shape[0]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_buffer = key_states.new_empty(slots, key_states.shape[1], self.capacity, key_states.shape[3])
        self.value_buffer = value_states.new_empty(slots, value_states.shape[1], self.capacity, value_states.shape[3])
        self.is_initialized = True
        self._view(key_states.shape[0])

    def _view(self, batch: int) -> None:
        """`rows`: the buffers' first `batch` rows `[B, H, capacity, D]`, kept between forwards."""
        self.rows = (self.key_buffer[:batch], self.value_buffer[:batch])
        self.keys, self.values = (rows[:, :, : self.length] for rows in self.rows)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Writes `[B, H, T, D]` new columns after the used ones; returns the used columns `[B, H, length, D]`."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"PreallocatedLayer holds {self.capacity} columns; {end} were asked for.")
        if key_states.shape[0] != self.rows[0].shape[0]:
            self._view(key_states.shape[0])
        self.rows[0].narrow(2, self.length, key_states.shape[2]).copy_(key_states)
        self.rows[1].narrow(2, self.length, key_states.shape[2]).copy_(value_states)
        self.length = end
        self.keys, self.values = self.rows[0].narrow(2, 0, end), self.rows[1].narrow(2, 0, end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.capacity

    def crop(self, tokens_to_remove: int) -> None:
        """Forgets the last `-tokens_to_remove` columns (a negative count, as `DynamicLayer.crop` takes)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of columns to remove.")
        self.length = max(self.length + tokens_to_remove, 0)
        if self.is_initialized:
            self._view(self.keys.shape[0])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps the active rows `indices` `[B']`, moved to the front; with none left, no columns either."""
        if not indices.numel():
            self.length = 0
        elif self.is_initialized:
            for buffer in (self.key_buffer, self.value_buffer):
                buffer[: indices.numel(), :, : self.length] = buffer[indices, :, : self.length]
        if self.is_initialized:
            self._view(indices.numel())

    def append_rows(self, other: "PreallocatedLayer", slots: int) -> None:
        """Appends `other`'s rows after the active ones, both padded with zeros (masked, but a NaN of stale memory
        would survive a softmax weight of 0) to the longer's columns."""
        if not other.is_initialized:
            return
        if not self.is_initialized:
            self.lazy_initialization(other.keys[:0], other.values[:0], slots)
        batch, added = self.keys.shape[0], other.keys.shape[0]
        if batch + added > self.key_buffer.shape[0]:
            raise RuntimeError(f"PreallocatedLayer holds {self.key_buffer.shape[0]} rows; {batch + added} asked for.")
        length = max(self.length, other.length)
        for buffer, new in ((self.key_buffer, other.keys), (self.value_buffer, other.values)):
            buffer[:batch, :, self.length : length] = 0
            buffer[batch : batch + added, :, : other.length] = new
            buffer[batch : batch + added, :, other.length : length] = 0
        self.length = length
        self._view(batch + added)

    def gather_columns(self, index: torch.LongTensor) -> None:
        """Keeps, per row, the used columns `index` `[B, L]`, which become the first L."""
        if not self.is_initialized:
            return
        batch, length = index.shape
        for buffer in (self.key_buffer, self.value_buffer):
            active = buffer[:batch, :, : self.length]
            expanded = index[:, None, :, None].expand(-1, active.shape[1], -1, active.shape[3])
            buffer[:batch, :, :length] = active.gather(2, expanded)
        self.length = length
        self._view(batch)


class PreallocatedCache(Cache):
    """A `Cache` of `num_layers` `PreallocatedLayer`s of `capacity` columns and `slots` rows (None: those of the
    first states written); `sliding`: per layer, whether it is a sliding-window one."""

    def __init__(self, num_layers: int, capacity: int, sliding: list[bool] | None = None, slots: int | None = None):
        sliding = sliding or [False] * num_layers
        super().__init__(layers=[PreallocatedLayer(capacity, is_sliding, slots) for is_sliding in sliding])
        self.capacity = capacity

    @classmethod
    def like(cls, cache: Cache, num_layers: int, capacity: int, slots: int | None = None) -> "PreallocatedCache":
        """A preallocated cache with the layer kinds of `cache` (a fresh `DynamicCache`)."""
        sliding = [bool(getattr(layer, "is_sliding", False)) for layer in cache.layers] or None
        return cls(len(cache.layers) or num_layers, capacity, sliding, slots)

    @property
    def columns(self) -> int:
        """Used columns (the same in every layer)."""
        return self.layers[0].length

    def append_rows(self, other: "PreallocatedCache", slots: int) -> None:
        """`PreallocatedLayer.append_rows` in every layer."""
        for layer, new in zip(self.layers, other.layers, strict=True):
            layer.append_rows(new, slots)

    def gather_columns(self, index: torch.LongTensor) -> None:
        """`PreallocatedLayer.gather_columns` in every layer."""
        for layer in self.layers:
            layer.gather_columns(index)
