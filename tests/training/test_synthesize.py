"""Tests of prompt synthesis (Magpie): the real SmolLM2 target writes user prompts; resuming reproduces the run."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_chat_target

from hf_specformer.targets import load_target
from hf_specformer.training.synthesize import (
    CATEGORY_SYSTEM_PROMPTS,
    synthesize_prompts,
    user_turn_prefix_ids,
)

NUM_PROMPTS, BATCH_SIZE, MAX_NEW_TOKENS = 6, 4, 48


@pytest.fixture(scope="module")
def smollm2():
    return load_target()


def test_user_turn_prefix_is_the_template_before_the_message(tokenizer):
    prefix = tokenizer.decode(user_turn_prefix_ids(tokenizer))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    assert rendered.startswith(prefix + "Hello there")
    assert prefix.endswith("user\n")  # SmolLM2: system prompt, then the user header


@pytest.mark.slow
def test_smollm2_writes_distinct_prompts_and_resumes_reproducibly(smollm2, tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    kwargs = dict(batch_size=BATCH_SIZE, max_new_tokens=MAX_NEW_TOKENS, progress=False)
    prompts = synthesize_prompts(smollm2, tokenizer, NUM_PROMPTS, str(path), **kwargs)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(prompts) == len(set(prompts)) == NUM_PROMPTS and all(p and p == p.strip() for p in prompts)
    assert [record["id"] for record in records] == list(range(NUM_PROMPTS))
    assert [record["prompt"] for record in records] == prompts
    assert records[-1]["batch"] >= 1  # 4 messages a batch cannot give 6 prompts at once

    # A kill during the second batch: the first batch's records and a half-written line are on disk.
    first_batch = [line for line, record in zip(path.read_text().splitlines(), records) if record["batch"] == 0]
    path.write_text("".join(line + "\n" for line in first_batch) + first_batch[-1][:15])
    assert synthesize_prompts(smollm2, tokenizer, NUM_PROMPTS, str(path), **kwargs) == prompts
    assert [json.loads(line)["prompt"] for line in path.read_text().splitlines()] == prompts

    assert synthesize_prompts(smollm2, tokenizer, 2, str(path), **kwargs) == prompts[:2]  # already there
    with pytest.raises(ValueError, match="seed"):
        synthesize_prompts(smollm2, tokenizer, NUM_PROMPTS, str(path), seed=1, **kwargs)

    # A new set that excludes the first three: the same seed samples the same messages, so it keeps the other three
    # first, and the exclusions are part of the run's identity.
    other = str(tmp_path / "other.jsonl")
    excluded = [" " + prompt for prompt in prompts[:3]]  # compared stripped
    again = synthesize_prompts(smollm2, tokenizer, NUM_PROMPTS, other, exclude=excluded, **kwargs)
    assert again[:3] == prompts[3:] and not set(again) & set(prompts[:3]) and len(set(again)) == NUM_PROMPTS
    with pytest.raises(ValueError, match="excluded"):
        synthesize_prompts(smollm2, tokenizer, NUM_PROMPTS, other, **kwargs)


def test_a_target_that_never_closes_its_turn_is_an_error(tokenizer, tmp_path):
    with pytest.raises(RuntimeError, match="instruction-tuned"):
        synthesize_prompts(tiny_chat_target(tokenizer), tokenizer, 2, str(tmp_path / "p.jsonl"), batch_size=2,
                           max_new_tokens=2, progress=False)


@pytest.mark.slow
def test_categories_steer_the_system_prompt_batch_by_batch(smollm2, tokenizer, tmp_path):
    """SmolLM2 writes prompts under category system prompts: batch b's template carries category b mod n's, and its
    records name that category; the categories are part of the run's identity (a resume with others is refused),
    and unknown ones are an error."""
    writing = user_turn_prefix_ids(tokenizer, CATEGORY_SYSTEM_PROMPTS["writing"])
    assert tokenizer.decode(writing).endswith(CATEGORY_SYSTEM_PROMPTS["writing"] + "<|im_end|>\n<|im_start|>user\n")
    path = tmp_path / "p.jsonl"
    kwargs = dict(batch_size=3, max_new_tokens=MAX_NEW_TOKENS, progress=False)
    synthesize_prompts(smollm2, tokenizer, 6, str(path), categories=["math", "coding"], **kwargs)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records and all(r["category"] == ["math", "coding"][r["batch"] % 2] for r in records)
    assert all(r["source"].endswith(":" + r["category"]) for r in records)
    assert {r["category"] for r in records} == {"math", "coding"}
    with pytest.raises(ValueError, match="seed|categories"):
        synthesize_prompts(smollm2, tokenizer, 6, str(path), categories=["math"], **kwargs)
    with pytest.raises(ValueError, match="Unknown categories"):
        synthesize_prompts(smollm2, tokenizer, 6, str(tmp_path / "q.jsonl"), categories=["poetry"], **kwargs)
