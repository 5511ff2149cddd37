"""What the frozen target gives training: its hidden states (all, or the drafter's 4 hooked ones), the token after
each position (the one home of the next-token rule), reply positions, and an in-memory cache of the states."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from hf_specformer.models.specformer import SpecFormerForDrafting
from hf_specformer.training.data import Batch


@torch.no_grad()
def next_token_ids(input_ids: torch.LongTensor) -> torch.LongTensor:
    """`[B, T]` -> `[B, T]`: x_{t+1} at t (the drafter's `next_token_ids`); the last column, which has no next token
    and no label, repeats the last input."""
    return torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)


def reply_positions(ids: torch.LongTensor, prompt_length: int) -> torch.LongTensor:
    """`[P]` the positions t of a sequence `ids` `[T]` whose next two tokens are reply tokens: the last prompt
    position up to T - 3 (where drafting starts once the target has committed x_{t+1}); none if a cut left no reply."""
    return torch.arange(prompt_length - 1, max(ids.numel() - 2, prompt_length - 1), device=ids.device)


def tokens_after(ids: torch.LongTensor, positions: torch.LongTensor, first: int, count: int) -> torch.LongTensor:
    """`[P, count]`: ids[t + first + j] for j < count at each position t, -1 past the end of the sequence."""
    padded = torch.cat([ids, ids.new_full((first + count,), -1)])
    return padded[positions[:, None] + first + torch.arange(count, device=ids.device)]


@torch.no_grad()
def target_hidden_states(target: PreTrainedModel, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The target's L + 1 hidden states `[B, T, d]` of a (right-padded) batch, without gradients."""
    output = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False,
                    logits_to_keep=1)
    return output.hidden_states


def hooked_target_states(target: PreTrainedModel, drafter: SpecFormerForDrafting, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The drafter's 4 hooked target states `[B, T, d]` of a (right-padded) batch, without gradients."""
    return drafter.select_hooked_states(target_hidden_states(target, input_ids, attention_mask))


class TargetStateCache:
    """The frozen target's states a training step reads per sequence: the hooked ones `[T, 4, d]` and the last
    `[T, d]`. With `keep`, each sequence runs alone and its states stay in memory (later epochs skip the target)."""

    def __init__(self, target: PreTrainedModel, drafter: SpecFormerForDrafting, keep: bool):
        self.target, self.drafter, self.keep = target, drafter, keep
        self.memory: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _split(self, hidden_states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's L + 1 states `[B, T, d]` -> hooked `[B, T, 4, d]` and last `[B, T, d]`."""
        hooked = torch.stack(self.drafter.select_hooked_states(hidden_states), dim=2)
        hook_layers = list(self.drafter.config.hook_layers)
        last_layer = len(hidden_states) - 1
        last = hooked[:, :, hook_layers.index(last_layer)] if last_layer in hook_layers else hidden_states[-1]
        return hooked, last

    def sequence(self, row_id: int, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """States of one sequence `[T]`: hooked `[T, 4, d]` and last `[T, d]`."""
        if row_id in self.memory:
            return self.memory[row_id]
        ids = input_ids[None]
        hooked, last = self._split(target_hidden_states(self.target, ids, torch.ones_like(ids)))
        hooked, last = hooked[0], last[0]
        if self.keep:
            self.memory[row_id] = (hooked, last)
        return hooked, last

    def batch(self, row_ids: Sequence[int], batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded (with zeros) states of a micro-batch: hooked `[B, T, 4, d]` and last `[B, T, d]`."""
        if not self.keep:
            hooked, last = self._split(target_hidden_states(self.target, batch.input_ids, batch.attention_mask))
            padding = ~batch.attention_mask.bool()
            return hooked.masked_fill(padding[..., None, None], 0), last.masked_fill(padding[..., None], 0)
        states = [self.sequence(row_id, ids[:length]) for row_id, ids, length in
                  zip(row_ids, batch.input_ids, batch.lengths.tolist())]
        hooked = torch.nn.utils.rnn.pad_sequence([hooked for hooked, _ in states], batch_first=True)
        last = torch.nn.utils.rnn.pad_sequence([last for _, last in states], batch_first=True)
        return hooked, last


def future_states(last: torch.Tensor, positions: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Feature targets `[B, P, l_d, d]`: the last hidden state at t + 1 + j for slot j at position t (clamped to the
    batch width; entries past a sequence's end are masked by their -100 labels)."""
    index = positions[..., None] + 1 + torch.arange(num_slots, device=positions.device)  # [B, P, l_d]
    index = index.clamp(max=last.shape[1] - 1).flatten(1)
    gathered = last.gather(1, index[..., None].expand(-1, -1, last.shape[-1]))
    return gathered.view(*positions.shape, num_slots, last.shape[-1])
