"""Training a SpecFormer drafter on self-distilled data with `accelerate` (paper: Shi et al., AAAI-26, sec. 3).

The target stays frozen: each micro-batch runs through it under `torch.no_grad()` (online) for the four hooked
hidden states; `cache_target_states` instead runs each sequence on its own and keeps its states in memory for later
epochs (see `TargetStateCache`). The drafter's context stage runs over every position; its slot stage runs at a random
subset of positions per sequence (`positions_per_sequence`). Slot j at position t is trained with cross-entropy on
token x_{t+2+j} of the assistant reply (at `ce_positions_per_sequence` of those positions), all slots weighted
equally, plus, optionally, a feature loss against the target's last hidden state at t + 1 + j
(`feature_loss_weight`, see `DrafterTrainingConfig`).

The vocabulary-sized logits are never materialised for all slots at once ("intra-batch gradient accumulation",
`intra_batch_backward`): one SpecFormer forward, then per slot a head forward and backward into a detached copy of
the slot states, then one backward through SpecFormer.

Runs resume exactly: data order is a seeded shuffle per epoch, positions are drawn from a generator seeded by
(seed, epoch, batch, process), and checkpoints (model, optimizer, scheduler, RNG, trainer state) are written to a
temporary folder and renamed into place. SIGTERM or Ctrl-C (a preempted job, `timeout`) lets the current optimiser
step finish, writes a checkpoint and returns, so `--resume` loses nothing.

    python -m hf_specformer.train --data /work/distill_smollm2 --output-dir runs/smollm2
    accelerate launch -m hf_specformer.train --data ... --output-dir ...      # several processes (DDP)
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import Dataset, DatasetDict, load_from_disk
from tqdm.auto import tqdm
from transformers import HfArgumentParser, PreTrainedModel

from hf_specformer.hub.export import export_drafter
from hf_specformer.models.specformer import SpecFormerConfig, SpecFormerForDrafting
from hf_specformer.targets import DEFAULT_TARGET, DTYPES, load_target
from hf_specformer.training.checkpointing import (
    TrainerState,
    append_metrics,
    list_checkpoints,
    restore_checkpoint,
    save_checkpoint,
    trim_metrics,
    write_atomically,
)
from hf_specformer.training.distill import DATASET_DIR, PROGRESS_DIR, RECORDS_FILE

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.json"
DRAFTER_DIR = "drafter"


# ----- configuration -------------------------------------------------------------------------------------------
@dataclass
class DrafterTrainingConfig:
    """Options of a drafter training run (one field per command-line option, `--field-name`).

    Args:
        data: self-distilled data: a distill output folder (its `dataset/`, else the records of a run in
            progress) or a folder written by `Dataset.save_to_disk`, with `input_ids` and `prompt_length`.
        output_dir: where checkpoints, `metrics.jsonl`, `eval.json` and the exported `drafter/` go.
        target: the frozen target (`smollm2`, a local folder, a `.gguf` file or a Hub name), loaded in float32.
        draft_length: l_d, the number of draft slots trained (all of them, equal weights).
        next_token_input: build the drafter with `SpecFormerConfig.next_token_input` (position t also reads x_{t+1};
            an extension, not in the paper). With `init_from` a drafter without it gains it, starting at zero.
        epochs: passes over the training split; ignored when `max_steps` is set.
        max_steps: optimiser steps to run; overrides `epochs` (the data is cycled as needed).
        per_device_batch_size: sequences per micro-batch and process.
        gradient_accumulation_steps: micro-batches per optimiser step.
        learning_rate: peak AdamW learning rate.
        min_learning_rate: learning rate at the end of the cosine decay.
        warmup_ratio: fraction of the optimiser steps with a linear warm-up.
        weight_decay: AdamW weight decay of the matrices (norm scales and biases have none).
        adam_eps: AdamW epsilon.
        max_grad_norm: gradient clipping norm; 0 disables clipping.
        max_length: sequences are cut to this many tokens (prompt included).
        positions_per_sequence: the slot stage runs only at this many random reply positions per sequence, while
            the cheap context stage covers every position. 0 uses every valid position.
        ce_positions_per_sequence: the l_d lm_head calls of the cross-entropy, which dominate a CPU step (V = 49152
            columns against d = 576), run only at this many of the slot-stage positions (a random subset); 0 uses
            all of them.
        feature_loss_weight: weight w of an auxiliary loss (not in the paper's final recipe; its code keeps an
            unused MSE-to-last-hidden-state option): smooth-L1 between the target's final norm of slot j's state at
            position t and the target's own last hidden state at t + 1 + j, which its lm_head turns into the
            distribution of x_{t+2+j}. It carries the target's whole next-token distribution rather than one
            label (as EAGLE's feature loss does) and costs d instead of V per slot, so it runs at every slot-stage
            position. The loss is `mean_j (CE_j + w * feature_j)`; 0 disables it.
        cache_target_states: keep each training sequence's target states (4 hooked + the last hidden state) in
            memory after its first forward, so later epochs skip the target. Costs about T * 5 * d * 4 bytes of RAM
            per sequence (1.5 GB for 1000 sequences of 170 tokens with d = 576).
        draft_vocab_size: before the final evaluation and export, restrict drafting to the N most frequent reply
            tokens of the training split (`SpecFormerForDrafting.set_draft_vocab`): the draft head then reads N rows
            of the lm_head instead of V. Training always scores the whole vocabulary. 0: no restriction.
        eval_fraction: share of the sequences held out (seeded shuffle) to measure the accepted length kappa.
        eval_every: evaluate every this many optimiser steps (0: only at the end).
        save_every: checkpoint every this many optimiser steps (0: never).
        mixed_precision: `no` or `bf16` (autocast of the target, the drafter and the head; float32 weights).
        target_dtype: dtype the frozen target is loaded in (its hidden states are what the drafter learns from). The
            device is accelerate's (a GPU when there is one; `accelerate launch --cpu` for the CPU).
        save_dtype: dtype of the exported drafter weights.
        seed: seed of initialisation, data order, held-out split and position sampling.
        num_threads: torch CPU threads per process (0: torch's default).
        resume: continue from the latest checkpoint in `output_dir/checkpoints` (from scratch if there is none).
        init_from: a drafter folder whose weights start the run (e.g. continued training on more data).
        new_parameter_learning_rate_scale: with `init_from`, the parameters that folder lacks (e.g. a next-token
            input added to a drafter trained without it) train at this multiple of the learning rate: a new matrix
            that starts at zero would otherwise grow only at the fine-tuning pace of the trained ones.
    """

    data: str = field(metadata={"help": "Distill output folder or a `save_to_disk` dataset folder."})
    output_dir: str = field(metadata={"help": "Folder for checkpoints, metrics.jsonl, eval.json and drafter/."})
    target: str = field(default=DEFAULT_TARGET, metadata={"help": "Target model: smollm2, a folder, a .gguf file."})
    draft_length: int = field(default=8, metadata={"help": "l_d, the number of draft slots."})
    next_token_input: bool = field(
        default=False, metadata={"help": "The drafter also reads the token after each position (not in the paper)."}
    )
    epochs: float = field(default=1.0, metadata={"help": "Passes over the training split (unless max_steps)."})
    max_steps: int | None = field(default=None, metadata={"help": "Optimiser steps; overrides epochs."})
    per_device_batch_size: int = field(default=8, metadata={"help": "Sequences per micro-batch and process."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimiser step."})
    learning_rate: float = field(default=5e-4, metadata={"help": "Peak learning rate."})
    min_learning_rate: float = field(default=1e-5, metadata={"help": "Final learning rate of the cosine decay."})
    warmup_ratio: float = field(default=0.05, metadata={"help": "Fraction of steps with linear warm-up."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay of weight matrices."})
    adam_eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0: no clipping)."})
    max_length: int = field(default=768, metadata={"help": "Cut sequences to this many tokens."})
    positions_per_sequence: int = field(
        default=64, metadata={"help": "Random reply positions per sequence for the slot stage (0: all)."}
    )
    ce_positions_per_sequence: int = field(
        default=0, metadata={"help": "Of those, how many also get the cross-entropy (0: all of them)."}
    )
    feature_loss_weight: float = field(
        default=0.0, metadata={"help": "Weight of the feature loss against the target's last hidden state (0: off)."}
    )
    cache_target_states: bool = field(
        default=False, metadata={"help": "Keep each training sequence's target states in memory after its first pass."}
    )
    draft_vocab_size: int = field(
        default=0, metadata={"help": "Draft only the N most frequent reply tokens of the training data (0: all)."}
    )
    eval_fraction: float = field(default=0.05, metadata={"help": "Share of sequences held out for evaluation."})
    eval_every: int = field(default=500, metadata={"help": "Evaluate every N optimiser steps (0: at the end)."})
    save_every: int = field(default=500, metadata={"help": "Checkpoint every N optimiser steps (0: never)."})
    mixed_precision: Literal["no", "bf16"] = field(default="no", metadata={"help": "Autocast precision."})
    target_dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata={"help": "dtype of the frozen target (the device is accelerate's)."}
    )
    save_dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="bfloat16", metadata={"help": "Dtype of the exported drafter."}
    )
    seed: int = field(default=0, metadata={"help": "Random seed."})
    num_threads: int = field(default=0, metadata={"help": "Torch CPU threads per process (0: default)."})
    resume: bool = field(default=False, metadata={"help": "Resume from the latest checkpoint in output_dir."})
    init_from: str | None = field(
        default=None, metadata={"help": "Start from this drafter folder's weights instead of a fresh init."}
    )
    new_parameter_learning_rate_scale: float = field(
        default=1.0, metadata={"help": "With init_from: learning-rate multiple of the parameters it lacks."}
    )

    def __post_init__(self):
        positive = ("draft_length", "per_device_batch_size", "gradient_accumulation_steps", "learning_rate", "adam_eps",
                    "new_parameter_learning_rate_scale")
        non_negative = ("weight_decay", "max_grad_norm", "positions_per_sequence", "ce_positions_per_sequence",
                        "feature_loss_weight", "draft_vocab_size", "eval_every", "save_every", "num_threads",
                        "min_learning_rate")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be positive, got {getattr(self, name)}.")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}.")
        if self.max_steps is None and self.epochs <= 0:
            raise ValueError(f"Set `epochs` > 0 or `max_steps`; got epochs={self.epochs} and no max_steps.")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"`max_steps` must be >= 1 when set, got {self.max_steps}.")
        if self.min_learning_rate > self.learning_rate:
            raise ValueError(
                f"`min_learning_rate` ({self.min_learning_rate}) must not exceed "
                f"`learning_rate` ({self.learning_rate})."
            )
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"`warmup_ratio` must be in [0, 1), got {self.warmup_ratio}.")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"`eval_fraction` must be in [0, 1), got {self.eval_fraction}.")
        if self.max_length < 3:
            raise ValueError(f"`max_length` must be >= 3 (a position and the token two ahead), got {self.max_length}.")


# ----- data ----------------------------------------------------------------------------------------------------
def load_distilled(path: str | os.PathLike) -> Dataset:
    """Self-distilled sequences with columns `input_ids` and `prompt_length`.

    `path` is a distill output folder (its finished `dataset/`, else the `progress/records.jsonl` of a run in
    progress, read without modifying it and ignoring a last line cut by a concurrent write) or a folder written by
    `save_to_disk`. Records are ordered by `id` when there is one.
    """
    path = Path(path)
    records_path = path / PROGRESS_DIR / RECORDS_FILE
    if (path / DATASET_DIR).is_dir():
        dataset = _load_saved(path / DATASET_DIR)
    elif records_path.is_file():
        dataset = Dataset.from_list(_read_complete_records(records_path))
    elif path.is_dir():
        dataset = _load_saved(path)
    else:
        raise FileNotFoundError(f"No distilled data at {path}: expected a distill output folder or a saved dataset.")
    missing = {"input_ids", "prompt_length"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"The data at {path} lacks the columns {sorted(missing)}.")
    return dataset.select_columns(["input_ids", "prompt_length"])


def _load_saved(path: Path) -> Dataset:
    """A `save_to_disk` folder as one Dataset (the `train` split of a DatasetDict)."""
    loaded = load_from_disk(str(path))
    return loaded["train"] if isinstance(loaded, DatasetDict) else loaded


def _read_complete_records(path: Path) -> list[dict]:
    """The complete JSON lines of `path` (a last line without newline is ignored), deduplicated and sorted by id."""
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1].decode()
    lines = [line for line in complete.split("\n") if line]  # not splitlines(): prompts may hold U+2028
    records = {record["id"]: record for record in map(json.loads, lines)}
    return [
        {"input_ids": record["input_ids"], "prompt_length": record["prompt_length"]}
        for _, record in sorted(records.items())
    ]


def reply_vocabulary(dataset: Dataset, size: int) -> list[int]:
    """The `size` most frequent reply tokens (after `prompt_length`) of `dataset`, most frequent first, ties by id;
    all of them when fewer distinct tokens occur."""
    counts = Counter()
    for ids, prompt_length in zip(dataset["input_ids"], dataset["prompt_length"]):
        counts.update(ids[prompt_length:])
    return sorted(counts, key=lambda token: (-counts[token], token))[:size]


def trainable_indices(dataset: Dataset, max_length: int) -> list[int]:
    """Rows that, cut to `max_length`, keep at least one reply token two positions after a context position."""
    lengths = (min(len(ids), max_length) for ids in dataset["input_ids"])
    return [
        row for row, (length, prompt_length) in enumerate(zip(lengths, dataset["prompt_length"]))
        if length > prompt_length and length >= 3
    ]


def split_train_eval(dataset: Dataset, max_length: int, eval_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Train and held-out splits of the usable rows, by a shuffle seeded with `seed`."""
    rows = trainable_indices(dataset, max_length)
    random.Random(seed).shuffle(rows)
    num_eval = max(1, round(len(rows) * eval_fraction)) if eval_fraction > 0 else 0
    if len(rows) - num_eval < 1:
        raise ValueError(f"{len(rows)} usable sequences leave none for training with eval_fraction={eval_fraction}.")
    return dataset.select(sorted(rows[num_eval:])), dataset.select(sorted(rows[:num_eval]))


def epoch_batches(num_rows: int, batch_size: int, num_processes: int, process_index: int, epoch: int, seed: int):
    """Row indices of this process's micro-batches in `epoch`: a seeded shuffle cut into global batches of
    `batch_size * num_processes` (the last one topped up from the start of the order), each split by process."""
    order = list(range(num_rows))
    random.Random(f"order-{seed}-{epoch}").shuffle(order)
    global_size = batch_size * num_processes
    num_batches = math.ceil(num_rows / global_size)
    padded = (order * math.ceil(num_batches * global_size / num_rows))[: num_batches * global_size]
    start = process_index * batch_size
    return [padded[b * global_size + start : b * global_size + start + batch_size] for b in range(num_batches)]


@dataclass
class Batch:
    """A right-padded micro-batch: `input_ids`, `attention_mask` `[B, T]`, `lengths`, `prompt_lengths` `[B]`."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(getattr(self, item.name).to(device) for item in fields(self)))


def collate(rows: dict[str, list], max_length: int, pad_token_id: int = 0) -> Batch:
    """Right-pads the sequences of `rows` (columns `input_ids`, `prompt_length`) after cutting them to max_length."""
    sequences = [list(ids[:max_length]) for ids in rows["input_ids"]]
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, : len(sequence)] = 1
    lengths = attention_mask.sum(-1)
    return Batch(input_ids, attention_mask, lengths, torch.tensor(rows["prompt_length"], dtype=torch.long))


# ----- positions, labels, loss ---------------------------------------------------------------------------------
def sample_positions(
    lengths: Sequence[int], prompt_lengths: Sequence[int], per_sequence: int, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions t where the slot stage runs: x_{t+2} exists and lies in the reply (t + 2 >= prompt length).

    Draws `per_sequence` of them per sequence without replacement (all with 0 or when there are fewer), in random
    order, so that the first columns are a random subset of the drawn ones. Returns positions `[B, P]` (padded with
    0) and their validity mask `[B, P]`.
    """
    chosen = []
    for length, prompt_length in zip(lengths, prompt_lengths):
        valid = range(max(int(prompt_length) - 2, 0), int(length) - 2)
        chosen.append(rng.sample(valid, len(valid) if per_sequence == 0 else min(per_sequence, len(valid))))
    width = max(1, max(len(picked) for picked in chosen))
    positions = torch.zeros((len(chosen), width), dtype=torch.long)
    mask = torch.zeros((len(chosen), width), dtype=torch.bool)
    for row, picked in enumerate(chosen):
        positions[row, : len(picked)] = torch.tensor(picked, dtype=torch.long)
        mask[row, : len(picked)] = True
    return positions, mask


def slot_labels(batch: Batch, positions: torch.Tensor, mask: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Labels `[B, P, l_d]`: x_{t+2+j} for slot j at position t, `-100` outside the reply, past the sequence's end
    or at padded positions."""
    index = positions[..., None] + 2 + torch.arange(num_slots, device=positions.device)  # [B, P, l_d]
    tokens = batch.input_ids.gather(1, index.clamp(max=batch.input_ids.shape[1] - 1).flatten(1)).view_as(index)
    inside = (index < batch.lengths[:, None, None]) & (index >= batch.prompt_lengths[:, None, None])
    return tokens.masked_fill(~(inside & mask[..., None]), IGNORE_INDEX)


def slot_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (in float32 at least) of logits `[..., V]` against labels `[...]` over the labels != -100
    (0 if there are none)."""
    logits = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    total = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


class SlotLosses(NamedTuple):
    """Losses of one micro-batch (floats): `total = mean_j (cross_entropy[j] + w * feature[j])`."""

    total: float
    cross_entropy: list[float]
    feature: list[float]


def slot_feature_loss(normalized: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean smooth-L1 (summed over d) between normalized slot states `[..., d]` and the target's last hidden states
    `[..., d]` over the entries whose `labels` `[...]` are not -100 (0 if there are none)."""
    dtype = torch.promote_types(normalized.dtype, torch.float32)
    distance = F.smooth_l1_loss(normalized.to(dtype), targets.to(dtype), reduction="none").sum(-1)
    valid = labels != IGNORE_INDEX
    return (distance * valid).sum() / valid.sum().clamp(min=1)


def intra_batch_backward(
    drafter: SpecFormerForDrafting,
    slot_hidden: torch.Tensor,
    labels: torch.Tensor,
    backward: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    feature_targets: torch.Tensor | None = None,
    feature_weight: float = 0.0,
    num_ce_positions: int = 0,
) -> SlotLosses:
    """Backward of `mean_j (CE_j + w * feature_j)`, one slot's vocabulary-sized logits at a time (paper sec. 3).

    Args:
        drafter: the (unwrapped, bound) drafter whose `compute_logits` applies the target's norm and head.
        slot_hidden: slot states `[B, P, l_d, d]` still attached to the SpecFormer graph.
        labels: `[B, P, l_d]`, -100 where a slot has no target token.
        backward: `backward(tensor, gradient)` for the final backward through SpecFormer, e.g. a wrapper of
            `accelerator.backward`; default `tensor.backward(gradient)`.
        feature_targets: `[B, P, l_d, d]` the target's last hidden state that predicts each slot's label; needed
            when `feature_weight` > 0.
        feature_weight: w (see `DrafterTrainingConfig.feature_loss_weight`).
        num_ce_positions: the cross-entropy covers the first this many of the P positions (0: all).

    The gradients equal those of the plain loss computed from all `[B, P, l_d, V]` logits at once, while only
    `[B, P, V]` logits live at a time.
    """
    num_slots = slot_hidden.shape[2]
    ce_columns = slice(0, num_ce_positions or None)
    detached = slot_hidden.detach().requires_grad_()
    cross_entropy, feature = [], []
    for slot in range(num_slots):
        states, slot_targets = detached[:, :, slot], labels[:, :, slot]
        loss = slot_cross_entropy(drafter.compute_logits(states[:, ce_columns]), slot_targets[:, ce_columns])
        cross_entropy.append(loss.detach())
        if feature_weight > 0:
            feature_loss = slot_feature_loss(drafter.normalize(states), feature_targets[:, :, slot], slot_targets)
            feature.append(feature_loss.detach())
            loss = loss + feature_weight * feature_loss
        (loss / num_slots).backward()
    (backward or torch.Tensor.backward)(slot_hidden, detached.grad)
    cross_entropy = torch.stack(cross_entropy).tolist()
    feature = torch.stack(feature).tolist() if feature else [0.0] * num_slots
    total = sum(ce + feature_weight * f for ce, f in zip(cross_entropy, feature)) / num_slots
    return SlotLosses(total, cross_entropy, feature)


@torch.no_grad()
def next_token_ids(input_ids: torch.LongTensor) -> torch.LongTensor:
    """`[B, T]` -> `[B, T]`: x_{t+1} at t (the drafter's `next_token_ids`); the last column, which has no next token
    and no label, repeats the last input."""
    return torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)


def reply_positions(ids: torch.LongTensor, prompt_length: int) -> torch.LongTensor:
    """`[P]` the positions t of a sequence `ids` `[T]` whose next two tokens are reply tokens: the last prompt
    position up to T - 3 (where drafting starts once the target has committed x_{t+1})."""
    return torch.arange(prompt_length - 1, ids.numel() - 2, device=ids.device)


def tokens_after(ids: torch.LongTensor, positions: torch.LongTensor, first: int, count: int) -> torch.LongTensor:
    """`[P, count]`: ids[t + first + j] for j < count at each position t, -1 past the end of the sequence."""
    padded = torch.cat([ids, ids.new_full((first + count,), -1)])
    return padded[positions[:, None] + first + torch.arange(count, device=ids.device)]


@torch.no_grad()
def target_hidden_states(
    target: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The target's L + 1 hidden states `[B, T, d]` of a (right-padded) batch, without gradients."""
    output = target(
        input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False, logits_to_keep=1
    )
    return output.hidden_states


def hooked_target_states(
    target: PreTrainedModel, drafter: SpecFormerForDrafting, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The drafter's 4 hooked target states `[B, T, d]` of a (right-padded) batch, without gradients."""
    return drafter.select_hooked_states(target_hidden_states(target, input_ids, attention_mask))


class TargetStateCache:
    """The frozen target's states a training step reads: the 4 hooked states `[T, 4, d]` and the last hidden state
    `[T, d]` (the feature-loss target; a view of the hooked ones when layer L is hooked) of each sequence.

    Without `keep`, a micro-batch runs through the target in one right-padded forward (what a GPU wants); a resumed
    run repeats the same batches, so it sees the same numbers. With `keep`, each sequence runs through the target on
    its own (no padding) and its states stay in memory, so later epochs skip the target and the states never depend
    on the batch a sequence first landed in.
    """

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


# ----- learning rate -------------------------------------------------------------------------------------------
def warmup_cosine(total_steps: int, warmup_ratio: float, min_ratio: float) -> Callable[[int], float]:
    """LambdaLR factor: linear warm-up over `ceil(warmup_ratio * total_steps)` steps, then cosine to `min_ratio`."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_optimizer(
    drafter: torch.nn.Module, config: DrafterTrainingConfig, new_parameters: frozenset[str] = frozenset()
) -> torch.optim.AdamW:
    """AdamW with weight decay on the weight matrices only; the parameters named in `new_parameters` at
    `config.new_parameter_learning_rate_scale` times the learning rate."""
    groups = []
    for is_new in (False, True):
        lr = config.learning_rate * (config.new_parameter_learning_rate_scale if is_new else 1.0)
        parameters = [p for name, p in drafter.named_parameters()
                      if p.requires_grad and (name in new_parameters) == is_new]
        groups += [
            {"params": [p for p in parameters if p.ndim >= 2], "weight_decay": config.weight_decay, "lr": lr},
            {"params": [p for p in parameters if p.ndim < 2], "weight_decay": 0.0, "lr": lr},
        ]
    return torch.optim.AdamW([group for group in groups if group["params"]], lr=config.learning_rate,
                             eps=config.adam_eps)


# ----- evaluation ----------------------------------------------------------------------------------------------
def acceptance_steps(drafts: torch.Tensor, tokens: torch.Tensor, start: int, k: int) -> list[int]:
    """Teacher-forced decoding steps of one sequence with k drafts per step (official `validate.py`).

    `drafts[r]` `[max_k]` are the draft tokens at position `start + r` (slot j guesses x_{start+r+2+j}), `tokens`
    `[L]` the sequence. From i = start, while all k labels x_{i+2 .. i+1+k} exist: step = 1 (the target's own
    token) + length of the matched draft prefix, i += step. Returns the steps.
    """
    steps, position, length = [], start, tokens.shape[0]
    while position + 1 + k < length:
        matches = drafts[position - start, :k] == tokens[position + 2 : position + 2 + k]
        step = 1 + int(matches.long().cumprod(0).sum())
        steps.append(step)
        position += step
    return steps


@torch.no_grad()
def draft_tokens(
    target: PreTrainedModel, drafter: SpecFormerForDrafting, input_ids: torch.Tensor, start: int, max_k: int,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Argmax drafts `[L - 2 - start, max_k]` of one sequence `[L]` at positions start .. L - 3 (those with a label),
    computed `chunk_size` positions at a time to bound the `[chunk, max_k, V]` logits."""
    ids = input_ids[None]
    hooked = hooked_target_states(target, drafter, ids, torch.ones_like(ids))
    positions = torch.arange(start, ids.shape[1] - 2, device=ids.device)
    following = next_token_ids(ids)
    chunks = [
        drafter(hooked, use_cache=False, draft_positions=chunk[None], num_draft_tokens=max_k,
                next_token_ids=following).logits[0].argmax(-1)
        for chunk in positions.split(chunk_size)
    ]
    return torch.cat(chunks) if chunks else torch.zeros((0, max_k), dtype=torch.long, device=ids.device)


@torch.no_grad()
def evaluate_kappa(
    target: PreTrainedModel, drafter: SpecFormerForDrafting, dataset: Iterable[dict], max_k: int
) -> dict:
    """Teacher-forced accepted length kappa(k) for k = 1..max_k and per-slot top-1 accuracy on held-out sequences.

    `dataset` yields rows with `input_ids` (already cut to length) and `prompt_length`. The walk of each sequence
    starts at its last prompt position (where the target emits the first reply token) and counts the target's own
    token, which equals the label because the data is the target's greedy output. kappa(k) = total steps' tokens /
    number of steps over all sequences, in [1, k + 1]. Returns `{"kappa": [max_k floats], "slot_accuracy":
    [max_k floats], "num_sequences": int, "num_positions": int}`.
    """
    was_training = drafter.training
    drafter.eval()
    device = next(drafter.parameters()).device
    steps = [[] for _ in range(max_k)]
    hits, counts = torch.zeros(max_k), torch.zeros(max_k)
    num_sequences = num_positions = 0
    for row in dataset:
        tokens = torch.tensor(row["input_ids"], dtype=torch.long, device=device)
        start = max(int(row["prompt_length"]) - 1, 0)
        drafts = draft_tokens(target, drafter, tokens, start, max_k)
        if drafts.shape[0] == 0:
            continue
        for k in range(1, max_k + 1):
            steps[k - 1].extend(acceptance_steps(drafts, tokens, start, k))
        for slot in range(max_k):
            labels = tokens[start + 2 + slot :]  # slot j at position start + r guesses x_{start + r + 2 + j}
            hits[slot] += (drafts[: labels.shape[0], slot] == labels).sum().item()
            counts[slot] += labels.shape[0]
        num_sequences += 1
        num_positions += drafts.shape[0]
    drafter.train(was_training)
    return {
        "kappa": [sum(s) / len(s) if s else float("nan") for s in steps],
        "slot_accuracy": (hits / counts.clamp(min=1)).tolist(),
        "num_sequences": num_sequences,
        "num_positions": num_positions,
    }


# ----- training ------------------------------------------------------------------------------------------------
@dataclass
class TrainingResult:
    """What `train` returns: the trained (unwrapped, bound) drafter, the optimizer, the final state and evaluation.
    `completed` is False when a signal stopped the run early (then it was checkpointed, not evaluated or exported)."""

    drafter: SpecFormerForDrafting
    optimizer: torch.optim.Optimizer
    state: TrainerState
    evaluation: dict
    completed: bool = True


class StopOnSignal:
    """Within its `with` block, SIGTERM and SIGINT set `requested` instead of ending the process, so that training
    can finish its optimiser step and checkpoint. A second signal ends the process as usual. Outside the main
    thread (where Python cannot handle signals) it does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._handle) for number in self.SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, number: int, frame) -> None:
        if self.requested:
            self.__exit__()
            signal.raise_signal(number)
            return
        self.requested = True
        logger.warning("%s received: stopping after this optimiser step (again to stop at once)",
                       signal.Signals(number).name)

    def agreed(self, accelerator: Accelerator) -> bool:
        """Whether any process was asked to stop (every process must stop at the same step)."""
        if accelerator.num_processes == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def build_drafter(
    target: PreTrainedModel, config: DrafterTrainingConfig
) -> tuple[SpecFormerForDrafting, frozenset[str]]:
    """The drafter to train, in the target's dtype, bound to it, in training mode, and the names of its parameters
    that `config.init_from` did not hold: freshly initialised (no names), or the weights of `config.init_from`
    (continued training on new data, optionally gaining the next-token input; optimiser and schedule start afresh)."""
    if config.init_from:
        extra = {"next_token_input": True} if config.next_token_input else {}
        drafter, loading = SpecFormerForDrafting.from_pretrained(
            config.init_from, dtype=target.dtype, output_loading_info=True, **extra
        )
        if drafter.config.draft_length != config.draft_length:
            raise ValueError(
                f"`init_from` has draft_length {drafter.config.draft_length}, the run asks for {config.draft_length}."
            )
        return drafter.bind_target(target).train(), frozenset(loading["missing_keys"])
    drafter_config = SpecFormerConfig.from_target_config(
        target.config, draft_length=config.draft_length, next_token_input=config.next_token_input
    )
    drafter = SpecFormerForDrafting(drafter_config).to(target.dtype)
    return drafter.bind_target(target).train(), frozenset()


def total_optimizer_steps(config: DrafterTrainingConfig, batches_per_epoch: int) -> int:
    """`max_steps`, else the optimiser steps of `epochs` passes (at least 1)."""
    if config.max_steps is not None:
        return config.max_steps
    return max(1, int(config.epochs * batches_per_epoch) // config.gradient_accumulation_steps)


def micro_batches(
    dataset: Dataset, config: DrafterTrainingConfig, accelerator: Accelerator, state: TrainerState
) -> Iterator[tuple[int, int, list[int], Batch, random.Random]]:
    """Endless `(epoch, batch index, row ids, batch, position rng)` from `state.epoch` / `state.batch_index` on."""
    epoch, first = state.epoch, state.batch_index
    while True:
        batches = epoch_batches(
            len(dataset), config.per_device_batch_size, accelerator.num_processes, accelerator.process_index,
            epoch, config.seed,
        )
        for index in range(first, len(batches)):
            rng = random.Random(f"positions-{config.seed}-{epoch}-{index}-{accelerator.process_index}")
            rows = batches[index]
            yield epoch, index, rows, collate(dataset[rows], config.max_length).to(accelerator.device), rng
        epoch, first = epoch + 1, 0


def train_micro_batch(
    accelerator: Accelerator, target_states: TargetStateCache, drafter: torch.nn.Module, row_ids: list[int],
    batch: Batch, rng: random.Random, config: DrafterTrainingConfig,
) -> SlotLosses:
    """Forward and backward of one micro-batch; `drafter` is the prepared (possibly DDP-wrapped) module."""
    unwrapped = accelerator.unwrap_model(drafter)
    with accelerator.autocast():
        hooked, last = target_states.batch(row_ids, batch)
        positions, mask = sample_positions(batch.lengths.tolist(), batch.prompt_lengths.tolist(),
                                           config.positions_per_sequence, rng)
        positions, mask = positions.to(accelerator.device), mask.to(accelerator.device)
        output = drafter(hooked, attention_mask=batch.attention_mask, use_cache=False, draft_positions=positions,
                         num_draft_tokens=config.draft_length, return_logits=False,
                         next_token_ids=next_token_ids(batch.input_ids))
        labels = slot_labels(batch, positions, mask, config.draft_length)
        features = future_states(last, positions, config.draft_length) if config.feature_loss_weight > 0 else None
        return intra_batch_backward(
            unwrapped, output.slot_hidden_states, labels,
            backward=lambda tensor, gradient: accelerator.backward(tensor, gradient=gradient),
            feature_targets=features, feature_weight=config.feature_loss_weight,
            num_ce_positions=config.ce_positions_per_sequence,
        )


class WindowStats:
    """Losses, tokens and time of the micro-batches of one optimiser step."""

    def __init__(self):
        self.losses: list[SlotLosses] = []
        self.tokens = 0
        self.sequences = 0
        self.start = time.perf_counter()

    def add(self, losses: SlotLosses, batch: Batch) -> None:
        self.losses.append(losses)
        self.tokens += int(batch.lengths.sum())
        self.sequences += batch.lengths.shape[0]

    def summary(self, accelerator: Accelerator) -> dict:
        """Losses averaged over micro-batches and processes (`loss` is the total, `slot_losses` the per-slot
        cross-entropy, `feature_losses` the per-slot feature loss), token and sequence rates over all processes."""
        device = accelerator.device
        rows = [[losses.total, *losses.cross_entropy, *losses.feature] for losses in self.losses]
        means = accelerator.reduce(torch.tensor(rows, device=device).mean(0), reduction="mean").tolist()
        counts = accelerator.reduce(torch.tensor([self.tokens, self.sequences], device=device), reduction="sum")
        seconds = time.perf_counter() - self.start
        num_slots = len(self.losses[0].cross_entropy)
        return {
            "loss": means[0],
            "slot_losses": [round(value, 5) for value in means[1 : 1 + num_slots]],
            "feature_losses": [round(value, 5) for value in means[1 + num_slots :]],
            "seconds": round(seconds, 3),
            "tokens_per_second": round(counts[0].item() / seconds, 1),
            "sequences_per_second": round(counts[1].item() / seconds, 3),
        }


def run_evaluation(
    accelerator: Accelerator, target: PreTrainedModel, drafter: torch.nn.Module, eval_set: Dataset,
    config: DrafterTrainingConfig, state: TrainerState, path: Path,
) -> dict:
    """kappa on the held-out split, on the main process only (the others wait); logged to the metrics file."""
    evaluation = {}
    if accelerator.is_main_process and len(eval_set) > 0:
        rows = ({"input_ids": ids[: config.max_length], "prompt_length": pl}
                for ids, pl in zip(eval_set["input_ids"], eval_set["prompt_length"]))
        evaluation = evaluate_kappa(target, accelerator.unwrap_model(drafter), rows, config.draft_length)
        append_metrics(path, {"step": state.step, "eval": evaluation})
        logger.info("step %d: kappa %s", state.step, [round(value, 3) for value in evaluation["kappa"]])
    accelerator.wait_for_everyone()
    return evaluation


def train(
    config: DrafterTrainingConfig, target: PreTrainedModel | None = None, dataset: Dataset | None = None
) -> TrainingResult:
    """Trains a drafter for `config.target` (or the given `target` model) on `config.data` (or `dataset`)."""
    accelerator = Accelerator(
        mixed_precision=config.mixed_precision,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,  # stepped by hand once per optimiser step, whatever the process count
    )
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    output_dir = Path(config.output_dir)
    metrics_path = output_dir / METRICS_FILE
    checkpoints = list_checkpoints(output_dir)
    if checkpoints and not config.resume:
        raise ValueError(f"{output_dir} already holds checkpoints; pass `resume` or use another output folder.")
    output_dir.mkdir(parents=True, exist_ok=True)
    set_seed(config.seed)

    target = load_target(config.target, dtype=DTYPES[config.target_dtype]) if target is None else target
    target = target.requires_grad_(False).eval().to(accelerator.device)
    dataset = load_distilled(config.data) if dataset is None else dataset
    train_set, eval_set = split_train_eval(dataset, config.max_length, config.eval_fraction, config.seed)
    batches_per_epoch = math.ceil(len(train_set) / (config.per_device_batch_size * accelerator.num_processes))
    total_steps = total_optimizer_steps(config, batches_per_epoch)

    drafter, new_parameters = build_drafter(target, config)
    optimizer = build_optimizer(drafter, config, new_parameters)
    schedule = warmup_cosine(total_steps, config.warmup_ratio, config.min_learning_rate / config.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    drafter, optimizer, scheduler = accelerator.prepare(drafter, optimizer, scheduler)

    state = TrainerState()
    if checkpoints:
        state = restore_checkpoint(accelerator, checkpoints[-1])
        logger.info("resumed from %s (step %d)", checkpoints[-1], state.step)
    if accelerator.is_main_process:
        trim_metrics(metrics_path, state.step)
    logger.info("%d train / %d held-out sequences, %d optimiser steps", len(train_set), len(eval_set), total_steps)

    bar = tqdm(total=total_steps, initial=state.step, desc="train", disable=not accelerator.is_local_main_process)
    window = WindowStats()
    target_states = TargetStateCache(target, accelerator.unwrap_model(drafter), keep=config.cache_target_states)
    batches = micro_batches(train_set, config, accelerator, state)
    stopped = False
    with StopOnSignal() as stop:
        while state.step < total_steps and not stopped:
            epoch, index, row_ids, batch, rng = next(batches)
            with accelerator.accumulate(drafter):
                losses = train_micro_batch(accelerator, target_states, drafter, row_ids, batch, rng, config)
            window.add(losses, batch)
            state.epoch, state.batch_index = epoch, index + 1
            if not accelerator.sync_gradients:
                continue
            grad_norm = accelerator.clip_grad_norm_(drafter.parameters(), config.max_grad_norm) \
                if config.max_grad_norm > 0 else None
            learning_rate = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            state.step += 1
            state.metrics = {"step": state.step, "epoch": epoch, **window.summary(accelerator), "lr": learning_rate}
            if grad_norm is not None:
                state.metrics["grad_norm"] = round(float(grad_norm), 5)
            if accelerator.is_main_process:
                append_metrics(metrics_path, state.metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{state.metrics['loss']:.4f}", lr=f"{learning_rate:.2e}")
            stopped = stop.agreed(accelerator) and state.step < total_steps
            if config.eval_every and state.step % config.eval_every == 0 and state.step < total_steps and not stopped:
                run_evaluation(accelerator, target, drafter, eval_set, config, state, metrics_path)
            if stopped or (config.save_every and state.step % config.save_every == 0):
                save_checkpoint(accelerator, output_dir, state)
            window = WindowStats()
    bar.close()
    if stopped:
        logger.warning("stopped at step %d of %d; continue with --resume", state.step, total_steps)
        return TrainingResult(accelerator.unwrap_model(drafter), optimizer, state, evaluation={}, completed=False)

    if config.draft_vocab_size:
        accelerator.unwrap_model(drafter).set_draft_vocab(reply_vocabulary(train_set, config.draft_vocab_size))
    evaluation = run_evaluation(accelerator, target, drafter, eval_set, config, state, metrics_path)
    unwrapped = accelerator.unwrap_model(drafter)
    if accelerator.is_main_process:
        export_drafter(unwrapped, output_dir / DRAFTER_DIR, dtype=DTYPES[config.save_dtype])
        summary = {"step": state.step, "num_processes": accelerator.num_processes, **evaluation}
        write_atomically(output_dir / EVAL_FILE, json.dumps(summary, indent=2))
    accelerator.wait_for_everyone()
    return TrainingResult(drafter=unwrapped, optimizer=optimizer, state=state, evaluation=evaluation)


def parse_config(argv: list[str] | None = None) -> DrafterTrainingConfig:
    """`DrafterTrainingConfig` from command-line options (`--output-dir` or `--output_dir`, `--resume`, ...)."""
    parser = HfArgumentParser(DrafterTrainingConfig, description=__doc__.split("\n\n")[0])
    (config,) = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    return config


def main(argv: list[str] | None = None) -> TrainingResult:
    """Entry point of `python -m hf_specformer.train` and `accelerate launch -m hf_specformer.train`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return train(parse_config(argv))
