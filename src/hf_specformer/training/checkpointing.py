"""Checkpoints and the metrics log of a training run, so that a run killed at any instant resumes exactly: each
checkpoint is written whole (with a SHA-256 manifest, fsynced) and then renamed; the log is cut back on resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "step-"
TEMPORARY_PREFIX = ".tmp-"
TRAINER_STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
KEEP_CHECKPOINTS = 2


@dataclass
class TrainerState:
    """Where a run stands: optimiser steps done, current epoch, micro-batches of that epoch consumed, last metrics."""

    step: int = 0
    epoch: int = 0
    batch_index: int = 0
    metrics: dict = field(default_factory=dict)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def write_atomically(path: Path, text: str) -> None:
    """Writes `text` to `path` through a fsynced temporary file renamed over it: readers see the old or new file."""
    temporary = path.with_name(f"{TEMPORARY_PREFIX}{path.name}")
    with temporary.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _write_manifest(folder: Path) -> None:
    """`manifest.json`: size and SHA-256 of every file in `folder`, each fsynced."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        _fsync(path)
        files[str(path.relative_to(folder))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    write_atomically(folder / MANIFEST_FILE, json.dumps(files, indent=1))


def verify_checkpoint(checkpoint: Path) -> None:
    """ValueError unless every file of `checkpoint`'s manifest is there with its size and hash. (Checkpoints
    written before manifests existed are accepted with a warning.)"""
    manifest_path = checkpoint / MANIFEST_FILE
    if not manifest_path.exists():
        logger.warning("%s has no %s (an older checkpoint); loading it unchecked", checkpoint, MANIFEST_FILE)
        return
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as error:
        raise ValueError(f"{manifest_path} is corrupt ({error}).") from error
    for name, expected in manifest.items():
        path = checkpoint / name
        if not path.is_file():
            raise ValueError(f"{path} is missing.")
        if path.stat().st_size != expected["size"]:
            raise ValueError(f"{path} has {path.stat().st_size} bytes, {expected['size']} when saved (truncated).")
        if _sha256(path) != expected["sha256"]:
            raise ValueError(f"{path} does not match the hash it was saved with (corrupt).")


def save_checkpoint(accelerator: Accelerator, output_dir: Path, state: TrainerState) -> Path:
    """Writes `checkpoints/.tmp-step-N` (accelerate state, `trainer_state.json`, manifest), renames it to `step-N`
    and keeps the last `KEEP_CHECKPOINTS` checkpoints."""
    root = output_dir / CHECKPOINTS_DIR
    name = f"{CHECKPOINT_PREFIX}{state.step}"
    temporary, final = root / f"{TEMPORARY_PREFIX}{name}", root / name
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(temporary))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (temporary / TRAINER_STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
        _write_manifest(temporary)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(temporary, final)
        for stale in list_checkpoints(output_dir)[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(stale)
    accelerator.wait_for_everyone()
    return final


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints `checkpoints/step-N`, oldest first."""
    root = output_dir / CHECKPOINTS_DIR
    found = [path for path in root.glob(f"{CHECKPOINT_PREFIX}*") if path.name[len(CHECKPOINT_PREFIX) :].isdigit()]
    return sorted(found, key=lambda path: int(path.name[len(CHECKPOINT_PREFIX) :]))


def restore_checkpoint(accelerator: Accelerator, checkpoint: Path) -> TrainerState:
    """Checks `checkpoint` against its manifest, loads model, optimizer, scheduler and RNG states from it and returns
    its trainer state. A damaged checkpoint is a ValueError naming the previous one to resume from."""
    try:
        verify_checkpoint(checkpoint)
        accelerator.load_state(str(checkpoint))
        return TrainerState(**json.loads((checkpoint / TRAINER_STATE_FILE).read_text()))
    except (OSError, RuntimeError, ValueError, TypeError, KeyError) as error:
        previous = [path for path in list_checkpoints(checkpoint.parent.parent) if path != checkpoint]
        fallback = f"delete it to resume from {previous[-1]}" if previous else "no earlier checkpoint is left"
        raise ValueError(f"Checkpoint {checkpoint} is damaged ({error}); {fallback}.") from error


def read_metrics(path: Path) -> list[dict]:
    """The metrics log's records; a last line torn by a kill (no newline, or not JSON) is dropped."""
    records = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            records.append(json.loads(line))
        except ValueError:
            if line.endswith("\n") and line.strip():
                raise
    return records


def trim_metrics(path: Path, last_step: int) -> None:
    """Drops the log lines of steps after `last_step` (those of a run that died after its last checkpoint, or the
    whole log of an earlier run without checkpoints when a fresh run starts: `last_step` 0) and a torn last line."""
    if path.exists():
        kept = [record for record in read_metrics(path) if record.get("step", 0) <= last_step]
        write_atomically(path, "".join(json.dumps(record) + "\n" for record in kept))


def append_metrics(path: Path, record: dict) -> None:
    """Appends one JSON line to the metrics log."""
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")


def end_process_group() -> None:
    """Tears down the `accelerate launch` process group after the last barrier (left to exit, its destructor can
    abort a run that finished)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class StopOnSignal:
    """Within its `with` block, a first SIGTERM or SIGINT sets `requested` (training then checkpoints and stops)."""

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
