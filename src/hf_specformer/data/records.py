"""Resumable JSONL records of the long generation jobs: appended and fsynced as they finish, one file per process,
a last line cut by a kill dropped on reading; `meta.json` says which run wrote them."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile

from transformers import PreTrainedModel

RECORDS_FILE = "records.jsonl"
RECORDS_PATTERN = "records*.jsonl"
PROGRESS_DIR = "progress"
"""A generation job's output folder: its records and `META_FILE` under `PROGRESS_DIR`, and once complete the
`datasets` folder `DATASET_DIR` and `GENERATIONS_FILE`."""
META_FILE = "meta.json"
DATASET_DIR = "dataset"
GENERATIONS_FILE = "generations.jsonl"

THROUGHPUT_FILE = "throughput{}.json"
"""Under `PROGRESS_DIR`: what process {rank} generated in its last session (tokens, seconds, tokens/s, kappa)."""


def records_file(directory: str, process_index: int = 0) -> str:
    """The records file that process `process_index` appends to in `directory`."""
    name = RECORDS_FILE if process_index == 0 else f"records-{process_index}.jsonl"
    return os.path.join(directory, name)


def target_fingerprint(target: PreTrainedModel) -> dict:
    """What identifies a target across runs: its name, sizes and a hash of its whole configuration."""
    config = {k: v for k, v in target.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    config_json = json.dumps(config, sort_keys=True, default=str)
    return {
        "target": target.config.name_or_path,
        "vocab_size": target.config.vocab_size,
        "hidden_size": target.config.hidden_size,
        "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
    }


def prompts_sha256(prompts: list[str]) -> str:
    """What identifies a list of prompts across runs (order included; sort a set first)."""
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


def check_or_write_meta(path: str, meta: dict) -> None:
    """Writes `meta` to `path` for a new run; for a resumed one, raises ValueError if `meta` differs from it."""
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        changed = sorted(key for key in meta.keys() | saved.keys() if saved.get(key) != meta.get(key))
        if changed:
            raise ValueError(
                f"{path} describes a different run (differs in {changed}); use another output or delete it"
            )
        return
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(temporary, path)


def read_records(path: str, repair: bool = True) -> dict[int, dict]:
    """Records saved in `path` so far, by id. A last line without newline (a write cut by a kill) is ignored, and
    with `repair` also cut from the file (only the process that appends to the file may repair it)."""
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    if repair and len(complete) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    lines = complete.decode().split("\n")  # not splitlines(): prompts may hold U+2028 and other line breaks
    records = (json.loads(line) for line in lines if line)
    return {record["id"]: record for record in records}


def read_all_records(directory: str, repair_index: int | None = None) -> dict[int, dict]:
    """The records of every process's file in `directory`, by id; only process `repair_index`'s file is repaired."""
    records = {}
    for path in sorted(glob.glob(os.path.join(directory, RECORDS_PATTERN))):
        records.update(read_records(path, repair=repair_index is not None and path == records_file(directory,
                                                                                                  repair_index)))
    return records


def append_records(path: str, records: list[dict]) -> None:
    """Appends `records` as JSON lines in one write, then flushes and fsyncs so a kill loses nothing written."""
    with open(path, "a") as f:
        f.write("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
        f.flush()
        os.fsync(f.fileno())


def replace_folder(write, final: str) -> None:
    """Calls `write(temporary_folder)`, then renames it to `final`: a kill leaves the old folder or the new one."""
    parent = os.path.dirname(os.path.abspath(final))
    temporary = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    write(temporary)
    if os.path.exists(final):
        stale = tempfile.mkdtemp(prefix=".tmp-old-", dir=parent)
        os.replace(final, os.path.join(stale, "old"))
        os.replace(temporary, final)
        shutil.rmtree(stale)
    else:
        os.replace(temporary, final)


def remove_leftovers(directory: str) -> None:
    """Deletes the temporary folders that a kill inside `replace_folder` left in `directory`."""
    for leftover in glob.glob(os.path.join(directory, ".tmp-*")):
        shutil.rmtree(leftover, ignore_errors=True)
