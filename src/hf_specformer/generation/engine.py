"""The speculative decoding loop: prefill, then per step feed, verify, commit, draft, retire rows.

Fused as in the SpecFormer paper: each step feeds every active row's last committed token plus its drafts through
the target in one forward ([B, w + 1] inputs, w <= k chosen by the schedule, `scheduling.py`; w = 0 is a plain
decoding step); the same forward's hidden states feed the proposer, which drafts the next k tokens from each row's
last accepted position, or with the goodput schedule only when drafting is expected to pay. Under the goodput
schedule each step's drafts are scored by an `AcceptanceEstimator` (`acceptance.py`): from the drafter's own
confidence, or from a companion model's distribution at each drafted position (Speculative Verification), and
every step's outcomes update its table. No acceptance math here (`verification.py`), no ragged bookkeeping
(`batch.py`), no drafting (`drafting.py`); what a step verifies is planned in `planning.py`, tokens are committed in
`committing.py`, the target forward and its CPU speed-ups live in `forwards.py`, step costs in `profiling.py`.
The prefill is an admission (`_admit`): every row at the start, or with `max_batch_size` the first rows, the others
joining as running rows finish (`admission.py`).

`speculative_decode` has the signature of a `generate` decoding method, so `GenerationMixin.generate` prepares
inputs, the cache, logits processors and stopping criteria exactly as for plain decoding and then calls it
(`custom_generate=<callable>`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .acceptance import LOOKUP, AcceptanceTable
from .admission import Admissions, slot_bytes
from .alternatives import (
    alternative_branches,
    alternative_inputs,
    check_alternative_draft,
    move_alternatives,
    take_alternatives,
)
from .batch import RaggedBatch
from .caching import PreallocatedCache, cache_capacity
from .committing import Committer, pad_token_id
from .drafting import NoDrafts, Proposal, Proposer
from .feedback import StepClock
from .finishing import FinishedRow, FinishedRows
from .forwards import LoopLayers, target_forward
from .host import HostReads
from .planning import draft_distributions, make_estimator, make_schedule, plan_step
from .processing import RaggedLogitsProcessor
from .profiling import remember_costs, step_cost_profile
from .costs import StepCostModel
from .scheduling import GoodputSchedule, Schedule
from .seeding import TokenSelector
from .speculation import SpeculationConfig
from .stats import SpecStats
from .verification import verify_greedy, verify_sampling


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `speculation_stats` (a `SpecStats`)."""

    speculation_stats: SpecStats | None = None


def _source_states(output, index: torch.LongTensor) -> torch.Tensor:
    """The target's last hidden state `[B, d]` at input `index[b]` of each row."""
    last = output.hidden_states[-1]
    return last[torch.arange(last.shape[0], device=last.device), index]


def _companion_state(model, companion) -> frozenset[int]:
    """The index of the hidden state a companion reads (the target's last, `_source_states`), if there is one."""
    return frozenset() if companion is None else frozenset({model.config.get_text_config().num_hidden_layers})


def _caches(cache: Cache, proposer: Proposer) -> list[Cache]:
    return [cache, *proposer.caches()]


@dataclass
class _Loop:
    """What a call's steps and admissions share, fixed for the call."""

    model: torch.nn.Module
    given_cache: Cache  # transformers' cache for the call, whose layer kinds the engine's caches copy
    proposer: Proposer
    scheduler: Schedule
    processor: RaggedLogitsProcessor
    commit: Committer
    layers: LoopLayers
    companion: torch.nn.Module | None
    hidden_state_indices: frozenset[int]  # of the target's hidden states the proposer and companion read
    selector: TokenSelector
    reads: HostReads
    compaction_hole_fraction: float
    packed: bool  # the target's linear layers compute only the inputs read (`SpeculationConfig.packed_verification`)
    room: int  # cache columns a step may add: k + 1, and the alternative draft's branch
    stats: SpecStats
    finished_rows: FinishedRows


def _admit(loop: _Loop, batch: RaggedBatch, caches: list[PreallocatedCache], rows: list[int],
           prompt_mask: torch.BoolTensor, proposal: Proposal | None, source_states: torch.Tensor | None):
    """Brings `rows` (original row indices, their prompts' mask `[n, width]` on the host) into the running batch:
    finished rows leave first; the new rows' prefill runs on caches of their own (packed: the target's linear layers
    compute the real prompt tokens only, `linears.LinearSwitch.packed`, since no real token attends to padding and
    only the last column's logits are read), which commit their first tokens and propose as
    the running rows' proposal was made (drafted, not, or skipped before a plain step; by the schedule's word at the
    call's start); the proposers' deferred work runs, and the new rows' caches, batch state, proposal and source
    states `[B, d]` join the running ones'. Returns the joined (proposal, source_states)."""
    if batch.size:
        proposal, source_states = _select_rows(batch, caches, loop.proposer, proposal, source_states,
                                               batch.live_rows())
    if batch.size:
        loop.proposer.flush(batch)
    width = prompt_mask.shape[1]
    new = batch.admission(torch.tensor(rows, device=batch.tokens.device), width)
    loop.finished_rows.admit(new.size)
    cache = PreallocatedCache.like(loop.given_cache, len(caches[0].layers), width)
    proposer = loop.proposer.fork(width)
    position_ids = new.prompt_position_ids()
    with loop.layers.speedups(), loop.layers.packed(prompt_mask, loop.packed):
        output = target_forward(loop.model, new.prompt_ids(), new.attention_mask, position_ids, cache,
                                loop.hidden_state_indices, logits_to_keep=1)
    new.commit_prompt()
    first = loop.selector(loop.processor(new, output.logits[:, -1:]), new)[:, 0]
    new.finished = loop.commit(new, first[:, None], torch.ones_like(first))
    source_index = torch.full_like(first, width - 1)
    if not batch.size:
        new_proposal = _propose(loop.scheduler, proposer, loop.layers, new, output, position_ids, source_index)
    elif proposal is None:
        new_proposal = proposer.skip(new, output.hidden_states, position_ids, source_index)
    else:
        new_proposal = proposer.propose(new, output.hidden_states, position_ids, source_index, proposal.drafted)
    new_states = _source_states(output, source_index) if loop.companion is not None else None
    if proposer is not loop.proposer:
        proposer.flush(new)
    for joined, part in zip(caches, _caches(cache, proposer), strict=True):
        joined.append_rows(part)
    if batch.size and proposal is not None:
        proposal = proposal.join(new_proposal, batch.size, new.size, loop.proposer.num_draft_tokens)
    elif not batch.size:
        proposal = new_proposal
    if new_states is not None:
        source_states = new_states if source_states is None else torch.cat([source_states, new_states])
    batch.join(new)
    batch.refresh(loop.reads)
    loop.finished_rows.report(batch, loop.stats, loop.reads)
    proposal, source_states = _retire_rows(batch, caches, loop.proposer, proposal, source_states)
    _maybe_compact(batch, caches, loop.proposer, loop.compaction_hole_fraction, loop.room)
    return proposal, source_states


def _retire_rows(batch: RaggedBatch, caches: list[Cache], proposer: Proposer, proposal: Proposal | None,
                 source_states: torch.Tensor | None) -> tuple[Proposal | None, torch.Tensor | None]:
    """Drops finished rows from the batch, the caches and the proposer's deferred work once that brings the batch
    down to a smaller `padded_batch_size` (`RaggedBatch.rows_to_keep`); returns the proposal and the source states
    `[B, d]` (None stays None) for the rows kept."""
    keep = batch.rows_to_keep()
    if keep is None:
        return proposal, source_states
    return _select_rows(batch, caches, proposer, proposal, source_states, keep)


def _select_rows(batch: RaggedBatch, caches: list[Cache], proposer: Proposer, proposal: Proposal | None,
                 source_states: torch.Tensor | None, keep: torch.LongTensor):
    """Keeps the active rows `keep` (`[B']`) in the batch, the caches, the proposer, the proposal and the source
    states; returns the last two."""
    batch.select_rows(keep)
    proposer.select_rows(keep)
    for cache in caches:
        cache.batch_select_indices(keep)
    return (None if proposal is None else proposal.select_rows(keep),
            None if source_states is None else source_states[keep])


def _maybe_compact(batch: RaggedBatch, caches: list[PreallocatedCache], proposer: Proposer, hole_fraction: float,
                   room: int) -> None:
    """Gathers each row's valid cache columns to the left once the columns it would remove (holes that every row
    has, `RaggedBatch.removable_fraction`) reach `hole_fraction` of the columns, or when the next step's `room`
    columns would not fit. The proposer runs its deferred work first, so its cache has the target's columns."""
    if not batch.size:
        return
    full = batch.attention_mask.shape[1] + room > caches[0].capacity
    if full or batch.removable_fraction() >= hole_fraction:
        proposer.flush(batch)
        index = batch.compaction_index()
        for cache in caches:
            cache.gather_columns(index)
        batch.compact(index)


def speculative_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    proposer: Proposer | None = None,
    speculative_streamer=None,
    speculation: SpeculationConfig | None = None,
    companion=None,
    acceptance_table: dict | AcceptanceTable | None = None,
    row_finished: Callable[[FinishedRow], None] | None = None,
    seeds: torch.LongTensor | None = None,
    **model_kwargs,
):
    """Batched lossless speculative decoding; a `generate` decoding method (see the module docstring).

    Args:
        model: the target causal LM.
        input_ids: `[B, P]` left-padded prompts (already expanded for `num_return_sequences`).
        logits_processor, stopping_criteria, generation_config: as prepared by `generate`.
        proposer: where drafts come from (`SpecFormerProposer`, `OracleProposer`, ...).
        speculative_streamer: a streamer (batch size 1 only); the prompt is put first.
        speculation: how to speculate (`SpeculationConfig`; default: its defaults).
        companion: a bound `CompanionForVerification` (or any module called as `companion(hidden_states=[B, d],
            input_ids=[B, k])` returning `.logits` `[B, k, V]`): the goodput scheduler's signal becomes SV's (S, A).
        acceptance_table: the estimator's calibrated table (`AcceptanceTable` or its dict); default uncalibrated.
        row_finished: called with a `FinishedRow` (its index, tokens, steps, accepted drafts) as each row ends
            (`finishing.py`; on transformers' own loop, for every row at the end).
        seeds: `[B]` one sampling seed per row: each row's text depends only on its seed (`seeding.py`); the call
            then never hands over to transformers' own loop, which knows no per-row seeds.
        model_kwargs: `attention_mask` (`[B, P]` or None for no padding) and the cache (a `DynamicCache`, as `cache`
            or, before transformers 5.24, `past_key_values`).
    Returns:
        `[B, P + N]` sequences padded with `pad_token_id` after each row's end, or a `SpeculativeDecoderOnlyOutput`
        when `generation_config.return_dict_in_generate`. The loop's layers are switched for the call
        (`forwards.LoopLayers`: few-row products and grouped-query attention on a CPU target unless
        `speculation.cpu_speedups` is False, packed verification) and restored after it, also on exceptions.
    """
    speculation = speculation or SpeculationConfig()
    if proposer is None:
        raise ValueError("Speculative decoding needs `proposer=`; use `hf_specformer.generate(assistant_model=...)`.")
    if companion is not None and speculation.schedule != "goodput":
        raise ValueError("A companion model only serves the goodput scheduler (schedule='goodput').")
    max_new_tokens = generation_config.max_length - input_ids.shape[1]
    slots = speculation.slots(input_ids.shape[0], slot_bytes(model, proposer, input_ids.shape[1], max_new_tokens))
    speculation = dataclasses.replace(speculation, max_batch_size=slots, memory_budget=None)  # budget -> slots, once
    continuous = slots < input_ids.shape[0]  # transformers' loop would decode every row at once
    own_loop = not continuous and seeds is None  # transformers' loop may serve the call
    if proposer.num_draft_tokens == 0 and own_loop:
        return _plain_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, proposer,
                             LoopLayers(model, [model], speculation.cpu_speedups), speculative_streamer, row_finished,
                             speculation.packed_verification, model_kwargs)
    if proposer.num_draft_tokens == 0:  # plain steps in the engine (continuous batching, or seeded rows)
        proposer, companion = NoDrafts(), None
        speculation = dataclasses.replace(speculation, schedule="fixed")
    modules = [model, *proposer.modules(), *([companion] if companion is not None else [])]
    layers = LoopLayers(model, modules, speculation.cpu_speedups)
    estimator = make_estimator(acceptance_table, companion, proposer.num_draft_tokens, input_ids.device) \
        if speculation.schedule == "goodput" else None
    expected = estimator.table.expected_accepted if estimator is not None else None
    profile = step_cost_profile(model, proposer, layers.cpu_speedups, slots, speculation.step_costs)
    scheduler = make_schedule(speculation, proposer.num_draft_tokens, profile, expected)
    if own_loop and not scheduler.speculation_pays(slots):
        return _plain_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, proposer,
                             layers, speculative_streamer, row_finished, speculation.packed_verification,
                             model_kwargs)
    with layers.installed():
        output = _decode(
            model, input_ids, logits_processor, stopping_criteria, generation_config, proposer, speculative_streamer,
            speculation, scheduler, estimator, companion, layers, profile, row_finished, seeds, model_kwargs,
        )
    # A call with the alternative draft learns the costs of steps that fed more inputs than their widths say.
    if speculation.step_costs is None and not speculation.alternative_draft:
        remember_costs(scheduler, model, proposer, layers.cpu_speedups, slots)
    return output


def _plain_decode(
    model, input_ids, logits_processor, stopping_criteria, generation_config, proposer, layers, streamer,
    row_finished, packed, model_kwargs,
):
    """transformers' own decoding loop (`GenerationMixin._sample`) with `layers`' CPU speed-ups on, as the engine's
    plain (width-0) steps run: what a call runs with k = 0, or when the goodput scheduler predicts that no width pays
    at its batch size. With `packed`, the prefill's linear layers compute the real prompt tokens only, as the
    engine's admissions do (inputs shaped like the prompt `[B, P]`; the one-token steps after it are not). On the CPU
    testbed the few-row products make each step of this loop 10-40% cheaper than plain `generate`'s at B = 4..32
    (README, How it works); elsewhere, or with `cpu_speedups=False` and `packed=False`, it is plain `generate`'s
    computation."""
    stats = proposer.stats = SpecStats(num_draft_tokens=proposer.num_draft_tokens, plain_decoding=True)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    model_kwargs = _preallocated(model, model_kwargs, generation_config.max_length)
    mask = model_kwargs.get("attention_mask")
    packing = layers.packed(mask.bool().cpu()) if packed and mask is not None else contextlib.nullcontext()  # a read
    with layers.installed(), layers.speedups(), packing:
        output = GenerationMixin._sample(
            model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer, **model_kwargs
        )
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    stats.steps = stats.width_counts[0] = sequences.shape[1] - input_ids.shape[1]
    stats.row_steps = stats.steps * input_ids.shape[0]
    FinishedRows(row_finished).report_padded(sequences[:, input_ids.shape[1]:], generation_config.eos_token_id,
                                             pad_token_id(generation_config))
    if generation_config.return_dict_in_generate:
        return SpeculativeDecoderOnlyOutput(sequences=sequences, speculation_stats=stats)
    return sequences


def _preallocated(model, model_kwargs: dict, max_length: int) -> dict:
    """`model_kwargs` with a fresh `DynamicCache` replaced by a `PreallocatedCache` of `max_length` columns (the
    prompt and every new token), so that transformers' loop writes each step's columns in place rather than
    concatenating every layer's cache (plain steps at B = 8 on the CPU testbed: README, How it works). Any other
    cache is kept."""
    key = "cache" if "cache" in model_kwargs else "past_key_values"  # transformers >= 5.24: "cache"
    given = model_kwargs.get(key)
    if type(given) is not DynamicCache or given.get_seq_length() > 0:
        return model_kwargs
    layers = model.config.get_text_config().num_hidden_layers
    return {**model_kwargs, key: PreallocatedCache.like(given, layers, max_length)}


def _decode(
    model, input_ids, logits_processor, stopping_criteria, generation_config, proposer, speculative_streamer,
    speculation, scheduler, estimator, companion, layers, profile, row_finished, seeds, model_kwargs,
):
    """The body of `speculative_decode`: prefill, then verification steps until every row has finished. Every step
    runs with the CPU speed-ups; a step that verifies nothing feeds one input per row and the proposer defers its
    work, so it costs what a step of `_plain_decode` does; every step is timed for the schedule (`feedback.py`)."""
    given = model_kwargs.get("cache", model_kwargs.get("past_key_values"))  # transformers >= 5.24: "cache"
    if not isinstance(given, DynamicCache) or given.get_seq_length() > 0:
        raise ValueError("Speculative generation needs a fresh `DynamicCache` (static/offloaded caches not supported).")
    selector = TokenSelector(bool(generation_config.do_sample), seeds)
    processor = RaggedLogitsProcessor(logits_processor)
    if speculation.alternative_draft:
        check_alternative_draft(model, processor, selector.do_sample)
    k = proposer.num_draft_tokens
    room = k + 1 + speculation.num_alternatives * min(int(speculation.alternative_draft), k)
    max_new_tokens = generation_config.max_length - input_ids.shape[1]
    capacity = cache_capacity(input_ids.shape[1], max_new_tokens, k)
    mask = model_kwargs.get("attention_mask")
    admissions = Admissions(
        [input_ids.shape[1]] * input_ids.shape[0] if mask is None else mask.sum(-1).tolist(),  # one host read
        speculation.max_batch_size,  # the call's slots, resolved by `speculative_decode`
    )
    cache = PreallocatedCache.like(given, model.config.get_text_config().num_hidden_layers, capacity)
    batch = RaggedBatch.start(input_ids, mask, max_new_tokens + k + 1, pad_token_id(generation_config))
    stats = proposer.stats = SpecStats(num_draft_tokens=k)
    loop = _Loop(model, given, proposer, scheduler, processor,
                 Committer(stopping_criteria, generation_config, max_new_tokens, speculative_streamer), layers,
                 companion, proposer.hidden_state_indices | _companion_state(model, companion), selector, HostReads(),
                 speculation.compaction_hole_fraction, speculation.packed_verification, room, stats,
                 FinishedRows(row_finished))
    proposer.start(capacity)
    caches = _caches(cache, proposer)
    clock = StepClock(input_ids.device)
    commit, reads, hidden_state_indices = loop.commit, loop.reads, loop.hidden_state_indices
    if speculative_streamer is not None:
        speculative_streamer.put(input_ids.cpu())

    proposal = source_states = None
    while True:
        rows = admissions.due(batch.num_live)
        while rows:  # the prefill of the rows admitted (all of them at the start, unless slots are fewer)
            proposal, source_states = _admit(loop, batch, caches, rows, admissions.prompt_mask(rows), proposal,
                                             source_states)
            rows = [] if batch.size else admissions.due(0)  # every row admitted finished at its first token
        if batch.size == 0:
            break
        _observe(clock, scheduler, stats, profile)
        proposed = proposal is not None  # False: a plain step by the schedule's word (nothing proposed)
        stats.drafting_steps += proposed and proposal.drafted
        last_committed = batch.tokens[batch.row_ids, batch.prefix_lengths() - 1]
        draft_ids, sources, draft_probs, counts, predicted = plan_step(
            batch, processor, proposal, selector, scheduler, estimator, companion, source_states, last_committed, reads
        )
        if proposed and proposal.ids is not None:
            stats.record_lookups(sources == LOOKUP, input_ids.shape[0])
        width = max(counts.tolist())  # drafts fed per row this step (counts are on the host)
        num_drafts = counts.to(last_committed.device, non_blocking=True).masked_fill(batch.finished, 0)
        scheduler.stepped(proposed)
        step_ids, attention_mask, position_ids, verified, branches = _step_inputs(
            model, batch, speculation, proposal, draft_ids, last_committed, counts, width)
        num_inputs = step_ids.shape[1]
        with layers.speedups(), layers.packed(verified, speculation.packed_verification):
            output = target_forward(
                model, step_ids, attention_mask, position_ids, cache, hidden_state_indices, logits_to_keep=0
            )
        draft_ids = draft_ids[:, :width]
        tokens, num_accepted = _verify_drafts(selector, processor, batch, output.logits[:, : width + 1], draft_ids,
                                              sources, draft_probs, num_drafts, speculation.kernel_backend)
        if estimator is not None and predicted is not None:
            estimator.observe(num_accepted, num_drafts)
        if branches is not None:
            tokens, num_accepted = _take_alternatives(processor, batch, cache, output, tokens, num_accepted, branches,
                                                      num_drafts, width)
        live = ~batch.finished
        stats.record(batch.row_ids, num_accepted, input_ids.shape[0], num_drafts, predicted, live)
        batch.commit_cache((num_accepted + 1) * live, num_inputs)
        batch.finished = commit(batch, tokens, num_accepted + 1)
        step_size = batch.size
        clock.mark()
        proposal = _propose(scheduler, proposer, layers, batch, output, position_ids, num_accepted)
        source_states = _source_states(output, num_accepted) if companion is not None else None
        step_counts = batch.refresh(reads, num_drafts.sum(), num_accepted.sum(), live.sum())
        loop.finished_rows.report(batch, stats, reads)
        proposal, source_states = _retire_rows(batch, caches, proposer, proposal, source_states)
        _maybe_compact(batch, caches, proposer, speculation.compaction_hole_fraction, room)
        clock.lap(("step", step_size, width, step_counts, proposed, None if proposal is None else proposal.drafted))

    _observe(clock, scheduler, stats, profile)
    stats.handoffs = scheduler.handoff.handoffs if isinstance(scheduler, GoodputSchedule) else 0
    stats.host_reads = reads.count
    stats.finish()
    if speculative_streamer is not None:
        speculative_streamer.end()
    sequences = batch.sequences()
    if generation_config.return_dict_in_generate:
        return SpeculativeDecoderOnlyOutput(sequences=sequences, speculation_stats=stats)
    return sequences


def _step_inputs(model, batch: RaggedBatch, speculation: SpeculationConfig, proposal: Proposal | None,
                 draft_ids: torch.LongTensor, last_committed: torch.LongTensor, counts: torch.LongTensor, width: int):
    """A step's target inputs: each row's last committed token and its first `width` drafts (`draft_ids` `[B, >= w]`,
    `counts` `[B]` on the host: the drafts each row verifies), then, with the alternative draft, slot 1's next-best
    tokens and the drafts after them as branches of their own (`alternative_inputs`) -> (ids `[B, T]`, attention
    mask, positions `[B, T]`, verified `[B, T]` on the host, branches `[B, c, m]` or None)."""
    branch_length = min(int(speculation.alternative_draft), width)
    branches = (alternative_branches(proposal.logits, draft_ids, branch_length, speculation.num_alternatives)
                if branch_length and proposal.drafted else None)
    step_ids = torch.cat([last_committed[:, None], draft_ids[:, :width]], dim=1)  # [B, width + 1]
    num_inputs = width + 1 + (0 if branches is None else branches[0].numel())
    attention_mask, position_ids = batch.step_inputs(num_inputs)
    verified = torch.arange(width + 1) <= counts[:, None]  # [B, width + 1], on the host
    if branches is None:
        return step_ids, attention_mask, position_ids, verified, None
    return *alternative_inputs(step_ids, attention_mask, position_ids, verified, branches, model.dtype), branches


def _verify_drafts(selector: TokenSelector, processor: RaggedLogitsProcessor, batch: RaggedBatch,
                   logits: torch.Tensor, draft_ids: torch.LongTensor, sources: torch.LongTensor,
                   draft_probs: torch.Tensor | None, num_drafts: torch.LongTensor, kernel_backend: str | None):
    """The target's logits at each row's committed token and drafts `[B, w + 1, V]` against its drafts `[B, w]` ->
    (tokens `[B, w + 1]`, accepted drafts `[B]`): greedy matching, or rejection sampling against the draft
    distributions (`draft_distributions`: the drafter's, one-hot for fixed drafts)."""
    target_scores = processor(batch, logits)  # drafts in the scratch
    if not selector.rejection_sampling:
        return verify_greedy(draft_ids, selector.scores_to_verify(target_scores, batch), num_drafts, kernel_backend)
    target_probs = target_scores.softmax(-1)
    q = draft_distributions(draft_ids, sources, draft_probs, target_probs.shape[-1])
    return verify_sampling(draft_ids, q, target_probs, num_drafts, kernel_backend=kernel_backend)


def _take_alternatives(processor: RaggedLogitsProcessor, batch: RaggedBatch, cache: PreallocatedCache, output,
                       tokens: torch.LongTensor, num_accepted: torch.LongTensor, branches: torch.LongTensor,
                       num_drafts: torch.LongTensor, width: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The chain's verification (tokens `[B, w + 1]`, num_accepted `[B]`) with the branches `[B, c, m]` verified
    after it (`take_alternatives`); a row that takes a branch has its cache columns and the step's hidden states
    (`output.hidden_states`, replaced) moved to the chain's places."""
    branch_predictions = processor(batch, output.logits[:, width + 1:], offset=1).argmax(-1)
    tokens, num_accepted, taken, choice = take_alternatives(
        tokens, num_accepted, branches, branch_predictions.view(branches.shape), num_drafts)
    output["hidden_states"] = move_alternatives(cache, output.hidden_states, taken, choice, width + 1,
                                                output.logits.shape[1], branches.shape[2])
    return tokens, num_accepted


def _propose(scheduler: Schedule, proposer: Proposer, layers: LoopLayers, batch: RaggedBatch, output, position_ids,
             source_index) -> Proposal | None:
    """The proposer's work after a target forward, as the schedule wants it for the next step: its proposal (the
    network drafting or not, `should_draft`), or None when the next step is plain (nothing proposed, `skip`)."""
    if scheduler.plain_step_due():
        proposer.skip(batch, output.hidden_states, position_ids, source_index)
        return None
    drafting = scheduler.should_draft(batch.size)  # rows finishing now included: a cost estimate, not worth a sync
    with layers.speedups() if drafting else contextlib.nullcontext():
        return proposer.propose(batch, output.hidden_states, position_ids, source_index, draft=drafting)


def _observe(clock: StepClock, scheduler: Schedule, stats: SpecStats, profile: StepCostModel | None) -> None:
    """Hands the steps timed so far to the schedule and the statistics; the clock then times the next step."""
    steps = clock.read()
    scheduler.observe(steps)
    stats.record_seconds(steps, profile)
    clock.restart()
