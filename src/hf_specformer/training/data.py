"""Self-distilled data for training: loading, loop cutting, the reply vocabulary, the split and the batches."""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict, load_from_disk

from hf_specformer.data.records import DATASET_DIR, PROGRESS_DIR
from hf_specformer.data.records import read_all_records


def load_distilled(path: str | os.PathLike) -> Dataset:
    """Sequences (`input_ids`, `prompt_length`) of a distill output folder (its `dataset/`, else the records of a
    run in progress) or a `save_to_disk` folder, ordered by `id` when there is one."""
    path = Path(path)
    records = read_all_records(str(path / PROGRESS_DIR)) if (path / PROGRESS_DIR).is_dir() else {}
    if (path / DATASET_DIR).is_dir():
        dataset = _load_saved(path / DATASET_DIR)
    elif records:
        dataset = Dataset.from_list([records[index] for index in sorted(records)])
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


def loop_end(reply: Sequence[int], span: int) -> int:
    """How many tokens of `reply` come before its first loop: the length up to and including the first token that
    completes a window of `span` tokens already seen earlier in the reply (`len(reply)` when no window repeats)."""
    seen = set()
    for end in range(span, len(reply) + 1):
        window = tuple(reply[end - span : end])
        if window in seen:
            return end
        seen.add(window)
    return len(reply)


def cut_loops(dataset: Dataset, span: int) -> Dataset:
    """`dataset` with each reply cut after its first repeated window (`loop_end`): greedy answers loop verbatim,
    which prompt lookup drafts at run time."""
    input_ids = [ids[: prompt_length + loop_end(ids[prompt_length:], span)]
                 for ids, prompt_length in zip(dataset["input_ids"], dataset["prompt_length"])]
    return Dataset.from_dict({"input_ids": input_ids, "prompt_length": list(dataset["prompt_length"])})


def reply_sequences(dataset: Dataset) -> list[torch.LongTensor]:
    """The replies (tokens after `prompt_length`) of `dataset`, one 1-D tensor each, empty ones left out."""
    replies = (ids[prompt_length:] for ids, prompt_length in zip(dataset["input_ids"], dataset["prompt_length"]))
    return [torch.tensor(reply, dtype=torch.long) for reply in replies if reply]


def reply_token_counts(dataset: Dataset) -> Counter:
    """How often each token occurs in the replies (after `prompt_length`) of `dataset`."""
    counts = Counter()
    for ids, prompt_length in zip(dataset["input_ids"], dataset["prompt_length"]):
        counts.update(ids[prompt_length:])
    return counts


def reply_vocabulary(dataset: Dataset, size: int) -> list[int]:
    """The `size` most frequent reply tokens (after `prompt_length`) of `dataset`, most frequent first, ties by id;
    all of them when fewer distinct tokens occur."""
    counts = reply_token_counts(dataset)
    return sorted(counts, key=lambda token: (-counts[token], token))[:size]


def trainable_indices(dataset: Dataset, max_length: int) -> list[int]:
    """Rows that, cut to `max_length`, keep at least one reply token two positions after a context position."""
    lengths = (min(len(ids), max_length) for ids in dataset["input_ids"])
    return [
        row for row, (length, prompt_length) in enumerate(zip(lengths, dataset["prompt_length"]))
        if length > prompt_length and length >= 3
    ]


def usable_rows(dataset: Dataset, max_length: int) -> Dataset:
    """The rows of `dataset` that `trainable_indices` keeps, in order."""
    return dataset.select(trainable_indices(dataset, max_length))


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
