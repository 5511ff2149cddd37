"""Property-based losslessness: greedy speculative output equals plain `generate` token for token (float64) on
hypothesis-drawn cases: batch size 1..64, prompt lengths and left padding, k 1..l_d, the untrained drafter or a
noisy oracle, EOS ids reached mid-way, min/max new tokens, repetition penalty, stop strings, prompt lookup on/off,
suffix drafts on/off, compaction policy, both schedules (goodput, fixed k, confidence threshold) and continuous
batching (all rows at once, or 1, 3 or 8 slots with the others admitted as rows finish), on Llama and Qwen3 targets.

`PROPERTY_EXAMPLES` cases run per CI run, in four shards (target kind x proposer) that pytest-xdist runs side by side;
hypothesis draws them from a random seed and, on a failure, prints the falsifying case, the run's seed
(`--hypothesis-seed=...`, also in the header) and a `@reproduce_failure` blob.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import TINY_VOCAB, make_drafter, make_target
from helpers import PAD, TEST_STEP_COSTS, char_tokenizer, make_batch, noisy_oracle
from hypothesis import HealthCheck, given, settings
from hypothesis import core as hypothesis_core
from hypothesis import strategies as st

from hf_specformer import generate

PROPERTY_EXAMPLES = 400
SHARDS = [(kind, proposer) for kind in ("llama", "qwen3") for proposer in ("drafter", "oracle")]
DRAFT_LENGTH = 4

SCHEDULES = {
    "goodput": dict(schedule="goodput", step_costs=TEST_STEP_COSTS),
    "fixed": dict(schedule="fixed"),
    "threshold": dict(schedule="fixed", confidence_threshold=0.3),
}


@functools.cache
def models(kind: str):
    target = make_target(kind)
    return target, make_drafter(target, draft_length=DRAFT_LENGTH)


@functools.cache
def tokenizer():
    return char_tokenizer()


@st.composite
def cases(draw, kind: str, proposer: str) -> dict:
    max_new_tokens = draw(st.integers(1, 24))
    return dict(
        kind=kind,
        batch_size=draw(st.integers(1, 64)),
        max_len=draw(st.integers(1, 16)),
        padded=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        k=draw(st.integers(1, DRAFT_LENGTH)),
        proposer=proposer,
        corrupt=draw(st.sampled_from([0.0, 0.2, 0.6])),
        max_new_tokens=max_new_tokens,
        min_new_tokens=draw(st.integers(0, max_new_tokens)),
        eos_positions=draw(st.lists(st.integers(0, max_new_tokens - 1), max_size=2)),
        stop_string_position=draw(st.one_of(st.none(), st.integers(0, max(max_new_tokens - 2, 0)))),
        repetition_penalty=draw(st.sampled_from([None, 1.3])),
        lookup_ngram_size=draw(st.sampled_from([0, 2, 3])),
        suffix=draw(st.booleans()),
        schedule=draw(st.sampled_from(sorted(SCHEDULES))),
        compaction_hole_fraction=draw(st.sampled_from([0.0, 0.5, 2.0])),
        max_batch_size=draw(st.sampled_from([None, None, 1, 3, 8])),
    )


def _generation_kwargs(case: dict, target, input_ids, mask) -> dict:
    """generate's arguments for the case; EOS ids and stop strings are tokens that a plain run emits mid-way."""
    kwargs = dict(max_new_tokens=case["max_new_tokens"], min_new_tokens=case["min_new_tokens"] or None,
                  repetition_penalty=case["repetition_penalty"], do_sample=False, pad_token_id=PAD)
    if not case["eos_positions"] and case["stop_string_position"] is None:
        return kwargs
    explored = target.generate(input_ids=input_ids, attention_mask=mask, **kwargs)[:, input_ids.shape[1]:]
    generator = torch.Generator().manual_seed(case["seed"])
    rows = torch.randint(explored.shape[0], (3,), generator=generator).tolist()
    width = explored.shape[1]
    if case["eos_positions"]:
        positions = zip(rows, case["eos_positions"])
        kwargs["eos_token_id"] = [int(explored[row, min(at, width - 1)]) for row, at in positions]
    at = case["stop_string_position"]
    if at is not None and width >= 2:
        kwargs["stop_strings"] = [tokenizer().decode(explored[rows[2], min(at, width - 2):][:2])]
        kwargs["tokenizer"] = tokenizer()
    return kwargs


@pytest.mark.parametrize("kind, proposer", SHARDS)
@settings(max_examples=PROPERTY_EXAMPLES // len(SHARDS), deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_greedy_speculation_equals_generate(kind, proposer, data):
    case = data.draw(cases(kind, proposer), label="case")
    target, drafter = models(case["kind"])
    input_ids, mask = make_batch(case["batch_size"], seed=case["seed"], padded=case["padded"],
                                 min_len=1, max_len=case["max_len"])
    kwargs = _generation_kwargs(case, target, input_ids, mask)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
    if case["proposer"] == "oracle":
        new = reference[:, input_ids.shape[1]:]
        assistant = noisy_oracle(new, case["k"], TINY_VOCAB, case["corrupt"], seed=case["seed"])
        num_draft_tokens = None
    else:
        assistant, num_draft_tokens = drafter, case["k"]
    speculation = dict(num_draft_tokens=num_draft_tokens, lookup_ngram_size=case["lookup_ngram_size"],
                       compaction_hole_fraction=case["compaction_hole_fraction"], suffix_index=case["suffix"],
                       max_batch_size=case["max_batch_size"], **SCHEDULES[case["schedule"]])
    output = generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=assistant,
                      speculation_config=speculation, **kwargs)
    repeat = f"(repeat with --hypothesis-seed={hypothesis_core.global_force_seed})"
    assert output.shape == reference.shape, repeat
    mismatched = (output != reference).any(1).nonzero().flatten().tolist()
    assert not mismatched, f"rows {mismatched} differ {repeat}:\n{output[mismatched]}\n{reference[mismatched]}"
