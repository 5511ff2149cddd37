"""Prompt sets (for generation jobs, distillation, benchmarks): loading prompts from files or the Hub, and turning a
prompt into chat ids.

`load_prompts()` without a source returns the small prompt set shipped in this package (`default_prompts.jsonl`),
so the project runs on a fresh machine. The larger development data (see `find_shared_data`) lives beside the
checkout in `../shared/data/` and is never copied into the project.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path

from datasets import load_dataset
from transformers import PreTrainedTokenizerBase

DEFAULT_PROMPTS_FILE = Path(__file__).with_name("default_prompts.jsonl")
PROMPT_FIELDS = ("prompt", "instruction", "question", "text", "turns")
DATA_DIR_ENV = "HF_SPECFORMER_DATA_DIR"
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def find_shared_data(name: str) -> str | None:
    """Path of the shared data file `name`: first in `$HF_SPECFORMER_DATA_DIR`, then in `<repo>/../shared/data`.

    Returns None when neither exists (as on a fresh machine).
    """
    repo_root = Path(__file__).resolve().parents[2]
    candidates = [repo_root.parent / "shared" / "data" / name]
    if os.environ.get(DATA_DIR_ENV):
        candidates.insert(0, Path(os.environ[DATA_DIR_ENV]) / name)
    return next((str(path) for path in candidates if path.exists()), None)


def _load_rows(source: str, split: str):
    """A `datasets.Dataset` for a local `.jsonl`/`.json`/`.parquet` file or a Hub dataset name."""
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


def load_prompts(
    source: str | Sequence[str] | None = None,
    *,
    prompt_field: str | None = None,
    split: str = "train",
    limit: int | None = None,
    shuffle_seed: int | None = None,
    interleave_field: str | None = None,
) -> list[str]:
    """Non-empty prompts from `source`: a local file or Hub dataset, several of them (concatenated in order), or
    None for the set shipped in this package.

    The prompt column is `prompt_field`, or the first of `prompt`, `instruction`, `question`, `text`, `turns`
    (whose first turn is taken), looked up in each source. With `shuffle_seed`, prompts are shuffled
    deterministically before `limit` keeps the first ones, so that a limited run still covers every part of a set
    sorted by source. With `interleave_field` (e.g. MT-bench's `category`), prompts are instead taken round-robin
    over that column's values (file order within each value), so that every prefix mixes them alike; rows of a
    source without the column form one group.
    """
    prompts, groups = labelled_prompts(source, interleave_field, prompt_field=prompt_field, split=split)
    if interleave_field is not None:
        prompts = _round_robin(prompts, groups)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(prompts)
    return prompts if limit is None else prompts[:limit]


def labelled_prompts(
    source: str | Sequence[str] | None, label_field: str | None, *, prompt_field: str | None = None,
    split: str = "train",
) -> tuple[list[str], list[str]]:
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


def _round_robin(items: list, groups: list) -> list:
    """Items taken one per group in turn (groups in order of first appearance, items in order within a group)."""
    by_group: dict = {}
    for item, group in zip(items, groups):
        by_group.setdefault(group, []).append(item)
    queues = list(by_group.values())
    return [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of `prompt` as a single user message, followed by the assistant's generation prompt."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return [int(token) for token in encoded["input_ids"]]
