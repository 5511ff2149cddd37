"""Resident memory of one continuous-batching call over many prompts: it stays flat as requests come and go.

    python examples/continuous_memory.py --num-prompts 1000 --batch-size 16 --max-new-tokens 32 \
        --max-prompt-tokens 128 --output bench/smollm2_cpu_continuous_memory

SmolLM2 and the shipped drafter answer `--num-prompts` prompts (the project's training prompts from `../shared/data`
of at most `--max-prompt-tokens` tokens in the chat template, else the package's, repeated up to the count) in one
`generate_batch` call with `--batch-size` slots. As each
request finishes, the process's resident memory (VmRSS) and its peak so far (VmHWM, /proc/self/status) are read.
The JSON holds both every 25 requests and the peak after the first 100 requests against the peak at the end;
the PNG plots them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hf_specformer import generate_batch
from hf_specformer.targets import load_drafter
from hf_specformer.data.prompts import chat_prompt_ids, find_shared_data, load_prompts
from hf_specformer.targets import describe_machine, load_target, load_tokenizer


def resident_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB: resident memory now and its peak so far."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM"))


def plot(samples: list[tuple[int, float, float]], path: Path) -> None:
    """Resident memory and its peak against requests finished, from (requests, rss, peak) samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    axis.plot([s[0] for s in samples], [s[1] for s in samples], label="resident (VmRSS)")
    axis.plot([s[0] for s in samples], [s[2] for s in samples], label="peak so far (VmHWM)", linestyle="--")
    axis.axvline(100, color="grey", linestyle=":")
    axis.set_xlabel("requests finished")
    axis.set_ylabel("MiB")
    axis.set_ylim(0, 1.15 * max(s[2] for s in samples))
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    target, tokenizer = load_target(), load_tokenizer()
    drafter = load_drafter(None, target)
    prompts = [ids for ids in (chat_prompt_ids(tokenizer, text)
                               for text in load_prompts(find_shared_data("distill_prompts.jsonl"),
                                                        limit=4 * args.num_prompts))
               if len(ids) <= args.max_prompt_tokens]
    prompts = (prompts * -(-args.num_prompts // len(prompts)))[: args.num_prompts]
    samples = []

    def record(index: int, output) -> None:
        samples.append((len(samples) + 1, *resident_mib()))

    start = time.perf_counter()
    outputs = generate_batch(target, prompts, assistant_model=drafter, max_batch_size=args.batch_size,
                             max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, on_output=record)
    seconds = time.perf_counter() - start
    peak_at_100 = samples[min(99, len(samples) - 1)][2]
    result = {
        "config": vars(args), "seconds": seconds,
        "tokens": sum(len(output.generated_tokens) for output in outputs),
        "peak_mib_after_100": peak_at_100, "peak_mib_at_end": samples[-1][2],
        "peak_growth": samples[-1][2] / peak_at_100 - 1,
        "samples": [{"requests": done, "rss_mib": rss, "peak_mib": peak} for done, rss, peak in samples
                    if done % 25 == 0 or done == len(samples)],
        "machine": describe_machine(),
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(f"{len(prompts)} requests in {seconds:.0f} s; peak resident memory {peak_at_100:.0f} MiB after 100, "
          f"{samples[-1][2]:.0f} MiB at the end ({100 * result['peak_growth']:+.1f}%)")

    plot(samples, output.with_suffix(".png"))


if __name__ == "__main__":
    main()
