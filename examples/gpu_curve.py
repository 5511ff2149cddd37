"""The engine's speed-up curve at realistic acceptance, for a GPU visit: plain `generate` against speculation.

The target has Qwen3-4B's shape (random weights, bfloat16, 256-token prompts). Its input embeddings are scaled up so
that each token's own embedding dominates the residual stream: with Qwen3's tied head the greedy next token is then
the current one by a wide margin, and bfloat16's rounding cannot flip an argmax between a 1-input and a 4-input
forward (with plain random weights the top two logits are often within rounding, and an oracle's continuation would
drift from the speculative output). Every layer still computes at full size, so the timings are a 4B model's.

The drafts come from a *corrupted oracle*: a random-weight SpecFormer drafter runs its forward on every drafting step
(its cost is paid, as a trained drafter's would be), then its drafts are replaced by the target's own continuation,
slot j kept with conditional probability a_j and replaced by a wrong token otherwise. The rates a_j are the shipped
drafter's live ones on MT-bench (`bench/smollm2_cpu_drafter_eval.json`, drafter alone) and constant rates giving
kappa 1.8 and 2.2 at k = 3. The goodput scheduler sees a_j as each draft's confidence (calibrated, not informative).
The shipped drafter's rates also run at fixed k on the target switched to `GQA_SDPA` (verification without copies of
the key/value heads, which `sdpa` makes for every layer's cache at each masked multi-query forward). Every
speculative output is checked against plain `generate`'s. Wall and device (CUDA events around the target's
forwards) milliseconds per forward are reported side by side: where wall exceeds device, the host sets the pace.

    PYTHONPATH=src python examples/gpu_curve.py --output bench/qwen3_4b_shape_curve_h100   # CUDA (sized for < 12 min)
    python examples/gpu_curve.py --tiny --device cpu --batch-sizes 1 4 --output /tmp/curve        # the same, on a CPU

The report (JSON, and a PNG beside it) is rewritten after every batch size: an interrupted visit keeps what it measured.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from hf_specformer import GQA_SDPA, generate
from hf_specformer.generation.acceptance import LOOKUP
from hf_specformer.generation.proposers import OracleProposer, Proposal, SpecFormerProposer, WrappingProposer
from hf_specformer.generation.scheduler import StepClock
from hf_specformer.models import SpecFormerConfig, SpecFormerForDrafting
from hf_specformer.targets import describe_machine, synchronize

QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=True)
EMBEDDING_RMS = 100.0
"""Root mean square of the scaled input embeddings: far above the random layers' contributions (about 1.6 each)."""

DRAFTER_EVAL = Path(__file__).resolve().parents[1] / "bench" / "smollm2_cpu_drafter_eval.json"


def conditional_rates(unconditional: list[float]) -> list[float]:
    """Share of row-steps accepting slot j -> probability of accepting slot j given slots 1..j-1 were."""
    previous = [1.0] + unconditional[:-1]
    return [u / p if p else 0.0 for u, p in zip(unconditional, previous)]


def constant_rate(kappa: float, k: int) -> float:
    """The a with 1 + a + a^2 + ... + a^k = kappa (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if sum(middle**j for j in range(k + 1)) < kappa else (low, middle)
    return low


def acceptance_settings(k: int) -> dict[str, list[float]]:
    live = json.loads(DRAFTER_EVAL.read_text())["groups"]["all"]["live"]["slot_acceptance"][:k]
    return {"shipped drafter (live)": conditional_rates(live), "kappa 1.8": [constant_rate(1.8, k)] * k,
            "kappa 2.2": [constant_rate(2.2, k)] * k}


class CorruptedOracle(WrappingProposer):
    """The wrapped drafter's forward, then the `continuations` `[B0, N]` as drafts, slot j kept with probability
    `rates[j]` given the earlier slots and otherwise replaced by another token. No drafts when the drafter does
    not draft (the schedule's plain steps)."""

    def __init__(self, proposer, continuations: torch.LongTensor, rates: list[float], vocab_size: int, seed: int = 0):
        super().__init__(proposer)
        self.oracle = OracleProposer(continuations, self.num_draft_tokens, vocab_size, 0)
        self.rates = torch.tensor(rates, device=continuations.device)
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device=continuations.device).manual_seed(seed)

    def propose(self, batch, step, caches, draft=True, free=True) -> Proposal:
        proposal = self.proposer.propose(batch, step, caches, draft, free)
        if not proposal.drafted:
            return Proposal()
        ids = self.oracle.draft_ids(batch)
        shape, device = ids.shape, ids.device
        kept = torch.rand(shape, generator=self.generator, device=device) < self.rates
        shift = torch.randint(1, self.vocab_size, shape, generator=self.generator, device=device)
        ids = torch.where(kept, ids, (ids + shift) % self.vocab_size)
        return Proposal(proposal.logits, ids, torch.full_like(ids, LOOKUP), self.rates.expand(shape[0], -1))


def peaked_target(shape: dict, device, dtype, seed: int = 0):
    """A random target of `shape` whose greedy next token is its current one by a wide margin (module docstring)."""
    torch.manual_seed(seed)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(Qwen3Config(**shape, bos_token_id=1, eos_token_id=2,
                                                              pad_token_id=0), dtype=dtype)
    embeddings = target.get_input_embeddings().weight
    with torch.no_grad():
        embeddings.mul_(EMBEDDING_RMS / embeddings.float().pow(2).mean().sqrt())
    return target.eval().requires_grad_(False)


class ForwardClock:
    """Device seconds inside the target's forwards: the engine's `StepClock` (CUDA events on a GPU) around each."""

    def __init__(self, target):
        self.device, self.clock = target.device, StepClock(target.device)
        self.handles = [target.register_forward_pre_hook(lambda *a: self.clock.restart()),
                        target.register_forward_hook(lambda *a: self.clock.end(None))]

    def total(self) -> tuple[float, int]:
        """(seconds, forwards) since the last call."""
        synchronize(self.device)
        forwards = self.clock.read()
        return sum(seconds[0] for _, seconds in forwards), len(forwards)

    def close(self):
        for handle in self.handles:
            handle.remove()


def measure(target, drafter, batch_size: int, prompt_length: int, new_tokens: int, rounds: int) -> list[dict]:
    """Plain `generate` and speculation (each acceptance setting, goodput and fixed k = 3) at one batch size,
    alternated `rounds` times (the order reversed each second round); medians."""
    device, vocab = target.device, target.config.vocab_size
    ids = torch.randint(3, vocab, (batch_size, prompt_length), generator=torch.Generator().manual_seed(batch_size))
    kwargs = dict(input_ids=ids.to(device), attention_mask=torch.ones_like(ids, device=device),
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    reference = target.generate(**kwargs)  # also the warm-up
    loaded, settings = target.config._attn_implementation, acceptance_settings(3)
    # the speculative warm-up, untimed: a goodput call's first verifying step would otherwise learn the verification
    # kernels' compilation as the cost of verifying and keep drafting off at this batch size (docs/log.md)
    rates = next(iter(settings.values()))
    warm_up = CorruptedOracle(SpecFormerProposer(drafter, 3), reference[:, prompt_length:], rates, vocab)
    generate(target, assistant_model=warm_up, **kwargs,
             speculation_config={"schedule": "fixed", "lookup_ngram_size": 0})
    calls = {("plain generate", "-"): (loaded, lambda: (target.generate(**kwargs), None))}  # name -> (attention, call)
    variants = [(setting, schedule, loaded) for setting in settings for schedule in ("goodput", "fixed")]
    for setting, schedule, attention in variants + [(next(iter(settings)), "fixed", GQA_SDPA)]:
        def call(rates=settings[setting], schedule=schedule):
            proposer = CorruptedOracle(SpecFormerProposer(drafter, 3), reference[:, prompt_length:], rates, vocab)
            output = generate(target, assistant_model=proposer, **kwargs, return_dict_in_generate=True,
                              speculation_config={"schedule": schedule, "lookup_ngram_size": 0})
            return output.sequences, output.speculation_stats
        calls[setting, schedule if attention == loaded else f"{schedule}, {attention}"] = (attention, call)
    clock, runs = ForwardClock(target), {name: [] for name in calls}
    try:
        for round_index in range(rounds):
            for name in (list(calls) if round_index % 2 == 0 else list(calls)[::-1]):
                attention, call = calls[name]
                target.set_attn_implementation(attention)  # outside the timed call
                synchronize(device)
                start = time.perf_counter()
                sequences, stats = call()
                synchronize(device)
                seconds = time.perf_counter() - start
                device_seconds, forwards = clock.total()
                differing = int((sequences != reference).any(1).sum()) if sequences.shape == reference.shape \
                    else batch_size
                runs[name].append((seconds, device_seconds / forwards, forwards, stats, differing))
    finally:
        clock.close()
        target.set_attn_implementation(loaded)
    plain = statistics.median(run[0] for run in runs["plain generate", "-"])
    rows = []
    for (setting, schedule), measured in runs.items():
        seconds = statistics.median(run[0] for run in measured)
        stats = measured[-1][3]
        rows.append({"call": setting, "schedule": schedule, "batch_size": batch_size, "seconds": seconds,
                     "speedup": plain / seconds, "forwards": measured[-1][2],
                     "wall_ms_per_forward": 1000 * statistics.median(run[0] / run[2] for run in measured),
                     "device_ms_per_forward": 1000 * statistics.median(run[1] for run in measured),
                     "kappa": None if stats is None else stats.tokens_per_step,
                     "mean_width": None if stats is None else stats.mean_width,
                     "rows_differing": max(run[4] for run in measured)})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for setting, schedule in dict.fromkeys((row["call"], row["schedule"]) for row in rows):
        points = [(row["batch_size"], row["speedup"]) for row in rows
                  if (row["call"], row["schedule"]) == (setting, schedule)]
        axis.plot(*zip(*points), marker="o", linestyle="-" if schedule == "goodput" else "--",
                  label=setting if schedule == "-" else f"{setting} [{schedule}]")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set(xlabel="batch size", ylabel="speed-up over plain generate", title="Qwen3-4B shape: speculation vs plain")
    save_figure(figure, axis, path)


def save_figure(figure, axis, path: Path) -> None:
    import matplotlib.pyplot as plt

    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def visit_arguments(description: str) -> argparse.ArgumentParser:
    """The options of a GPU visit's scripts: the report's stem, the device, the batch sizes, the prompts' length, and
    `--tiny` (a tiny Qwen3 in float32 instead: checks the script)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output", required=True, help="report stem: writes STEM.json and STEM.png")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen3 in float32 instead (checks the script)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = visit_arguments(__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    target = peaked_target(TINY if args.tiny else QWEN3_4B, args.device, dtype)
    drafter = SpecFormerForDrafting(SpecFormerConfig.from_target_config(target.config, draft_length=4))
    drafter = drafter.to(device=target.device, dtype=dtype).eval().bind_target(target)
    report = {"config": vars(args), "machine": describe_machine(target.device, str(dtype).removeprefix("torch.")),
              "rates": acceptance_settings(3), "results": []}
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    for batch_size in args.batch_sizes:
        rows = measure(target, drafter, batch_size, args.prompt_length, args.new_tokens, args.rounds)
        report["results"] += rows
        for row in rows:
            print(f"B={batch_size} {row['call']} [{row['schedule']}]: {row['speedup']:.2f}x, kappa "
                  f"{row['kappa'] or 1:.2f}, wall {row['wall_ms_per_forward']:.1f} / device "
                  f"{row['device_ms_per_forward']:.1f} ms per forward, {row['rows_differing']} rows differ",
                  flush=True)
        output.with_suffix(".json").write_text(json.dumps(report, indent=2, allow_nan=False))
        plot(report["results"], output.with_suffix(".png"))
    return report


if __name__ == "__main__":
    main()
