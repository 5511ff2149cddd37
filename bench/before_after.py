"""The engine before and after a change, in one interleaved run: plain `generate`, plain `generate` under the CPU
backend, ours now, and ours at an earlier commit (run in a worker process on that commit's package).

    git worktree add /tmp/before c91b218
    python bench/before_after.py --before /tmp/before --output bench/smollm2_cpu_before_after

The earlier engine is called as its commit's API took it: before the lean rewrite (c91b218) `generate(target,
assistant_model=drafter, num_draft_tokens=3, lookup_ngram_size=4, schedule="goodput")` (its CPU products were built
into the engine); from then on as `hf-specformer bench` calls ours (under `cpu_products`).
"""

import argparse
import io
import os
import subprocess
import sys
from dataclasses import asdict
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm

from hf_specformer.apps.bench import BenchConfig, _write, bench_batch_size
from hf_specformer.data.prompts import bench_prompts
from hf_specformer.targets import (
    describe_machine,
    load_drafter,
    load_target,
    load_tokenizer,
)

WORKER = """
import contextlib, io, sys, torch
from hf_specformer import generate
from hf_specformer.targets import load_target
try:  # the engine before the lean rewrite (c91b218): CPU products built in, its own argument names
    from hf_specformer.shipped_models import load_drafter
    arguments = dict(num_draft_tokens=3, lookup_ngram_size=4, schedule="goodput")
    backend = lambda: contextlib.nullcontext()
except ImportError:  # a later commit: called as `hf-specformer bench` calls ours
    from hf_specformer import cpu_products
    from hf_specformer.targets import load_drafter
    arguments = dict(speculation_config={"schedule": "goodput"})
    backend = lambda: cpu_products(target, drafter)
target = load_target("smollm2")
drafter = load_drafter(None, target)
stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
while header := stdin.readline():
    batch, kwargs = torch.load(io.BytesIO(stdin.read(int(header))))
    with backend():
        output = generate(target, **batch, assistant_model=drafter, return_dict_in_generate=True, **arguments,
                          **kwargs)
    buffer = io.BytesIO()
    torch.save((output.sequences, output.speculation_stats.to_dict()), buffer)
    stdout.write(b"%d\\n" % buffer.tell() + buffer.getvalue())
    stdout.flush()
"""


class Worker:
    """The earlier package in a process of its own, answering one batch at a time over pipes."""

    def __init__(self, before: str, threads: int):
        env = {**os.environ, "PYTHONPATH": os.path.join(before, "src"), "OMP_NUM_THREADS": str(threads)}
        self.process = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=env, cwd=before)

    def __call__(self, batch, reference, kwargs):
        buffer = io.BytesIO()
        torch.save(({name: value for name, value in batch.items()}, kwargs), buffer)
        self.process.stdin.write(b"%d\n" % buffer.tell() + buffer.getvalue())
        self.process.stdin.flush()
        size = int(self.process.stdout.readline())
        sequences, stats = torch.load(io.BytesIO(self.process.stdout.read(size)))
        return SimpleNamespace(sequences=sequences, speculation_stats=SimpleNamespace(to_dict=lambda: stats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a worktree of the earlier commit")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--min-rows", type=int, default=16)
    parser.add_argument("--prompts", nargs="+", default=["mixed"])
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    config = BenchConfig(prompts=args.prompts, batch_sizes=args.batch_sizes, min_rows=args.min_rows,
                         output=args.output)
    target, tokenizer = load_target(config.target), load_tokenizer(config.target)
    drafter, prompts = load_drafter(None, target), bench_prompts(config.prompts)
    worker, rows = Worker(args.before, torch.get_num_threads()), []
    for batch_size in tqdm(config.batch_sizes, desc="batch sizes"):
        rows += bench_batch_size(target, tokenizer, drafter, prompts, batch_size, config,
                                 extra_calls={"before [goodput]": worker})
        for row in rows[-5:]:
            tqdm.write(f"B={batch_size} {row['call']}: {row['speedup']:.2f}x plain, "
                       f"{row.get('speedup_over_plain_cpu', 0):.2f}x plain+cpu, kappa {row.get('kappa', 1):.2f}, "
                       f"{row['mismatched_rows']} rows differ")
        # after every batch size: an interrupted run keeps what it measured
        _write({"config": {**asdict(config), **vars(args)}, "machine": describe_machine(target.device, config.dtype),
                "results": rows}, args.output, host=False)


if __name__ == "__main__":
    main()
