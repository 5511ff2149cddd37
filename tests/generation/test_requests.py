"""`generate_batch` and rows reported as they finish: each request's own greedy answer, why it ended, and nothing
lost on an interruption."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target
from helpers import PAD, make_batch

from hf_specformer import generate, generate_batch


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_generate_batch_returns_each_requests_own_greedy_answer_and_why_it_ended(kind):
    """7 requests of different lengths through 3 slots: each request's tokens equal plain `generate` of its prompt
    alone (cut after its EOS), with finish reason "eos" where it ended on one and "length" at max_new_tokens."""
    target = make_target(kind)
    drafter = make_drafter(target)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (length,), generator=generator).tolist() for length in (3, 9, 5, 12, 4, 7, 6)]
    alone = [target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, pad_token_id=PAD)[0,
                                                                                                        len(prompt):]
             for prompt in prompts]
    eos = int(alone[1][5])
    outputs = generate_batch(target, prompts, assistant_model=drafter, max_batch_size=3, max_new_tokens=16,
                             eos_token_id=eos, pad_token_id=PAD, do_sample=False)
    reasons = []
    for prompt, output, reference in zip(prompts, outputs, alone):
        ends = (reference == eos).nonzero().flatten().tolist()
        expected = reference[: ends[0] + 1] if ends else reference
        assert output.prompt_ids == prompt and output.generated_tokens == expected.tolist()
        assert output.finish_reason == ("eos" if ends else "length") and output.tokens_per_step >= 1.0
        reasons.append(output.finish_reason)
    assert "eos" in reasons and "length" in reasons


def test_generate_batch_rejects_empty_requests():
    target = make_target()
    for bad in ([], [[3, 4], []], [torch.tensor([3, 4])]):
        with pytest.raises(ValueError, match="token-id lists"):
            generate_batch(target, bad, assistant_model=make_drafter(target))


@pytest.mark.parametrize("slots", [None, 2])
def test_each_row_is_reported_once_the_step_it_finishes(slots):
    """`row_finished` gets every row once, with the tokens `generate` returns for it and the steps and accepted
    drafts the call counted for it; reports come as rows finish (rows of one admission in order of their steps), not
    in row order at the end."""
    target = make_target()
    input_ids, mask = make_batch(6, seed=5)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    eos = int(reference[0, input_ids.shape[1] + 3])  # row 0 ends early, others later or never
    reports = []
    output = generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                      max_new_tokens=24, eos_token_id=eos, pad_token_id=PAD, return_dict_in_generate=True,
                      speculation_config={"schedule": "fixed", "max_batch_size": slots}, row_finished=reports.append)
    assert sorted(report.row for report in reports) == list(range(6))
    generated = output.sequences[:, input_ids.shape[1]:]
    for report in reports:
        row = generated[report.row].tolist()
        assert report.tokens == row[: len(report.tokens)] and all(t == PAD for t in row[len(report.tokens):])
        assert report.tokens[-1] == eos or len(report.tokens) == 24
        kappa = output.speculation_stats.tokens_per_row[report.row]
        assert report.steps > 0 and (report.steps + report.accepted) / report.steps == pytest.approx(kappa)
    if slots is None:  # one admission: finishing order is the order of steps taken
        assert [report.steps for report in reports] == sorted(report.steps for report in reports)
        assert [report.row for report in reports] != list(range(6))


def test_rows_without_drafts_are_reported_as_they_finish():
    """k = 0 with a listener runs the engine's plain steps: each row is reported the step it ends, cut after its
    EOS, with one step per token."""
    target = make_target()
    input_ids, mask = make_batch(3, seed=2)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    eos = int(reference[1, input_ids.shape[1] + 2])
    reports = []
    output = generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=make_drafter(target),
                      num_assistant_tokens=0, max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD,
                      row_finished=reports.append)
    assert torch.equal(output, target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                               max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD))
    assert reports[0].row == 1 and sorted(report.row for report in reports) == [0, 1, 2]
    for report in reports:
        row = output[report.row, input_ids.shape[1]:].tolist()
        end = row.index(eos) + 1 if eos in row else 12
        assert report.tokens == row[:end] and report.accepted == 0 and report.steps == end - 1


def test_generate_batch_hands_over_outputs_as_they_finish_and_an_interruption_keeps_them():
    """`on_output` sees each request's final output; when it raises (a job killed mid-call), the call stops there
    and what it was handed stays correct."""
    target = make_target()
    drafter = make_drafter(target)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 90, (length,), generator=generator).tolist() for length in (4, 8, 3, 6, 5, 9)]
    kwargs = dict(assistant_model=drafter, max_batch_size=2, max_new_tokens=10, pad_token_id=PAD, do_sample=False)
    outputs = generate_batch(target, prompts, **kwargs)
    seen = {}

    def stop_after_three(index, output):
        seen[index] = output
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_batch(target, prompts, on_output=stop_after_three, progress_bar=False, **kwargs)
    assert len(seen) == 3
    for index, output in seen.items():  # the steps taken depend on the timings the scheduler learns from
        assert (output.prompt_ids, output.generated_tokens, output.finish_reason) == \
            (outputs[index].prompt_ids, outputs[index].generated_tokens, outputs[index].finish_reason)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_generate_batch_without_a_drafter_runs_plain_steps_with_continuous_batching(kind):
    target = make_target(kind)
    input_ids, mask = make_batch(7, seed=8)
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    eos = int(reference[2, input_ids.shape[1] + 4])
    prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]
    outputs = generate_batch(target, prompts, max_batch_size=3, max_new_tokens=12, eos_token_id=eos,
                             pad_token_id=PAD, do_sample=False, progress_bar=False)
    for output, row in zip(outputs, reference[:, input_ids.shape[1]:].tolist()):
        end = row.index(eos) + 1 if eos in row else 12
        assert output.generated_tokens == row[:end] and output.tokens_per_step == 1.0
