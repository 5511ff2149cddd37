"""Seeded sampling: a row's text depends only on its seed, prompt and model (its distribution: `test_sampling.py`)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target
from helpers import PAD, make_batch

from hf_specformer import generate, generate_batch
from hf_specformer.generation.seeding import gumbel_noise


def test_noise_depends_only_on_seed_position_and_token():
    noise = gumbel_noise(torch.tensor([3, 9, 3]), torch.tensor([[0, 1], [0, 1], [5, 1]]), 50)
    assert torch.equal(noise[0, 1], noise[2, 1]) and not torch.equal(noise[0, 0], noise[1, 0])
    assert not torch.equal(noise[0, 0], noise[0, 1])
    alone = gumbel_noise(torch.tensor([9]), torch.tensor([[1]]), 50)
    assert torch.equal(alone[0, 0], noise[1, 1])
    many = gumbel_noise(torch.arange(200), torch.zeros(200, 1, dtype=torch.long), 500).flatten().double()
    assert abs(float(many.mean()) - 0.5772) < 0.01 and abs(float(many.var()) - torch.pi**2 / 6) < 0.03


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_seeded_request_gives_the_same_text_in_any_batch_with_or_without_drafts(kind):
    """Six requests: through 2 slots with the drafter (fixed k, so drafts are verified every step), in reverse order
    all at once without a drafter, and each alone: the same tokens per seed; another seed changes its request only."""
    target = make_target(kind)
    drafter = make_drafter(target)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 90, (length,), generator=generator).tolist() for length in (4, 8, 3, 6, 5, 9)]
    seeds = [10, 11, 12, 13, 14, 15]
    kwargs = dict(max_new_tokens=12, pad_token_id=PAD, do_sample=True, temperature=1.5, progress_bar=False)
    texts = lambda outputs: [output.generated_tokens for output in outputs]  # noqa: E731
    slotted = generate_batch(target, prompts, assistant_model=drafter, max_batch_size=2, seeds=seeds,
                             schedule="fixed", **kwargs)
    assert sum(output.accepted_drafts for output in slotted) > 0
    reversed_plain = generate_batch(target, prompts[::-1], max_batch_size=6, seeds=seeds[::-1], **kwargs)
    alone = [generate_batch(target, [prompt], assistant_model=drafter, seeds=[seed], **kwargs)[0]
             for prompt, seed in zip(prompts, seeds)]
    assert texts(slotted) == texts(reversed_plain)[::-1] == texts(alone)
    other = generate_batch(target, prompts, assistant_model=drafter, max_batch_size=2, seeds=[20, *seeds[1:]],
                           schedule="fixed", **kwargs)
    assert texts(other)[1:] == texts(slotted)[1:] and texts(other)[0] != texts(slotted)[0]


def test_sampling_seeds_are_checked():
    target = make_target()
    drafter = make_drafter(target)
    input_ids, mask = make_batch(3, seed=1)
    common = dict(input_ids=input_ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match="do_sample"):
        generate(target, **common, do_sample=False, sampling_seeds=[1, 2, 3])
    for bad in ([1, 2], [1.0, 2.0, 3.0], [[1], [2], [3]]):
        with pytest.raises(ValueError, match="one int per row"):
            generate(target, **common, do_sample=True, sampling_seeds=bad)
