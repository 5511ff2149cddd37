"""Speculative sampling keeps the target's distribution: a chi-square test on the joint of the first 3 tokens.

The reference is exact: with a tiny vocabulary we enumerate p(x1) p(x2 | x1) p(x3 | x1, x2) under the same logits
processors `generate` builds. Cells with expected count < 5 are pooled. Each test rejects at p < 1e-3, so a correct
sampler fails it with probability 0.1% per case (seeds are fixed, so a run is reproducible); a power check shows the
same test rejects a nearby wrong distribution (the target at temperature 1.3).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_companion, make_drafter
from helpers import TEST_STEP_COSTS, optimistic_table
from scipy.stats import chi2
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from hf_specformer import generate

VOCAB, NEW_TOKENS, SAMPLES, ALPHA = 12, 3, 30_000, 1e-3
LOOKUP_PROMPT = [token for x in range(VOCAB) for token in (5, x)] + [5]  # holds the pad id 0: pass a mask


def sharp_target(seed: int = 0):
    """Tiny Llama with a small vocabulary and a scaled head, so its distributions are far from uniform."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


def exact_joint(target, prompt: torch.LongTensor, processors) -> torch.Tensor:
    """`[V ** 3]` probabilities of every 3-token continuation, processed as `generate` processes them."""
    prefixes = prompt[None]
    joint = torch.ones(1, dtype=torch.float64)
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            logits = target(prefixes).logits[:, -1].float()
        scores = processors(prefixes, logits)
        probs = scores.softmax(-1).double()  # [n, V]
        joint = (joint[:, None] * probs).flatten()
        next_tokens = torch.arange(VOCAB).repeat(len(prefixes))[:, None]
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0), next_tokens], 1)
    return joint


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return float(chi2.sf(statistic, int(keep.sum()) - 1))


@pytest.mark.parametrize(
    "sampling, draft_vocab, prompt, seed, schedule",
    [({"temperature": 1.0}, None, [3, 7, 1, 5], 1234, "fixed"),
     ({"temperature": 0.8, "top_k": 5}, None, [3, 7, 1, 5], 1234, "fixed"),
     ({"temperature": 1.0, "top_p": 0.8}, None, [3, 7, 1, 5], 1234, "fixed"),
     ({"temperature": 1.0}, [0, 2, 3, 5, 8, 11], [3, 7, 1, 5], 7, "fixed"),
     ({"temperature": 1.0}, None, LOOKUP_PROMPT, 99, "fixed"),
     ({"temperature": 0.8, "top_k": 5}, None, LOOKUP_PROMPT, 5, "fixed"),
     ({"temperature": 1.0}, None, [3, 7, 1, 5], 31, "threshold"),
     ({"temperature": 1.0}, None, [3, 7, 1, 5], 17, "goodput"),
     ({"temperature": 0.8, "top_k": 5}, None, LOOKUP_PROMPT, 23, "goodput"),
     ({"temperature": 1.0}, None, [3, 7, 1, 5], 41, "companion"),
     ({"temperature": 1.0}, None, [3, 7, 1, 5], 43, "goodput-feedback"),
     ({"temperature": 1.0}, None, [3, 7, 1, 5], 47, "suffix"),
     ({"temperature": 1.0}, None, [3, 7, 1, 5], 53, "continuous"),
     ({"temperature": 1.0, "top_p": 0.8}, None, [3, 7, 1, 5], 59, "seeded"),
     ({"temperature": 0.8, "top_k": 5}, None, LOOKUP_PROMPT, 61, "seeded-goodput")],
    ids=["t1.0", "t0.8-topk5", "t1.0-topp0.8", "t1.0-draft-vocab", "t1.0-lookup", "t0.8-topk5-lookup",
         "t1.0-threshold", "t1.0-goodput", "t0.8-topk5-lookup-goodput",
         "t1.0-goodput-companion", "t1.0-goodput-feedback", "t1.0-suffix-goodput",
         "t1.0-continuous-goodput", "t1.0-topp0.8-seeded", "t0.8-topk5-lookup-seeded-goodput"],
)
def test_joint_of_first_three_tokens_matches_target(sampling, draft_vocab, prompt, seed, schedule):
    """`draft-vocab`: drafts come from half the vocabulary (q = 0 elsewhere); the residual covers the rest.
    `lookup`: the prompt holds "5 x" for every token x and ends with 5, so whatever token comes first, prompt
    lookup proposes one-hot drafts after it (checked). `threshold`: rows verify 1 to 3 of their drafts, by the
    drafts' cumulative probability (checked), so the token after a row's last verified draft is a bonus sample.
    `goodput`: the goodput scheduler picks how many drafts each row verifies, 0 included, and skips drafting when it
    does not pay; its signals read the sampled drafts' distributions, not their tokens (reading the tokens failed
    this test at p < 1e-5 with the companion); `companion`: goodput with
    SV's (S, A) signals from a companion; `goodput-feedback`: no step costs given, so each call runs a plain step
    first (checked), then verifies drafts and chooses from costs learnt from its own timings; `suffix`: goodput with
    suffix drafts, which each row takes from the other rows' samples, with their frequency as confidence (checked);
    `continuous`: 700 rows decoded at once, the others admitted as rows finish (checked); `seeded`: one sampling
    seed per row (Gumbel-max noise keyed by seed, position and token, verified greedily), a row's draws
    independent of the torch seed."""
    target = sharp_target()
    drafter = make_drafter(target, draft_length=4).set_draft_vocab(draft_vocab)
    prompt = torch.tensor(prompt)
    config = GenerationConfig(do_sample=True, max_new_tokens=NEW_TOKENS, pad_token_id=0, **sampling)
    processors = target._get_logits_processor(generation_config=config, input_ids_seq_length=len(prompt))
    reference = exact_joint(target, prompt, processors)

    companion = make_companion(target) if schedule == "companion" else None
    torch.manual_seed(seed)  # after make_companion, which seeds its own weights
    for model in (drafter, companion):
        if model is not None:  # the first step verifies every draft; online counts then lower the estimates
            model.config.acceptance_table = optimistic_table("sv" if model is companion else "confidence")
    speculation = {
        "fixed": dict(schedule="fixed"), "threshold": dict(schedule="fixed", confidence_threshold=0.2),
        "goodput": dict(step_costs=TEST_STEP_COSTS),
        "companion": dict(step_costs=TEST_STEP_COSTS),
        "goodput-feedback": dict(),  # no costs: learnt from the call's own timed steps
        "suffix": dict(step_costs=TEST_STEP_COSTS, suffix_index=True),
        "continuous": dict(step_costs=TEST_STEP_COSTS, max_batch_size=700),
        "seeded": dict(schedule="fixed"),
        "seeded-goodput": dict(step_costs=TEST_STEP_COSTS),
    }[schedule]
    rows, accepted, drafted = [], 0, 0
    for call in range(SAMPLES // 5000):  # batches of 5000 identical prompts (batch size > 1)
        seeds = {"sampling_seeds": list(range(5000 * call, 5000 * (call + 1)))} if "seeded" in schedule else {}
        out = generate(
            target, input_ids=prompt[None].repeat(5000, 1), attention_mask=torch.ones(5000, len(prompt)),
            assistant_model=drafter, generation_config=config, return_dict_in_generate=True, companion_model=companion,
            speculation_config={"num_draft_tokens": 3, **speculation}, **seeds,
        )
        rows.append(out.sequences[:, len(prompt):])
        stats = out.speculation_stats  # the last call's, after the loop
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
    samples = torch.cat(rows)
    codes = (samples * torch.tensor([VOCAB**2, VOCAB, 1])).sum(1)
    counts = torch.bincount(codes, minlength=VOCAB**NEW_TOKENS).double()
    # over all calls: with cost feedback a later call may verify nothing, if its learnt costs say drafts do not pay
    assert 0 < accepted < drafted, "the test needs both acceptances and rejections"
    if schedule == "threshold":
        assert 1.2 < stats.drafts_per_step < 2.8, stats.drafts_per_step
    if schedule == "goodput-feedback":  # a plain first step (what follows depends on the machine's timings)
        assert stats.width_counts[0] > 0, stats.width_counts
    if schedule == "continuous":
        assert stats.row_steps <= 700 * stats.steps, (stats.row_steps, stats.steps)
    if schedule == "suffix":
        assert stats.looked_up > 1000, "from the second step on, rows draft from the other rows' samples"
    if prompt.tolist() == LOOKUP_PROMPT:
        assert stats.looked_up >= 5000, "every row's first drafts (of the last call's 5000) must come from lookup"

    assert chi_square_p_value(counts, reference) > ALPHA
    wrong = exact_joint(target, prompt, target._get_logits_processor(
        generation_config=GenerationConfig(do_sample=True,
                                           **{**sampling, "temperature": 1.3 * sampling["temperature"]}),
        input_ids_seq_length=len(prompt),
    ))
    assert chi_square_p_value(counts, wrong) < 1e-6, "power check: the test must reject a nearby distribution"


def test_several_return_sequences_keep_each_prompts_distribution():
    """`num_return_sequences=7500` for two different prompts in one batch: rows 2i and 2i + 1 come from prompt i
    after `generate` expands them; each prompt's 15,000 samples follow its own exact joint (and the first prompt's
    samples are told apart from the second prompt's distribution, so the two are not mixed up)."""
    target = sharp_target()
    drafter = make_drafter(target, draft_length=4)
    prompts = torch.tensor([[3, 7, 1, 5], [2, 9, 4, 6]])
    config = GenerationConfig(do_sample=True, max_new_tokens=NEW_TOKENS, pad_token_id=0, num_return_sequences=7500)
    processors = target._get_logits_processor(generation_config=config, input_ids_seq_length=prompts.shape[1])
    torch.manual_seed(2024)
    outputs = [
        generate(target, input_ids=prompts, attention_mask=torch.ones_like(prompts), assistant_model=drafter,
                 generation_config=config, speculation_config={"num_draft_tokens": 3, "schedule": "fixed"},
                 return_dict_in_generate=True)
        for _ in range(2)
    ]
    stats = outputs[-1].speculation_stats
    assert 0 < stats.accepted < stats.drafted
    outputs = [output.sequences for output in outputs]
    references = [exact_joint(target, prompt, processors) for prompt in prompts]
    for index, prompt in enumerate(prompts):
        rows = torch.cat([output[index * 7500 : (index + 1) * 7500] for output in outputs])
        assert (rows[:, : prompts.shape[1]] == prompt).all()
        codes = (rows[:, prompts.shape[1]:] * torch.tensor([VOCAB**2, VOCAB, 1])).sum(1)
        counts = torch.bincount(codes, minlength=VOCAB**NEW_TOKENS).double()
        assert chi_square_p_value(counts, references[index]) > ALPHA
        assert chi_square_p_value(counts, references[1 - index]) < 1e-6
