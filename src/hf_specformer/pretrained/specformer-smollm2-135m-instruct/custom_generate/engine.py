"""The speculative decoding loop, a `generate` decoding method (`custom_generate=speculative_decode`).

Each step feeds every active row's last token and the drafts it verifies through the target in one forward, whose
hidden states feed the next step's drafts (fused, as in the SpecFormer paper): admit, then 1 choose, 2 forward,
3 verify, 4 commit, 5 propose and plan, 6 read, 7 settle. A `StepPlan` (the next drafts, on the device) and a
`StepResult` (the outcome, from the step's one host read) travel between them; docs/engine.md names the parts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass

import numpy
import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.utils import logging

from .acceptance import LOOKUP, NO_DRAFT, AcceptanceEstimator, AcceptanceTable, draft_features
from .batch import Admissions, NewRow, RaggedBatch, RowFeed
from .cache import PreallocatedCache, cache_capacity, kv_bytes_per_column
from .proposers import NoDrafts, Proposal, Proposer, TargetStep
from .scheduler import FixedSchedule, GoodputSchedule, StepClock, StepCosts, TimedStep
from .speculation import SpeculationConfig
from .stats import RowCounts, SpecStats
from .tokens import Committer, RaggedLogitsProcessor, TokenSelector, pad_token_id
from .verification import resolved_backend, verify_greedy, verify_sampling

logger = logging.get_logger(__name__)

LEARNT_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""target -> {(proposer kind, k, companion, slots): StepCosts}: a call starts where the last of its kind left off
instead of paying again for the steps that learn whether drafting pays."""

VOCABULARY_COPIES = 4
"""Vocabulary-wide tensors a step holds per verified input (logits, scores, probabilities, drafts')."""


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `speculation_stats`."""

    speculation_stats: SpecStats | None = None


@dataclass
class StepPlan:
    """The next step's inputs per active row, made right after the last forward (drafts `[B, 0]`: none proposed)."""

    last_ids: torch.LongTensor  # [B, 1] each row's last committed token, the step's first input
    draft_ids: torch.LongTensor  # [B, k] drafts (scratch after each row's prefix where a processor reads it)
    sources: torch.LongTensor  # [B, k] DRAFTER, LOOKUP or NO_DRAFT
    draft_probs: torch.Tensor | None  # [B, k, V] processed distributions of the network's drafts (for sampling)
    features: torch.Tensor | None  # [B, k, F] the estimator's signals of the drafts
    scores: torch.Tensor | None  # [B, k] what the schedule chooses from (q, or cumulative confidence); host once read
    free: torch.BoolTensor | None = None  # [B, k] drafts of a free source (LOOKUP), on the host once read
    drafted: bool = False  # the drafter's network made these drafts

    @classmethod
    def plain(cls, last_ids: torch.LongTensor) -> "StepPlan":
        none = last_ids.new_zeros(last_ids.shape[0], 0)
        return cls(last_ids, none, none, None, None, None)

    def _tensors(self) -> list:
        return [self.last_ids, self.draft_ids, self.sources, self.draft_probs, self.features, self.scores, self.free]

    def select(self, keep: list[int]) -> "StepPlan":
        """The plan of the active rows `keep` (host indices)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.last_ids.device)  # scores, free: on the host
        return StepPlan(*(None if t is None else t[index.to(t.device)] for t in self._tensors()), drafted=self.drafted)

    def join(self, other: "StepPlan") -> "StepPlan":
        """This plan's rows, then `other`'s; drafts one lacks are no drafts (scores 0)."""
        width = max(self.draft_ids.shape[1], other.draft_ids.shape[1])
        sizes = [len(self.draft_ids), len(other.draft_ids)]
        joined = [torch.cat([self.last_ids, other.last_ids])]
        for pair in zip(self._tensors()[1:], other._tensors()[1:]):
            like = next((t for t in pair if t is not None), None)
            if like is None:
                joined.append(None)
                continue
            fill = NO_DRAFT if like.dtype == torch.long else 0
            parts = [like.new_full((rows, width, *like.shape[2:]), fill) if t is None else
                     torch.cat([t, t.new_full((rows, width - t.shape[1], *t.shape[2:]), fill)], dim=1)
                     for t, rows in zip(pair, sizes)]
            joined.append(torch.cat(parts))
        return StepPlan(*joined, drafted=self.drafted or other.drafted)


@dataclass
class StepResult:
    """A step's outcome on the host, from its one device read."""

    accepted: list[int]  # [B] drafts each row accepted
    finished: list[bool]  # [B] rows that have ended
    max_length: int  # the longest row's valid cache entries
    min_length: int  # the shortest row's (all columns valid in every row: no mask needed for one input)
    scores: torch.Tensor | None  # [B, k] the next plan's scores (finished rows: 0)
    free: torch.BoolTensor | None  # [B, k] the next plan's drafts of a free source


@dataclass
class _Call:
    """What a call's steps share, fixed for the call."""

    model: torch.nn.Module
    proposer: Proposer
    schedule: FixedSchedule | GoodputSchedule
    estimator: AcceptanceEstimator | None
    companion: torch.nn.Module | None
    processor: RaggedLogitsProcessor
    selector: TokenSelector
    commit: Committer
    speculation: SpeculationConfig
    states: list  # the target's hidden states of the last forward (`record_hidden_states`)
    stats: SpecStats
    rows: RowCounts
    given_cache: DynamicCache
    slots: int
    capacity: int
    mask_shape: str  # of the step's attention mask: what the target's attention takes (`RaggedBatch.step_mask`)
    feed: RowFeed | None = None
    streamed: dict = dataclasses.field(default_factory=dict)  # call's row -> tokens the feed was told of
    reads: int = 0

    def read(self, tensor: torch.Tensor) -> list:
        """`tensor`'s values on the host (on an accelerator, a synchronisation), counted."""
        self.reads += 1
        return tensor.cpu().tolist()


@contextlib.contextmanager
def record_hidden_states(model, indices):
    """Context yielding a list (L + 1 entries) that holds the hidden states at `indices` of each forward inside it,
    numbered as `output_hidden_states=True` numbers them (0: the embeddings, L: the normed output); the others None."""
    decoder, num_layers = model.get_decoder(), model.config.get_text_config().num_hidden_layers
    if any(not 0 <= index <= num_layers for index in indices):
        raise ValueError(f"Hidden-state indices {sorted(indices)} outside 0..{num_layers} (the target's layers).")
    states = [None] * (num_layers + 1)

    def record(index: int, output) -> None:
        states[index] = output if isinstance(output, torch.Tensor) else output[0]

    handles = []
    for index in indices:
        if index == 0:
            handles.append(decoder.layers[0].register_forward_pre_hook(
                lambda m, args, kwargs: record(0, args[0] if args else kwargs["hidden_states"]), with_kwargs=True))
        else:
            module = decoder if index == num_layers else decoder.layers[index - 1]
            handles.append(module.register_forward_hook(lambda m, a, output, i=index: record(i, output)))
    try:
        yield states
    finally:
        for handle in handles:
            handle.remove()


def target_forward(model, input_ids, attention_mask, position_ids, cache, logits_to_keep: int = 0) -> torch.Tensor:
    """The target over `[B, T]` inputs on the engine's cache -> logits `[B, T or logits_to_keep, V]`."""
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                 logits_to_keep=logits_to_keep, cache=cache).logits


def _mask_shape(model) -> str:
    """The step mask a target's attention takes whole: 4D additive for `sdpa`-like and `eager`, else 2D."""
    function = ALL_MASK_ATTENTION_FUNCTIONS.get(model.config._attn_implementation)
    return "float" if function in (sdpa_mask, eager_mask) else "2d"


def _copies_key_value_heads(model) -> bool:
    """Whether the target's attention is `sdpa` on grouped key/value heads (copied per masked multi-query forward)."""
    config = model.config.get_text_config()
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return model.config._attn_implementation == "sdpa" and kv_heads < config.num_attention_heads


def slot_bytes(model, proposer: Proposer, prompt_width: int, max_new_tokens: int) -> int:
    """Most bytes one decoding row takes: its caches' columns, vocabulary-wide tensors and prefill states."""
    config = model.config.get_text_config()
    k, size = proposer.num_draft_tokens, model.dtype.itemsize
    column = kv_bytes_per_column(config, config.num_hidden_layers, model.dtype) + proposer.cache_bytes_per_column
    recorded = len(proposer.hidden_state_indices | {config.num_hidden_layers})
    return cache_capacity(prompt_width, max_new_tokens, k) * column + VOCABULARY_COPIES * (k + 1) * \
        config.vocab_size * size + recorded * prompt_width * config.hidden_size * size


def speculative_decode(model, input_ids, logits_processor, stopping_criteria, generation_config, proposer=None,
                       speculation: SpeculationConfig | None = None, companion=None, acceptance_table=None,
                       speculative_streamer=None, row_finished=None, seeds=None, **model_kwargs):
    """Batched lossless speculative decoding, called by `GenerationMixin.generate` on left-padded `input_ids` `[B, P]`
    with drafts from `proposer`; `row_finished` is called with each `FinishedRow` (a `RowFeed` keeps the call
    running). Returns `[B, P + N]` sequences, or a `SpeculativeDecoderOnlyOutput`."""
    speculation, feed = speculation or SpeculationConfig(), row_finished if isinstance(row_finished, RowFeed) else None
    if proposer is None:
        raise ValueError("Speculative decoding needs `proposer=`; use `hf_specformer.generate(assistant_model=...)`.")
    given = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if not isinstance(given, DynamicCache) or given.get_seq_length() > 0:
        raise ValueError("Speculative generation needs a fresh `DynamicCache` (static/offloaded caches not supported).")
    width, max_new = input_ids.shape[1], generation_config.max_length - input_ids.shape[1]
    if feed is not None and speculation.max_batch_size is None:
        raise ValueError("A call with a RowFeed needs speculation_config={'max_batch_size': ...}: rows keep coming.")
    rows = input_ids.shape[0] if feed is None else max(input_ids.shape[0], speculation.max_batch_size)
    slots = speculation.slots(rows, slot_bytes(model, proposer, width, max_new))
    if proposer.num_draft_tokens == 0:
        proposer, companion, speculation = NoDrafts(), None, dataclasses.replace(speculation, schedule="fixed")
    elif _copies_key_value_heads(model):
        logger.warning_once(
            "This grouped-query target uses `sdpa`, which copies every layer's key/value heads in each verification "
            "forward; load it with attn_implementation='hf_specformer_gqa_sdpa' (`hf_specformer.GQA_SDPA`, "
            "registered when hf_specformer is imported) to verify without the copies.")
    k, backend = proposer.num_draft_tokens, resolved_backend(input_ids, speculation.kernel_backend)
    speculation = dataclasses.replace(speculation, kernel_backend=backend)
    if speculation.schedule == "goodput":
        table = acceptance_table or AcceptanceTable.uncalibrated("sv" if companion is not None else "confidence", k)
        estimator = AcceptanceEstimator(table, input_ids.device)
        costs = speculation.step_costs or _learnt_costs(model, proposer, companion, slots)
        schedule = GoodputSchedule(k, costs, estimator.table.expected_accepted)
    else:
        estimator, schedule = None, FixedSchedule(k, speculation.confidence_threshold)
    num_layers = model.config.get_text_config().num_hidden_layers
    indices = proposer.hidden_state_indices | (frozenset({num_layers}) if companion is not None else frozenset())
    with record_hidden_states(model, indices) as states, torch.inference_mode():  # no autograd bookkeeping per op
        call = _Call(model, proposer, schedule, estimator, companion, RaggedLogitsProcessor(logits_processor),
                     TokenSelector(bool(generation_config.do_sample), seeds),
                     Committer(stopping_criteria, generation_config, speculative_streamer), speculation,
                     states, SpecStats(k), RowCounts(input_ids.shape[0], row_finished), given, slots,
                     cache_capacity(width, max_new, k), _mask_shape(model), feed)
        if speculative_streamer is not None:
            speculative_streamer.put(input_ids.cpu())
        batch = RaggedBatch.start(input_ids, model_kwargs.get("attention_mask"), max_new, max_new + k + 1, slots,
                                  call.capacity, pad_token_id(generation_config))
        if feed is not None:
            _set_rows(call, batch, list(range(input_ids.shape[0])), feed.initial_rows)
        _decode(call, batch, Admissions(input_ids.shape[0], slots))
    if speculative_streamer is not None:
        speculative_streamer.end()
    stats = call.stats
    stats.handoffs, stats.host_reads, stats.tokens_per_row = schedule.handoffs, call.reads, call.rows.kappa()
    sequences = batch.sequences()  # built outside inference mode: an ordinary tensor, as `generate` returns
    if generation_config.return_dict_in_generate:
        return SpeculativeDecoderOnlyOutput(sequences=sequences, speculation_stats=stats)
    return sequences


def _learnt_costs(model, proposer: Proposer, companion, slots: int) -> StepCosts:
    """The `StepCosts` this process learnt for `model` with this kind of proposer and `slots` (`LEARNT_COSTS`)."""
    key = (type(proposer).__name__, proposer.num_draft_tokens, companion is not None, slots)
    return LEARNT_COSTS.setdefault(model, {}).setdefault(key, StepCosts())


def _decode(call: _Call, batch: RaggedBatch, admissions: Admissions) -> None:
    """Admissions and steps until every row has finished."""
    model, proposer, schedule, dtype = call.model, call.proposer, call.schedule, call.model.dtype
    caches = _new_caches(call, call.capacity, call.slots)
    clock, plan = StepClock(batch.tokens.device), None
    while True:
        if call.feed is not None and not _take_rows(call, batch, admissions):
            return
        rows = admissions.due(batch.num_live)
        while rows:  # the prefill of the rows admitted (all of them at the start, unless slots are fewer)
            wants = schedule.wants(batch.num_live + len(rows))  # one answer for the step after the admission
            for group in batch.prefill_groups(rows):
                plan = _admit(call, batch, caches, group, plan, wants)
            rows = [] if batch.size else admissions.due(0)  # every row admitted ended at its first token
        if not batch.size:
            if call.feed is None:
                return
            continue
        schedule.observe(clock.read())
        clock.restart()

        # 1. Choose how many drafts each row verifies (on the host, from the plan's scores)
        counts = _choose(call, batch, plan)
        width, was_live = max(counts), [not done for done in batch.host_finished]
        num_drafts = None if min(counts) == width else torch.tensor(counts, device=batch.tokens.device)  # None: all w

        # 2. Forward each row's last committed token and the drafts it verifies through the target
        inputs = batch.positions[: width + 1]
        step_ids = torch.cat([plan.last_ids, plan.draft_ids[:, :width]], dim=1) if width else plan.last_ids  # [B, w+1]
        position_ids = batch.lengths[:, None] + inputs
        verified = width + 1 if num_drafts is None else inputs <= num_drafts[:, None]
        mask = batch.step_mask(verified, call.mask_shape if width else "2d", dtype)
        logits = target_forward(model, step_ids, mask, position_ids, caches[0])

        # 3. Verify: the accepted drafts and the target's correction or bonus token
        tokens, num_accepted = _verify(call, batch, plan, logits, num_drafts, width)
        if call.estimator is not None and plan.features is not None:
            drafts_verified = width if num_drafts is None else num_drafts
            call.estimator.observe(plan.features, plan.sources, num_accepted, drafts_verified)

        # 4. Commit: keep the accepted inputs' cache columns, append the tokens, end rows
        committed = (num_accepted + 1).masked_fill_(batch.finished, 0)  # rows that had ended keep nothing
        batch.commit_cache(committed, width + 1)
        batch.finished = call.commit(batch, tokens, committed)
        clock.lap()

        # 5. Propose and plan the next step's drafts, from this forward's hidden states
        draft, free = schedule.wants(batch.size)
        proposal = proposer.propose(batch, TargetStep(tuple(call.states), position_ids, num_accepted), caches[1:],
                                    draft, free)
        next_plan = _plan(call, batch, proposal, num_accepted, tokens.gather(1, num_accepted[:, None]))

        # 6. Read the step's outcome to the host: its one read
        result = _read(call, batch, next_plan, num_accepted, width + 1)
        _record(call, batch, plan, counts, width, was_live, result)

        # 7. Settle: report and retire finished rows, compact the caches
        step = TimedStep(batch.size, width, sum(was_live), sum(result.accepted), plan.draft_ids.shape[1] > 0, free,
                         proposal.drafted)
        plan = _settle(call, batch, caches, next_plan, result)
        clock.end(step)


def _choose(call: _Call, batch: RaggedBatch, plan: StepPlan) -> list[int]:
    """Drafts each active row verifies (0 for finished rows and without drafts)."""
    width = plan.draft_ids.shape[1]
    if not width:
        return [0] * batch.size
    if plan.scores is None:  # a fixed schedule without a threshold: all of them
        return [0 if done else width for done in batch.host_finished]
    counts = call.schedule.choose(plan.scores, batch.size, batch.num_live, plan.drafted).tolist()
    return [0 if done else min(n, width) for n, done in zip(counts, batch.host_finished)]


def _verify(call: _Call, batch: RaggedBatch, plan: StepPlan, logits, num_drafts, width: int):
    """The target's logits `[B, w + 1, V]` against the drafts -> (tokens `[B, w + 1]`, accepted drafts `[B]`):
    greedy matching, or rejection sampling against the drafts' distributions (one-hot for fixed drafts)."""
    scores = call.processor(batch, logits)
    drafts, backend = plan.draft_ids[:, :width], call.speculation.kernel_backend
    if not call.selector.rejection_sampling:
        return verify_greedy(drafts, call.selector.scores_to_verify(scores, batch), num_drafts, backend)
    q = torch.nn.functional.one_hot(drafts, scores.shape[-1]).float()
    if plan.draft_probs is not None:
        q = torch.where((plan.sources[:, :width] == LOOKUP)[..., None], q, plan.draft_probs[:, :width])
    return verify_sampling(drafts, q, scores.softmax(-1), num_drafts, kernel_backend=backend)


def _plan(call: _Call, batch: RaggedBatch, proposal: Proposal, last_accepted, last_ids) -> StepPlan:
    """A proposal -> the next step's plan after the committed `last_ids` `[B, 1]`: draft tokens and their scores."""
    if proposal.empty:
        return StepPlan.plain(last_ids)
    shape, device = (batch.size, call.proposer.num_draft_tokens), batch.tokens.device
    sources, probs, sampled = proposal.row_sources(shape, device), None, call.selector.do_sample
    if proposal.drafted:
        ids, probs = _draft_tokens(call, batch, proposal, sources)
    else:
        ids = proposal.ids
        if call.processor.reads_prefix:  # (the verify step's processors read the drafts after the prefix)
            batch.write(ids)
    features = scores = None
    if call.estimator is not None:
        companion_probs = _companion_probs(call, last_ids, last_accepted, ids) if call.companion is not None else None
        scores, features = call.estimator.estimate(probs, ids, sources, companion_probs, sampled, proposal.confidence)
    elif call.schedule.needs_scores:
        confidence = draft_features("confidence", probs, ids, sources, None, sampled, proposal.confidence)[..., 0]
        scores = confidence.masked_fill(sources == NO_DRAFT, 0).cumprod(1)
    free = None if proposal.ids is None else sources == LOOKUP
    return StepPlan(last_ids, ids, sources, probs, features, scores, free, proposal.drafted)


def _draft_tokens(call: _Call, batch: RaggedBatch, proposal: Proposal, sources):
    """The network's draft logits -> draft ids `[B, k]` and their processed probabilities `[B, k, V]` (None where
    unread); slot j is processed after drafts 1..j-1 when a processor reads the prefix."""
    fixed = sources == LOOKUP if proposal.ids is not None else None

    def select(scores, start: int) -> torch.LongTensor:
        ids = call.selector(scores, batch, offset=start)
        return ids if fixed is None else torch.where(fixed[:, start: start + ids.shape[1]],
                                                     proposal.ids[:, start: start + ids.shape[1]], ids)

    if not call.processor.reads_prefix:
        scores = call.processor(batch, proposal.logits)
        ids = select(scores, 0)
    else:
        ids, all_scores = [], []
        for j in range(proposal.logits.shape[1]):
            all_scores.append(call.processor(batch, proposal.logits[:, j: j + 1], offset=j))
            ids.append(select(all_scores[-1], j))
            batch.write(ids[-1], offset=j)
        ids, scores = torch.cat(ids, dim=1), torch.cat(all_scores, dim=1)
    needs_probs = call.selector.rejection_sampling or call.schedule.needs_scores
    return ids, scores.softmax(-1) if needs_probs else None


def _companion_probs(call: _Call, last_ids, last_accepted, draft_ids) -> torch.Tensor:
    """P_c `[B, k, V]`: the companion on the target's last hidden state at each row's last accepted input and the
    chain (committed token, d_1 .. d_{k-1})."""
    last = call.states[-1]
    states = last[torch.arange(last.shape[0], device=last.device), last_accepted]
    chain = torch.cat([last_ids, draft_ids[:, :-1]], dim=1)
    return call.companion(hidden_states=states, input_ids=chain).logits.float().softmax(-1)


def _read(call: _Call, batch: RaggedBatch, plan: StepPlan, num_accepted=None, window: int = 1) -> StepResult:
    """The step's one host read: finished rows, lengths, accepted drafts, the next plan's scores (a feed: tokens)."""
    size = batch.size
    parts = [batch.finished, batch.lengths] + ([] if num_accepted is None else [num_accepted])
    parts += [] if call.feed is None else [_last_tokens(batch, window).flatten()]
    parts += [part.flatten() for part in (plan.scores, plan.free) if part is not None]
    values = call.read(torch.cat(parts))  # cat promotes to the widest dtype
    finished, lengths = [value > 0 for value in values[:size]], [int(value) for value in values[size: 2 * size]]
    accepted = [int(value) for value in values[2 * size: 3 * size]] if num_accepted is not None else []
    if call.feed is not None:
        start = 2 * size + len(accepted)
        _tell(call, batch, [[int(v) for v in values[i: i + window + 1]]
                            for i in range(start, start + size * (window + 1), window + 1)], window)
    host, end = [], len(values)
    for part, dtype in ((plan.free, torch.bool), (plan.scores, torch.float64)):  # from the end
        start = end - (0 if part is None else part.numel())
        host.append(None if part is None else torch.tensor(values[start:end], dtype=dtype).view(part.shape))
        end = start
    free, scores = host
    if scores is not None:
        scores.mul_(torch.tensor([[not done] for done in finished], dtype=torch.float64))
    return StepResult(accepted, finished, max(lengths, default=0), min(lengths, default=0), scores, free)


def _record(call: _Call, batch: RaggedBatch, plan: StepPlan, counts, width, was_live, result: StepResult) -> None:
    call.stats.record(width, sum(counts), result.accepted, was_live)
    call.rows.record(batch.host_rows, result.accepted, was_live)
    call.stats.drafting_steps += plan.drafted
    if plan.scores is None and plan.free is None:
        return
    k = plan.draft_ids.shape[1]
    verified = slice(None) if min(counts) == k else numpy.arange(k) < numpy.array(counts)[:, None]  # [B, k]
    if plan.scores is not None:
        call.stats.predicted_accepted += float(plan.scores.numpy()[verified].sum())
    if plan.free is not None:
        call.stats.looked_up += int(plan.free.numpy()[verified].sum())


def _settle(call: _Call, batch: RaggedBatch, caches: list, plan: StepPlan, result: StepResult) -> StepPlan:
    """After a step's read: reports rows that ended, drops finished rows once the batch can shrink, compacts the
    caches when holes dominate or the next step would not fit. Returns the plan of the rows kept."""
    plan.scores, plan.free = result.scores, result.free
    batch.host_finished, batch.max_length, batch.min_length = result.finished, result.max_length, result.min_length
    batch.num_live = result.finished.count(False)
    ended = [i for i, done in enumerate(result.finished) if done and batch.host_rows[i] not in call.rows.reported]
    if ended and call.rows.callback is not None:
        rows = batch.row_ids[ended]
        table = call.read(torch.cat([batch.num_generated[rows, None], batch.tokens[rows, batch.prompt_width:]], 1))
        call.rows.report([batch.host_rows[i] for i in ended], [row[1: 1 + row[0]] for row in table])
    keep = batch.rows_to_keep()
    if keep is not None:
        plan = _select(call, batch, caches, plan, keep)
    room = call.proposer.num_draft_tokens + 1
    if batch.size and (batch.columns + room > call.capacity or
                       batch.removable_fraction() >= call.speculation.compaction_hole_fraction):
        call.proposer.flush(batch, caches[1:])
        index = batch.compaction_index()
        for cache in caches:
            cache.gather_columns(index)
        batch.compact(index)
    return plan


def _select(call: _Call, batch: RaggedBatch, caches: list, plan: StepPlan | None, keep: list[int]):
    """Keeps the active rows `keep` in the batch, the caches and the plan (the proposer's deferred work runs first)."""
    call.proposer.flush(batch, caches[1:])
    index = batch.select_rows(keep)
    for cache in caches:
        cache.batch_select_indices(index)
    return None if plan is None else plan.select(keep)


def _admit(call: _Call, batch: RaggedBatch, caches: list, rows: list[int], plan: StepPlan | None,
           wants: tuple[bool, bool]) -> StepPlan:
    """Brings `rows` into the batch: their prefill on caches of their own, their first tokens and drafts (`wants`:
    the schedule's (draft, free)); then their caches, rows and plan join the running ones."""
    if batch.num_live < batch.size:
        plan = _select(call, batch, caches, plan, batch.live_rows())
    if batch.size:
        call.proposer.flush(batch, caches[1:])
    new = batch.admission(rows)
    direct = not batch.size
    new_caches = caches if direct else _new_caches(call, new.columns)
    position_ids = new.prompt_position_ids()
    logits = target_forward(call.model, new.prompt_ids(), new.attention_mask, position_ids, new_caches[0], 1)
    new.commit_prompt()
    first = call.selector(call.processor(new, logits), new)[:, 0]
    new.finished = call.commit(new, first[:, None], torch.ones_like(first))
    last = torch.full_like(first, new.columns - 1)
    proposal = call.proposer.propose(new, TargetStep(tuple(call.states), position_ids, last), new_caches[1:], *wants)
    call.proposer.flush(new, new_caches[1:])
    new_plan = _plan(call, new, proposal, last, first[:, None])
    result = _read(call, new, new_plan)
    if not direct:
        for cache, part in zip(caches, new_caches, strict=True):
            cache.append_rows(part, call.slots)
    new_plan.scores, new_plan.free = result.scores, result.free
    plan = new_plan if plan is None else plan.join(new_plan)
    batch.join(new)
    joined = StepResult([], batch.host_finished[: batch.size - new.size] + result.finished,
                        max(batch.max_length, result.max_length),
                        min(batch.min_length, result.min_length) if batch.size > new.size else result.min_length,
                        plan.scores, plan.free)
    return _settle(call, batch, caches, plan, joined)


def _set_rows(call: _Call, batch: RaggedBatch, rows: list[int], new: list[NewRow]) -> None:
    """The call's `rows` take the requests `new`: their prompts, limits and sampling settings, counts from zero."""
    most = batch.tokens.shape[1] - batch.prompt_width - call.proposer.num_draft_tokens - 1
    if any(not 0 < r.max_new_tokens <= most or not 0 < len(r.prompt_ids) <= batch.prompt_width for r in new):
        raise ValueError(f"A row needs 1..{batch.prompt_width} prompt tokens and max_new_tokens 1..{most}.")
    batch.add_prompts(rows, [r.prompt_ids for r in new], [r.max_new_tokens for r in new])
    call.selector.set_rows(rows, [r.seed for r in new], [r.temperature for r in new], [r.top_p for r in new],
                           batch.tokens.device)
    call.rows.take(rows)
    for row, request in zip(rows, new):
        request.row, call.streamed[row] = row, 0


def _take_rows(call: _Call, batch: RaggedBatch, admissions: Admissions) -> bool:
    """Between steps: cancels rows and queues new ones from the feed; False once it has closed and nothing is left."""
    idle = not batch.num_live and not admissions.waiting
    polled = call.feed.poll(idle)
    if polled is None:
        return not idle
    new, cancelled = polled
    for row in [r.row for r in cancelled if r.row is not None and r.row not in call.rows.reported]:
        call.rows.reported.add(row)
        if row in admissions.waiting:
            admissions.waiting.remove(row)
        elif row in batch.host_rows:
            index = batch.host_rows.index(row)
            batch.finished[index], batch.host_finished[index] = True, True
            batch.num_live -= 1
    new = [request for request in new if request not in cancelled]
    if new:
        free = sorted(call.rows.reported - set(batch.host_rows))[: len(new)]
        rows = free + list(range(len(call.rows.steps), len(call.rows.steps) + len(new) - len(free)))
        _set_rows(call, batch, rows, new)
        admissions.waiting.extend(rows)
    return True


def _last_tokens(batch: RaggedBatch, window: int) -> torch.LongTensor:
    """`[B, 1 + window]`: each active row's count of generated tokens, then its last `window` tokens."""
    generated = batch.num_generated[batch.row_ids]
    columns = (batch.prompt_width + generated - window)[:, None] + batch.positions[:window]
    return torch.cat([generated[:, None], batch.tokens[batch.row_ids[:, None], columns.clamp(min=0)]], 1)


def _tell(call: _Call, batch: RaggedBatch, values: list[list[int]], window: int) -> None:
    """Tells the feed the tokens each active row committed since it last heard (`_last_tokens` on the host)."""
    rows, tokens = [], []
    for row, (count, *tail) in zip(batch.host_rows, values):
        if count > call.streamed[row] and row not in call.rows.reported:
            rows.append(row)
            tokens.append(tail[window - (count - call.streamed[row]):])
            call.streamed[row] = count
    if rows:
        call.feed.committed(rows, tokens)


def _new_caches(call: _Call, capacity: int, slots: int | None = None) -> list:
    """The target's cache and the proposer's, of `capacity` columns and `slots` rows (None: the first prefill's)."""
    num_layers = call.model.config.get_text_config().num_hidden_layers
    caches = [PreallocatedCache.like(call.given_cache, num_layers, capacity, slots)]
    if call.proposer.num_cache_layers:
        caches.append(PreallocatedCache(call.proposer.num_cache_layers, capacity, slots=slots))
    return caches
