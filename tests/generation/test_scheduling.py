"""How many drafts a row verifies: the longest prefix of drafts whose cumulative probability reaches the threshold."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target
from helpers import make_batch

from hf_specformer import generate
from hf_specformer.generation.scheduling import num_drafts_to_verify


def test_longest_prefix_above_threshold_and_at_least_one():
    confidence = torch.tensor([[1.0, 1.0, 0.9, 0.1], [0.5, 0.5, 1.0, 1.0], [0.05, 1.0, 1.0, 1.0], [0.9, 0.1, 1.0, 1.0]])
    # cumulative: [1, 1, .9, .09], [.5, .25, .25, .25], [.05, ...], [.9, .09, .09, .09]
    assert num_drafts_to_verify(confidence, 0.2).tolist() == [3, 4, 1, 1]
    assert num_drafts_to_verify(confidence, 0.0).tolist() == [4, 4, 4, 4]
    assert num_drafts_to_verify(confidence, 1.0).tolist() == [2, 1, 1, 1]


@pytest.mark.parametrize("threshold", [-0.1, 1.5])
def test_generate_rejects_a_threshold_outside_zero_one(threshold):
    target = make_target("llama")
    input_ids, mask = make_batch(2)
    with pytest.raises(ValueError, match="confidence_threshold"):
        generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                 confidence_threshold=threshold, max_new_tokens=3)
