"""How one process answers prompts: a static batch through `generate`, or a window of prompts through continuous
batching (`generate_batch`), each answer cut after EOS, with the process's running throughput.

The generation jobs (`batch_generation.py`) choose which prompts and where the answers go; this is the part that
runs the target.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .batching import batch_seed, cut_after_eos, eos_token_ids, left_pad
from .generation import generate, generate_batch
from .generation.requests import RequestOutput


@dataclass
class GenerationSettings:
    """What is generated for each prompt. All of it but the batch size and the prompt limit must match when a run is
    resumed.

    Attributes:
        max_new_tokens: answer length cap.
        max_prompt_tokens: prompts longer than this (in tokens, template included) are skipped.
        batch_size: rows decoded at once (per process): the slots of continuous batching, or the prompts per
            `generate` call of static batches.
        do_sample, temperature, top_p: sampling (greedy when `do_sample` is False).
        seed: seed of the sampled batches.
        chat_template: wrap each prompt as a user message in the tokenizer's chat template.
        continuous: run on continuous batching (False: static batches).
        memory_budget_gib: with continuous batching, fewer slots than `batch_size` where their state would not fit
            in this many GiB (`generate`'s `memory_budget`). None: `batch_size` slots.
    """

    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    batch_size: int = 16
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    chat_template: bool = True
    continuous: bool = True
    memory_budget_gib: float | None = None

    def __post_init__(self):
        if min(self.max_new_tokens, self.max_prompt_tokens, self.batch_size) < 1:
            raise ValueError("max_new_tokens, max_prompt_tokens and batch_size must be at least 1.")
        if self.memory_budget_gib is not None and not self.memory_budget_gib > 0:
            raise ValueError(f"memory_budget_gib={self.memory_budget_gib} must be positive.")
        if self.do_sample and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError(f"Sampling needs temperature > 0 and 0 < top_p <= 1, got {self.temperature}, "
                             f"{self.top_p}.")

    def generate_kwargs(self) -> dict:
        """The sampling arguments of `generate` (none for greedy decoding)."""
        if not self.do_sample:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}

    def meta(self) -> dict:
        """The settings a resumed run must share (the batch size, the prompt limit and the batching may change)."""
        return {name: value for name, value in asdict(self).items()
                if name not in ("batch_size", "max_prompt_tokens", "continuous", "memory_budget_gib")}


@dataclass
class Throughput:
    """Running totals of one process: answer tokens, seconds, and (speculative) rows' steps and accepted drafts."""

    tokens: int = 0
    seconds: float = 0.0
    row_steps: int = 0
    accepted: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def kappa(self) -> float | None:
        """Committed tokens per row per target forward (1.0: plain decoding); None without speculation."""
        return (self.row_steps + self.accepted) / self.row_steps if self.row_steps else None

    def postfix(self) -> dict:
        kappa = {} if self.kappa is None else {"kappa": f"{self.kappa:.2f}"}
        return {"tok_s": f"{self.tokens_per_second:.1f}", **kappa}

    def save(self, path: str, **extra) -> None:
        """Writes the totals, tokens/s and kappa (and `extra`) as JSON."""
        with open(path, "w") as file:
            json.dump({**asdict(self), "tokens_per_second": self.tokens_per_second, "kappa": self.kappa, **extra},
                      file, indent=2)


@torch.inference_mode()
def answer_batch(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    batch: list[tuple[int, list[int]]],
    settings: GenerationSettings,
    speculation: dict | None,
    throughput: Throughput,
) -> list[tuple[int, list[int], list[int]]]:
    """The target's answers to a batch of `(id, prompt ids)`, as `(id, prompt ids, answer ids)` cut after EOS.

    `speculation` holds the speculative arguments of `hf_specformer.generate` (`assistant_model`, ...); None runs
    plain `generate`. Adds the batch's tokens, time and acceptance to `throughput`.
    """
    input_ids, attention_mask = left_pad([ids for _, ids in batch], tokenizer.pad_token_id)
    kwargs = dict(input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device),
                  max_new_tokens=settings.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                  **settings.generate_kwargs())
    if settings.do_sample:
        torch.manual_seed(batch_seed(settings.seed, batch[0][0]))
    start = time.perf_counter()
    if speculation is None:
        sequences = target.generate(**kwargs)
    else:
        output = generate(target, **kwargs, **speculation, return_dict_in_generate=True)
        sequences, stats = output.sequences, output.speculation_stats
        throughput.row_steps += stats.row_steps
        throughput.accepted += stats.accepted
    eos_ids = eos_token_ids(target, tokenizer)
    answers = [cut_after_eos(answer, eos_ids) for answer in sequences[:, input_ids.shape[1] :].tolist()]
    throughput.seconds += time.perf_counter() - start
    throughput.tokens += sum(map(len, answers))
    return [(index, ids, answer) for (index, ids), answer in zip(batch, answers)]


@torch.inference_mode()
def answer_continuously(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    window: list[tuple[int, list[int]]],
    settings: GenerationSettings,
    speculation: dict | None,
    throughput: Throughput,
    save: Callable[[list[tuple[int, list[int], list[int]]]], None],
) -> None:
    """The target's answers to a window of `(id, prompt ids)` in one continuous-batching call (`generate_batch`,
    `settings.batch_size` slots; `speculation` as for `answer_batch`, None: plain steps): each answer goes to `save`
    as `[(id, prompt ids, answer ids)]`, cut after EOS, the step it is finished, and adds to `throughput`. A sampled
    answer is seeded by (seed, its prompt's id) alone (`generate_batch`'s `seeds`), whatever window it is in."""
    seeds = [batch_seed(settings.seed, index) for index, _ in window] if settings.do_sample else None
    eos_ids = eos_token_ids(target, tokenizer)
    start, seconds_before = time.perf_counter(), throughput.seconds

    def finished(position: int, output: RequestOutput) -> None:
        answer = cut_after_eos(output.generated_tokens, eos_ids)
        throughput.tokens += len(answer)
        if speculation is not None:
            throughput.row_steps += output.steps
            throughput.accepted += output.accepted_drafts
        throughput.seconds = seconds_before + time.perf_counter() - start
        index, ids = window[position]
        save([(index, ids, answer)])

    budget = None if settings.memory_budget_gib is None else int(settings.memory_budget_gib * 2**30)
    generate_batch(target, [ids for _, ids in window], max_batch_size=settings.batch_size, progress_bar=False,
                   memory_budget=budget, on_output=finished, seeds=seeds, max_new_tokens=settings.max_new_tokens,
                   pad_token_id=tokenizer.pad_token_id, **settings.generate_kwargs(), **(speculation or {}))
