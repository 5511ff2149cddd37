"""Prompt batches for the generation jobs: prompt ids, batches sorted by length within windows, left padding, EOS
cuts, batch seeds."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .prompts import chat_prompt_ids

SORT_WINDOW_BATCHES = 32


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, chat_template: bool) -> list[int]:
    """Token ids of `prompt`: as a user message in the chat template, or as raw text (with the usual BOS)."""
    if chat_template:
        return chat_prompt_ids(tokenizer, prompt)
    return tokenizer(prompt)["input_ids"]


def plan_windows(todo: list[tuple[int, list[int]]], batch_size: int) -> Iterator[list[tuple[int, list[int]]]]:
    """Windows of `SORT_WINDOW_BATCHES` batches of `(id, prompt ids)`, each sorted by prompt length."""
    window = batch_size * SORT_WINDOW_BATCHES
    for start in range(0, len(todo), window):
        yield sorted(todo[start : start + window], key=lambda item: len(item[1]))


def plan_batches(todo: list[tuple[int, list[int]]], batch_size: int) -> Iterator[list[tuple[int, list[int]]]]:
    """Batches of `(id, prompt ids)`, sorted by prompt length within windows of `SORT_WINDOW_BATCHES` batches."""
    for window in plan_windows(todo, batch_size):
        for batch_start in range(0, len(window), batch_size):
            yield window[batch_start : batch_start + batch_size]


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` and `attention_mask` for `sequences`, padded on the left to the longest one."""
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, width - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, width - len(sequence) :] = 1
    return input_ids, attention_mask


def eos_token_ids(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids that end an answer: the target's generation config's, else the tokenizer's EOS."""
    eos = target.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos) if isinstance(eos, list) else {eos}


def cut_after_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """`tokens` up to and including the first EOS (all of them if there is none)."""
    end = next((position + 1 for position, token in enumerate(tokens) if token in eos_ids), len(tokens))
    return tokens[:end]


def batch_seed(seed: int, batch_index: int) -> int:
    """The torch seed of batch `batch_index` (or of the batch led by that prompt id) of a run seeded with `seed`."""
    return seed * 1_000_003 + batch_index
