"""The batch-generation job (`hf-specformer generate`): speculative answers equal plain ones, sampling is seeded,
runs resume, two `accelerate` processes split the work and together write what one process writes, and bad
options are clear errors. A tiny random Llama with SmolLM2's tokenizer (float64 in process, float32 on disk)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import CHAT_PROMPTS, make_drafter, tiny_chat_target
from datasets import load_from_disk
from training.training_helpers import free_port

from hf_specformer import SpecFormerProposer, SuffixIndex
from hf_specformer.apps import batch_job
from hf_specformer.apps.batch_job import main
from hf_specformer.data import answering
from hf_specformer.data.answering import GenerationSettings, generate_dataset
from hf_specformer.data.prompts import chat_prompt_ids
from hf_specformer.data.records import GENERATIONS_FILE, PROGRESS_DIR, THROUGHPUT_FILE
from hf_specformer.generation.engine import slot_bytes

SPECULATION = {"schedule": "fixed", "num_draft_tokens": 2, "lookup_ngram_size": 2}
"""Fixed width, so every step verifies drafts (the goodput scheduler would rightly decode plainly with a random
drafter), and prompt lookup, which a random model's repetitive text accepts often."""


@pytest.fixture(scope="module")
def target(tokenizer):
    return tiny_chat_target(tokenizer)


def test_speculative_answers_equal_plain_answers(target, tokenizer, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hf_specformer.data.answering")
    settings = GenerationSettings(max_new_tokens=24, batch_size=4)
    plain = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "plain"), settings, progress=False)
    speculation = {"assistant_model": make_drafter(target, draft_length=2), "speculation_config": SPECULATION}
    spec = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "spec"), settings, speculation=speculation,
                            progress=False)
    assert spec["input_ids"] == plain["input_ids"] and spec["response"] == plain["response"]
    assert spec["id"] == list(range(len(CHAT_PROMPTS)))
    kappa = float(re.search(r"kappa (\S+)", caplog.text).group(1))
    assert kappa > 1.0, caplog.text  # drafts were verified and some accepted
    lines = [json.loads(line) for line in (tmp_path / "spec" / GENERATIONS_FILE).read_text().splitlines()]
    assert lines == [{"id": i, "prompt": p, "response": r}
                     for i, p, r in zip(spec["id"], CHAT_PROMPTS, spec["response"])]


def test_a_memory_budget_keeps_the_answers_and_one_too_small_is_refused(target, tokenizer, tmp_path):
    """`--memory-budget-gib`: a budget that holds fewer slots than the batch size gives the same answers; one that
    holds no row stops the job with the reason."""
    settings = GenerationSettings(max_new_tokens=24, batch_size=4)
    plain = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "plain"), settings, progress=False)
    speculation = {"assistant_model": make_drafter(target, draft_length=2), "speculation_config": SPECULATION}
    width = max(len(chat_prompt_ids(tokenizer, prompt)) for prompt in CHAT_PROMPTS)  # one window: 2 slots
    slot = slot_bytes(target, SpecFormerProposer(speculation["assistant_model"], 2), width, 24)
    budgeted = GenerationSettings(max_new_tokens=24, batch_size=4, memory_budget_gib=2.5 * slot / 2**30)
    spec = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "spec"), budgeted,
                            speculation=speculation, progress=False)
    assert spec["response"] == plain["response"]
    tiny = GenerationSettings(max_new_tokens=24, batch_size=4, memory_budget_gib=1e-9)
    with pytest.raises(ValueError, match="holds no row"):
        generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "tiny"), tiny, speculation=speculation,
                         progress=False)
    with pytest.raises(ValueError, match="memory_budget_gib"):
        GenerationSettings(memory_budget_gib=0)


def test_one_suffix_index_serves_every_batch_of_the_job(target, tokenizer, tmp_path):
    """Suffix drafts from earlier batches' prompts and answers: the same answers as plain decoding, and the index
    holds every prompt and answer the job generated."""
    settings = GenerationSettings(max_new_tokens=24, batch_size=2)
    plain = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "plain"), settings, progress=False)
    index = SuffixIndex()
    speculation = {"assistant_model": make_drafter(target, draft_length=2),
                   "speculation_config": {**SPECULATION, "suffix_index": index}}
    spec = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "spec"), settings, speculation=speculation,
                            progress=False)
    assert spec["response"] == plain["response"]
    assert len(index) == len(CHAT_PROMPTS)
    throughput = json.loads((tmp_path / "spec" / PROGRESS_DIR / THROUGHPUT_FILE.format(0)).read_text())
    assert throughput["tokens"] == sum(len(ids) - length for ids, length in zip(spec["input_ids"],
                                                                               spec["prompt_length"]))
    assert throughput["kappa"] > 1.0 and throughput["num_prompts"] == len(CHAT_PROMPTS)
    assert sorted(map(len, index.sequences)) == sorted(map(len, spec["input_ids"]))


def test_a_suffix_corpus_seeds_the_index_and_raises_acceptance_with_the_same_answers(target, tokenizer, tmp_path):
    """`--suffix-corpus`: an earlier run's replies seed the job's index, on top of its own bound; the answers stay the
    plain ones, and where the corpus holds what the target says, more drafts are accepted than without it."""
    settings = GenerationSettings(max_new_tokens=24, batch_size=2)
    plain = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "plain"), settings, progress=False)
    replies = sum(len(ids) - length for ids, length in zip(plain["input_ids"], plain["prompt_length"]))
    make_drafter(target, draft_length=2).save_pretrained(tmp_path / "drafter")
    kappa = {}
    for name, corpus in (("alone", []), ("seeded", ["--suffix-corpus", str(tmp_path / "plain")])):
        args = batch_job.build_parser().parse_args(
            ["--output", str(tmp_path), "--drafter", str(tmp_path / "drafter"), "--suffix-index-tokens", "64", *corpus])
        speculation = batch_job.speculation_from_args(args, target)
        speculation["speculation_config"].update(SPECULATION)
        index = speculation["speculation_config"]["suffix_index"]
        assert (index.num_tokens, index.max_tokens) == ((replies, 64 + replies) if corpus else (0, 64))
        spec = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / name), settings,
                                speculation=speculation, progress=False)
        assert spec["response"] == plain["response"]
        kappa[name] = json.loads((tmp_path / name / PROGRESS_DIR / THROUGHPUT_FILE.format(0)).read_text())["kappa"]
    assert kappa["seeded"] > kappa["alone"] + 0.2, kappa


def test_sampling_is_seeded_per_prompt_and_resumes_to_the_same_samples(target, tokenizer, tmp_path):
    settings = GenerationSettings(max_new_tokens=10, batch_size=2, do_sample=True, seed=3)
    first = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "a"), settings, progress=False)
    again = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "b"), settings, progress=False)
    assert first["input_ids"] == again["input_ids"]  # same seed, same samples
    wider = GenerationSettings(max_new_tokens=10, batch_size=5, do_sample=True, seed=3)
    assert generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "d"), wider,
                            progress=False)["input_ids"] == first["input_ids"]  # per-prompt seeds, any slots
    other = GenerationSettings(max_new_tokens=10, batch_size=2, do_sample=True, seed=4)
    assert generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "c"), other,
                            progress=False)["input_ids"] != first["input_ids"]
    greedy = GenerationSettings(max_new_tokens=10, batch_size=2)
    with pytest.raises(ValueError, match="do_sample"):  # a run is resumed only with its own settings
        generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "a"), greedy, progress=False)

    records = tmp_path / "a" / "progress" / "records.jsonl"
    kept = records.read_text().splitlines()[:3]
    records.write_text("\n".join(kept) + "\n" + kept[0][:15])  # a kill during the fourth record's batch
    resumed = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "a"), settings, progress=False)
    assert sorted(resumed["id"]) == list(range(len(CHAT_PROMPTS)))
    assert resumed["input_ids"] == first["input_ids"]  # kept records, and the same samples for the others


def test_settings_and_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="batch_size"):
        GenerationSettings(batch_size=0)
    with pytest.raises(ValueError, match="temperature"):
        GenerationSettings(do_sample=True, temperature=0.0)
    with pytest.raises(SystemExit, match="--drafter DIR.*--plain"):
        main(["--target", str(tmp_path / "no-such-target"), "--output", str(tmp_path / "out")])


def test_two_accelerate_processes_split_the_prompts_and_resume(tokenizer, tmp_path):
    """Two CPU processes under `accelerate launch` (see `test_accelerate_launch_two_processes` for the launcher
    options) each answer half the prompts into their own records file; the dataset equals a one-process run's.
    With one process's records lost, a one-process rerun answers exactly those prompts again."""
    target = tiny_chat_target(tokenizer).float()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    make_drafter(target, draft_length=2).float().save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": p}) + "\n" for p in CHAT_PROMPTS))
    options = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts",
               str(prompts), "--max-new-tokens", "8", "--batch-size", "1", "--threads", "1", "--schedule", "fixed",
               "-k", "2", "--lookup-ngram-size", "2"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port()), "-m", "hf_specformer.apps.batch_job"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    completed = subprocess.run([*launch, *options, "--output", str(tmp_path / "two")], env=env, capture_output=True,
                               text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-4000:]
    progress = tmp_path / "two" / "progress"
    shares = [[json.loads(line)["id"] for line in (progress / name).read_text().splitlines()]
              for name in ("records.jsonl", "records-1.jsonl")]
    assert sorted(shares[0]) == [0, 2, 4] and sorted(shares[1]) == [1, 3, 5]

    torch.set_num_threads(1)
    main([*options, "--output", str(tmp_path / "one")])
    one, two = (load_from_disk(str(tmp_path / name / "dataset")) for name in ("one", "two"))
    assert two.to_list() == one.to_list()

    (progress / "records-1.jsonl").unlink()
    main([*options, "--output", str(tmp_path / "two")])  # resumed with one process
    assert sorted(json.loads(line)["id"] for line in (progress / "records.jsonl").read_text().splitlines()) == \
        list(range(len(CHAT_PROMPTS)))
    assert load_from_disk(str(tmp_path / "two" / "dataset")).to_list() == one.to_list()


def test_a_continuous_job_writes_each_answer_as_it_finishes_and_resumes_after_a_kill(target, tokenizer, tmp_path,
                                                                                     monkeypatch):
    """One continuous call answers the whole window; killed after its third answer, those three are on disk, and
    the resumed job asks only for the others. Answers equal those of static batches."""
    speculation = {"assistant_model": make_drafter(target, draft_length=2), "speculation_config": SPECULATION}
    static = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "static"),
                              GenerationSettings(max_new_tokens=24, batch_size=2, continuous=False),
                              speculation=speculation, progress=False)
    settings = GenerationSettings(max_new_tokens=24, batch_size=2)
    append = answering.append_records
    written = []

    def append_then_kill(path, records):
        append(path, records)
        written.extend(records)
        if len(written) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(answering, "append_records", append_then_kill)
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "continuous"), settings,
                         speculation=speculation, progress=False)
    monkeypatch.setattr(answering, "append_records", append)
    asked = []
    real_generate_batch = answering.generate_batch
    monkeypatch.setattr(answering, "generate_batch",
                        lambda model, inputs, **kwargs: asked.extend(inputs) or real_generate_batch(model, inputs,
                                                                                                     **kwargs))
    resumed = generate_dataset(target, tokenizer, CHAT_PROMPTS, str(tmp_path / "continuous"), settings,
                               speculation=speculation, progress=False)
    assert len(asked) == len(CHAT_PROMPTS) - 3
    assert resumed["input_ids"] == static["input_ids"] and resumed["response"] == static["response"]
