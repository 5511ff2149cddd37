"""Training and distillation survive `kill -9` at random instants: killed several times and resumed, a run ends
in the state of an uninterrupted one (same drafter weights, same metrics, same records, none lost or repeated);
a damaged checkpoint is a clear error that names the good one before it."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_target, tiny_chat_target
from safetensors.torch import load_file
from training_helpers import make_config, read_metrics, repetitive_dataset

from hf_specformer.targets import load_tokenizer
from hf_specformer.training.train_drafter import train

KILLS = 3
DEADLINE_SECONDS = 240


def _kill_at_random(command: list[str], progress, rng: random.Random, label: str) -> bool:
    """Starts `command`, waits until `progress()` (a count of finished units: optimiser steps, records) has moved
    by a random 1..4, then a random 0..0.3 s more (often inside a checkpoint or record write), and kills it with
    SIGKILL unless it finished first; returns whether the kill hit a running process."""
    target = progress() + rng.randint(1, 4)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + DEADLINE_SECONDS
    while progress() < target and process.poll() is None:
        assert time.monotonic() < deadline, f"{label}: no progress"
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.3))
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode in (0, -signal.SIGKILL), f"{label}:\n{stderr[-4000:]}"
    return process.returncode == -signal.SIGKILL


def _run(command: list[str]) -> None:
    completed = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_SECONDS)
    assert completed.returncode == 0, completed.stderr[-4000:]


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_training_killed_repeatedly_ends_like_an_uninterrupted_run(tmp_path):
    make_target().float().save_pretrained(tmp_path / "target")
    repetitive_dataset(num_rows=10).save_to_disk(str(tmp_path / "data"))

    def command(output: Path) -> list[str]:
        return [sys.executable, "-m", "hf_specformer.training.train_drafter", "--target", str(tmp_path / "target"),
                "--data", str(tmp_path / "data"), "--output-dir", str(output), "--per-device-batch-size", "2",
                "--draft-length", "2", "--eval-fraction", "0.2", "--save-every", "1", "--num-threads", "1",
                "--positions-per-sequence", "4", "--max-steps", "40", "--resume"]

    _run(command(tmp_path / "reference"))
    seed = random.randrange(2**16)
    rng = random.Random(seed)
    run = tmp_path / "killed"
    metrics = run / "metrics.jsonl"
    kills = [_kill_at_random(command(run), lambda: _count_lines(metrics), rng, f"kill {kill} (seed {seed})")
             for kill in range(KILLS)]
    assert all(kills), f"the run finished before a kill (seed {seed})"
    _run(command(run))

    expected, actual = load_file(tmp_path / "reference" / "drafter" / "model.safetensors"), \
        load_file(run / "drafter" / "model.safetensors")
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected), f"kill seed {seed}"
    losses = [(record["step"], record["loss"]) for record in read_metrics(run) if "loss" in record]
    assert losses == [(record["step"], record["loss"]) for record in read_metrics(tmp_path / "reference")
                      if "loss" in record], f"kill seed {seed}"
    assert json.loads((run / "eval.json").read_text()) == json.loads((tmp_path / "reference" / "eval.json").read_text())


def test_distillation_killed_repeatedly_loses_and_repeats_no_record(tmp_path):
    tokenizer = load_tokenizer()
    target = tiny_chat_target(tokenizer).float()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")

    def command(output: Path) -> list[str]:
        return [sys.executable, "-m", "hf_specformer.training.distill", "--target", str(tmp_path / "target"),
                "--output", str(output), "--max-new-tokens", "24", "--batch-size", "1", "--limit", "60",
                "--threads", "1", "--device", "cpu"]

    _run(command(tmp_path / "reference"))
    seed = random.randrange(2**16)
    rng = random.Random(seed)
    run = tmp_path / "killed"
    records = run / "progress" / "records.jsonl"
    kills = [_kill_at_random(command(run), lambda: _count_lines(records), rng, f"kill {kill} (seed {seed})")
             for kill in range(KILLS)]
    assert all(kills), f"the run finished before a kill (seed {seed})"
    _run(command(run))

    def by_id(folder: Path) -> dict[int, dict]:
        lines = (folder / "progress" / "records.jsonl").read_text().split("\n")
        parsed = [json.loads(line) for line in lines if line]
        assert len({record["id"] for record in parsed}) == len(parsed), "a record was written twice"
        return {record["id"]: record for record in parsed}

    assert by_id(run) == by_id(tmp_path / "reference"), f"kill seed {seed}"
    assert not [name for name in os.listdir(run) if name.startswith(".tmp-")], "temporary folders left behind"


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "delete"])
def test_damaged_checkpoint_is_a_clear_error_naming_the_previous_one(tmp_path, damage):
    options = dict(max_steps=4, per_device_batch_size=2, save_every=2, positions_per_sequence=4)
    dataset = repetitive_dataset(num_rows=6)
    train(make_config(tmp_path, **options), target=make_target(), dataset=dataset)
    newest = tmp_path / "checkpoints" / "step-4"
    weights = next(path for path in newest.rglob("*.safetensors"))
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "corrupt":
        data = bytearray(weights.read_bytes())
        data[-10] ^= 0xFF
        weights.write_bytes(bytes(data))
    else:
        weights.unlink()
    message = {"truncate": "truncated", "corrupt": "corrupt", "delete": "missing"}[damage]
    with pytest.raises(ValueError, match=f"{message}.*delete it to resume from .*step-2"):
        train(make_config(tmp_path, resume=True, **{**options, "max_steps": 6}), target=make_target(), dataset=dataset)
    shutil.rmtree(newest)  # as the error says: the run resumes from step 2
    resumed = train(make_config(tmp_path, resume=True, **{**options, "max_steps": 6}), target=make_target(),
                    dataset=dataset)
    assert resumed.state.step == 6
