"""`generate`'s surface: `SpeculationConfig` and transformers' assisted-generation names, what it refuses, and the
drafter and companion it is given."""

from __future__ import annotations

import pytest
import torch
from conftest import make_companion, make_drafter, make_target
from helpers import PAD, TEST_STEP_COSTS, make_batch
from transformers import GenerationConfig

from hf_specformer import SpeculationConfig, StepCosts, generate


@pytest.mark.parametrize("theirs, ours", [
    ({"num_assistant_tokens": 2}, {"num_draft_tokens": 2}),
    ({"num_assistant_tokens": 0}, {"num_draft_tokens": 0}),
    ({"prompt_lookup_num_tokens": 3}, {"num_draft_tokens": 3}),
    ({"prompt_lookup_num_tokens": 0}, {"lookup_ngram_size": 0}),
    ({"max_matching_ngram_size": 2}, {"lookup_ngram_size": 2}),
    ({"assistant_confidence_threshold": 0.4, "num_assistant_tokens_schedule": "constant"},
     {"confidence_threshold": 0.4, "schedule": "fixed"}),
    ({"assistant_confidence_threshold": 0.4}, {"confidence_threshold": 0.4, "schedule": "fixed"}),
])
@pytest.mark.parametrize("where", ["arguments", "generation_config"])
def test_transformers_names_do_what_ours_do(theirs, ours, where):
    target = make_target("qwen3")
    input_ids, mask = make_batch(4, seed=12)
    base = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=PAD,
                return_dict_in_generate=True)
    if where == "arguments":
        output = generate(target, assistant_model=make_drafter(target), **base, **theirs,
                          speculation_config={"step_costs": TEST_STEP_COSTS})
    else:
        config = GenerationConfig(**{**target.generation_config.to_dict(), **theirs})
        output = generate(target, assistant_model=make_drafter(target), generation_config=config, **base,
                          speculation_config={"step_costs": TEST_STEP_COSTS})
    expected = generate(target, assistant_model=make_drafter(target), **base,
                        speculation_config={"step_costs": TEST_STEP_COSTS, **ours})
    assert torch.equal(output.sequences, expected.sequences)
    assert output.speculation_stats == expected.speculation_stats
    assert torch.equal(output.sequences, target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=14,
                                                         do_sample=False, pad_token_id=PAD))


def test_disagreeing_names_raise():
    target = make_target("llama")
    input_ids, mask = make_batch(2)
    with pytest.raises(ValueError, match="num_draft_tokens=3 disagrees"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                 speculation_config={"num_draft_tokens": 3}, num_assistant_tokens=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="disagree"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                 prompt_lookup_num_tokens=3, num_assistant_tokens=2, max_new_tokens=4)


@pytest.mark.parametrize("name, value", [("num_draft_tokens", 3), ("schedule", "fixed"), ("max_batch_size", 2),
                                         ("step_costs", TEST_STEP_COSTS)])
def test_a_config_field_passed_as_an_argument_is_refused_with_where_it_goes(name, value):
    target = make_target("llama")
    input_ids, mask = make_batch(2)
    with pytest.raises(TypeError, match=f"{name} is a SpeculationConfig field: pass speculation_config="):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                 max_new_tokens=4, **{name: value})
    with pytest.raises(TypeError, match="no fields"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                 max_new_tokens=4, speculation_config={"num_drafts": 3})


@pytest.mark.parametrize("fields, error, message", [
    ({"schedule": "adaptive"}, ValueError, "schedule"),
    ({"schedule": "goodput", "confidence_threshold": 0.3}, ValueError, "fixed"),
    ({"confidence_threshold": -0.1, "schedule": "fixed"}, ValueError, "between 0 and 1"),
    ({"max_batch_size": 0}, ValueError, "max_batch_size"),
    ({"max_batch_size": 1.5}, TypeError, "max_batch_size"),
    ({"max_batch_size": True}, TypeError, "max_batch_size"),
    ({"memory_budget": -1}, ValueError, "memory_budget"),
    ({"step_costs": {"plain": 1.0}}, TypeError, "StepCosts"),
    ({"suffix_index": "yes"}, TypeError, "SuffixIndex"),
    ({"kernel_backend": "cuda-please"}, ValueError, "kernel_backend"),
])
def test_config_fields_are_checked(fields, error, message):
    with pytest.raises(error, match=message):
        SpeculationConfig(**fields)


def test_a_memory_budget_caps_the_slots_at_what_fits():
    config = SpeculationConfig(max_batch_size=8, memory_budget=3500)
    assert config.slots(20, 1000) == 3 and config.slots(2, 1000) == 2
    assert SpeculationConfig(max_batch_size=2, memory_budget=3500).slots(20, 1000) == 2
    assert SpeculationConfig(memory_budget=3500).slots(20, 1000) == 3
    with pytest.raises(ValueError, match="holds no row"):
        config.slots(20, 4000)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_beams": 2}, "beam search"), ({"num_return_sequences": 2}, "num_return_sequences"),
    ({"cache_implementation": "static"}, "DynamicCache"), ({"output_scores": True}, "unsupported")])
def test_unsupported_arguments_raise(kwargs, message):
    target = make_target("llama")
    input_ids, mask = make_batch(2, seed=1)
    with pytest.raises(ValueError, match=message):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                 max_new_tokens=4, **kwargs)


def test_missing_attention_mask_with_padding_raises():
    target = make_target("llama")
    input_ids, _ = make_batch(3, seed=1)
    with pytest.raises(ValueError, match="attention_mask"):
        generate(target, input_ids=input_ids, assistant_model=make_drafter(target), max_new_tokens=4, pad_token_id=PAD)


def test_drafters_and_companions_that_do_not_fit_the_target_are_refused():
    target, other, qwen = make_target("llama"), make_target("llama", seed=7), make_target("qwen3")
    input_ids, mask = make_batch(2, seed=1)
    common = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=4)
    with pytest.raises(ValueError, match="another target"):
        generate(target, assistant_model=make_drafter(other), **common)
    unbound = make_drafter(qwen)
    unbound._target_head = None  # an unbound copy of a Qwen3 drafter
    with pytest.raises(ValueError, match="model_type"):
        generate(target, assistant_model=unbound, **common)
    with pytest.raises(ValueError, match="assistant_model"):
        generate(target, **common)
    with pytest.raises(ValueError, match="sv_companion"):
        generate(target, assistant_model=make_drafter(target), companion_model=make_drafter(target), **common)
    with pytest.raises(ValueError, match="goodput scheduler only"):
        generate(target, assistant_model=make_drafter(target), companion_model=make_companion(target), **common,
                 speculation_config={"schedule": "fixed"})


def test_fixed_step_costs_repeat_the_choices_exactly():
    target = make_target("llama")
    input_ids, mask = make_batch(6, seed=3)
    calls = [generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                      max_new_tokens=16, pad_token_id=PAD, return_dict_in_generate=True,
                      speculation_config={"step_costs": StepCosts(plain=1.0, per_input=0.1, draft=0.01, learn=False)})
             for _ in range(2)]
    assert calls[0].speculation_stats == calls[1].speculation_stats
