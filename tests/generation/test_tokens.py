"""From scores to tokens: logits processing over ragged prefixes, seeded sampling, committing and stopping rules (each
rule alone; the engine tests check them end to end against `generate`)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target
from helpers import PAD, make_batch, started_batch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_specformer import generate, generate_batch
from hf_specformer.generation.batch import RaggedBatch
from hf_specformer.generation.tokens import Committer, RaggedLogitsProcessor, TokenSelector, gumbel_noise


def _generation_config(eos: int) -> GenerationConfig:
    config = GenerationConfig(eos_token_id=eos, pad_token_id=PAD)
    config._eos_token_tensor, config._pad_token_tensor = torch.tensor([eos]), torch.tensor(PAD)
    return config


class StopAfterSeven(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == 7


def test_committer_cuts_rows_at_eos_at_max_new_tokens_and_at_a_stopping_criterion():
    batch = started_batch(torch.full((5, 2), 5), None, 8, PAD, max_new_tokens=5)
    batch.num_generated[3] = 3  # two new tokens left of max_new_tokens = 5
    batch.finished[4] = True  # already finished: its count is 0 and it stays finished
    commit = Committer(StoppingCriteriaList([StopAfterSeven()]), _generation_config(eos=2), streamer=None)
    tokens = torch.tensor([[3, 2, 4], [3, 4, 4], [3, 7, 3], [3, 3, 3], [3, 3, 3]])
    finished = commit(batch, tokens, torch.tensor([3, 3, 3, 3, 0]))
    assert finished.tolist() == [True, False, True, True, True]
    assert batch.num_generated.tolist() == [2, 3, 2, 5, 0]
    assert batch.sequences()[:3, 2:5].tolist() == [[3, 2, PAD], [3, 4, 4], [3, 7, PAD]]


def test_committer_keeps_counts_shorter_than_the_tokens_given():
    batch = started_batch(torch.full((2, 2), 5), None, 8, PAD, max_new_tokens=10)
    commit = Committer(None, _generation_config(eos=2), streamer=None)
    finished = commit(batch, torch.tensor([[3, 2, 4], [3, 4, 2]]), torch.tensor([1, 2]))  # EOS past the counts
    assert finished.tolist() == [False, False] and batch.num_generated.tolist() == [1, 2]


def _ragged_batch_with_drafts() -> RaggedBatch:
    """Three rows that generated 0, 2 and 1 tokens, with drafts written after each prefix."""
    generator = torch.Generator().manual_seed(0)
    batch = started_batch(torch.randint(3, 12, (3, 4), generator=generator), None, 8, PAD)
    batch.commit_tokens(torch.randint(3, 12, (3, 2), generator=generator), torch.tensor([0, 2, 1]))
    batch.write(torch.randint(3, 12, (3, 3), generator=generator))
    return batch


def test_processing_reads_each_positions_own_prefix():
    """A processor that reads the prefix sees, at position j of row b, exactly row b's committed tokens plus its
    drafts before j (what plain `generate` would pass it there)."""
    batch = _ragged_batch_with_drafts()
    processors = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.7), MinNewTokensLengthLogitsProcessor(4, 2, eos_token_id=2),
        MinLengthLogitsProcessor(6, eos_token_id=[2, 5]),
        TemperatureLogitsWarper(0.7),
    ])
    logits = torch.randn(3, 3, 12, generator=torch.Generator().manual_seed(1))
    processed = RaggedLogitsProcessor(processors)(batch, logits.clone())  # (processed in place)
    prefix = batch.prefix_lengths()
    assert processed[:, :, 2].isinf().any() and not processed[:, :, 2].isinf().all()  # min-new-tokens bites midway
    for b in range(3):
        for j in range(3):
            expected = processors(batch.tokens[b : b + 1, : int(prefix[b]) + j], logits[b, j][None].clone())
            torch.testing.assert_close(processed[b, j], expected[0])
    assert not torch.equal(processed[0, 0], processed[0, 1])  # different prefixes, different penalties


def test_prefix_free_processing_runs_once_over_all_positions():
    batch = _ragged_batch_with_drafts()
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.5), TopKLogitsWarper(3)])
    processor = RaggedLogitsProcessor(processors)
    logits = torch.randn(3, 3, 12, generator=torch.Generator().manual_seed(2))
    assert not processor.reads_prefix
    expected = processors(batch.tokens[:1, :1].expand(9, 1), logits.reshape(9, 12).clone()).view(3, 3, 12)
    torch.testing.assert_close(processor(batch, logits), expected)


def test_noise_depends_only_on_seed_position_and_token():
    noise = gumbel_noise(torch.tensor([3, 9, 3]), torch.tensor([[0, 1], [0, 1], [5, 1]]), 50)
    assert torch.equal(noise[0, 1], noise[2, 1]) and not torch.equal(noise[0, 0], noise[1, 0])
    assert not torch.equal(noise[0, 0], noise[0, 1])
    alone = gumbel_noise(torch.tensor([9]), torch.tensor([[1]]), 50)
    assert torch.equal(alone[0, 0], noise[1, 1])
    many = gumbel_noise(torch.arange(200), torch.zeros(200, 1, dtype=torch.long), 500).flatten().double()
    assert abs(float(many.mean()) - 0.5772) < 0.01 and abs(float(many.var()) - torch.pi**2 / 6) < 0.03


def test_noise_is_finite_at_the_largest_uniform():
    """Seed 3, position 2039, token 184 hashes to the largest 24-bit uniform, which float32 rounded to 1 (noise +inf:
    that token was always chosen)."""
    assert torch.isfinite(gumbel_noise(torch.tensor([3]), torch.tensor([[2039]]), 1024)).all()


def test_per_row_temperature_and_top_p():
    """Seeded rows with their own settings: temperature 0 is the argmax, top_p near 0 keeps only the argmax too, and
    temperature 1 with top_p 1 is the seeded sample of the plain scores."""
    batch = started_batch(torch.full((3, 2), 5), None, 8, PAD)
    selector = TokenSelector(True, torch.tensor([1, 2, 3]))
    scores = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(5))
    sampled = selector(scores, batch)
    selector.set_rows([0, 1, 2], [1, 2, 3], [0.0, 0.7, 1.0], [1.0, 1e-6, 1.0], "cpu")
    chosen = selector(scores, batch)
    assert torch.equal(chosen[:2], scores[:2].argmax(-1)) and torch.equal(chosen[2], sampled[2])


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
                             speculation_config={"schedule": "fixed"}, **kwargs)
    assert sum(output.accepted_drafts for output in slotted) > 0
    reversed_plain = generate_batch(target, prompts[::-1], max_batch_size=6, seeds=seeds[::-1], **kwargs)
    alone = [generate_batch(target, [prompt], assistant_model=drafter, seeds=[seed], **kwargs)[0]
             for prompt, seed in zip(prompts, seeds)]
    assert texts(slotted) == texts(reversed_plain)[::-1] == texts(alone)
    other = generate_batch(target, prompts, assistant_model=drafter, max_batch_size=2, seeds=[20, *seeds[1:]],
                           speculation_config={"schedule": "fixed"}, **kwargs)
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
