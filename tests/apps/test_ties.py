"""Low-precision mismatches are classified: ties (the target's two candidates within rounding) vs true bugs; in
bfloat16 speculative decoding shows no true bug."""

from __future__ import annotations

import torch
from conftest import make_drafter, make_target
from generation.helpers import make_batch

from hf_specformer import generate
from hf_specformer.apps.ties import classify_mismatch, classify_rows, tie_tolerance


def twin_token_target():
    """A tiny Llama whose tokens 40 and 41 share one output row: their logits are equal everywhere, so choosing
    either is a tie; its argmax picks 40."""
    target = make_target("llama")
    with torch.no_grad():
        target.lm_head.weight[41] = target.lm_head.weight[40]
        target.lm_head.weight[40:42] *= 30  # and make them the best token
    return target


def test_a_flip_between_equal_logits_is_a_tie_and_a_low_ranked_token_is_a_bug():
    target = twin_token_target()
    input_ids, mask = make_batch(1, seed=3)
    plain = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    new = plain[0, input_ids.shape[1]:]
    assert int(new[2]) == 40
    tied, wrong = new.clone(), new.clone()
    tied[2] = 41
    with torch.no_grad():
        prefix = plain[:, mask[0].bool().nonzero()[0, 0]: input_ids.shape[1] + 2]
        logits = target(prefix).logits
    wrong[2] = int(logits[0, -1].argmin())
    tie = classify_mismatch(target, input_ids[0], mask[0], new, tied)
    bug = classify_mismatch(target, input_ids[0], mask[0], new, wrong)
    assert (tie.position, tie.tie, tie.gap) == (2, True, 0.0)
    assert bug.position == 2 and not bug.tie and bug.gap > 100 * bug.tolerance
    assert classify_mismatch(target, input_ids[0], mask[0], new, new) is None


def test_tolerance_scales_with_the_dtype_and_the_logit():
    assert tie_tolerance(torch.bfloat16, 10.0) == 4 * 2**-7 * 10
    assert tie_tolerance(torch.float32, 0.1) == 4 * 2**-23


def test_bfloat16_speculation_has_no_true_bug():
    """A tiny Llama and its drafter in bfloat16 on the CPU, 48 rows in 3 batches: every row equals plain decoding
    or differs by a tie."""
    target = make_target("llama").to(torch.bfloat16)
    drafter = make_drafter(target).to(torch.bfloat16)
    mismatches = []
    for seed in range(3):
        input_ids, mask = make_batch(16, seed=seed)
        kwargs = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
        plain = target.generate(**kwargs)
        spec = generate(target, assistant_model=drafter, speculation_config={"schedule": "fixed"}, **kwargs)
        mismatches += classify_rows(target, input_ids, mask, plain, spec, pad_token_id=0)
    assert not [m for m in mismatches if not m.tie], mismatches  # torch 2.13 CPU: 7 of the 48 rows differ, all ties
