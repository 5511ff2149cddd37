"""Closed-loop load on OpenAI-compatible servers, one server at a time, alternated per concurrency: ours
(`hf-specformer serve`), ours without speculation (`--plain`), and `transformers serve --continuous-batching` on the
same SmolLM2 weights (saved once with `save_pretrained` from the GGUF load).

    python bench/serve_load.py --concurrency 1 4 16 32 --output bench/smollm2_cpu_serve
    python bench/serve_load.py --poisson-rate 1.0 --output bench/smollm2_cpu_serve_poisson   # open loop, 48 requests
    python bench/serve_load.py --soak-seconds 600 --output bench/smollm2_cpu_serve_soak   # 32 clients, ours alone
    python bench/serve_load.py --lossless --output bench/smollm2_cpu_serve_lossless   # 256 requests vs `generate`

C clients each send greedy streamed chat requests (`--prompts`: by default MT-bench first turns, or the shipped chat
set without them, interleaved with the project's passage and code prompts) one after another until the round's
requests are answered. Per server and C: output tokens/s, time to first token and time per output token after the
first (p50, p99), kappa where the server reports accepted drafts, and how many answers differ from the anchor's.
JSON + PNG.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
from openai import OpenAI

from hf_specformer.data.prompts import bench_prompts
from hf_specformer.targets import describe_machine, load_target, load_tokenizer


def save_plain_copy(model, folder: str) -> None:
    """`model`'s dequantized weights as a plain checkpoint (a GGUF-loaded model refuses `save_pretrained`)."""
    config = copy.deepcopy(model.config)
    del config.quantization_config
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(folder)


def servers(anchor_dir: str, port: int) -> dict:
    """name -> (command, the `model` its clients name)."""
    ours = [sys.executable, "-m", "hf_specformer.apps.cli", "serve", "--port", str(port), "--max-batch-size", "16",
            "--max-prompt-tokens", "2048"]
    return {"ours": (ours, "smollm2"), "ours, plain steps": (ours + ["--plain"], "smollm2"),
            "transformers serve": ([str(Path(sys.executable).parent / "transformers"), "serve", anchor_dir,
                                    "--continuous-batching", "--device", "cpu", "--dtype", "float32", "--port",
                                    str(port), "--host", "127.0.0.1", "--log-level", "warning"], anchor_dir)}


def wait_healthy(url: str, process: subprocess.Popen, seconds: float = 300) -> None:
    end = time.time() + seconds
    while time.time() < end:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer /health in {seconds} s")


def one_request(client: OpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    start, first, pieces, accepted = time.perf_counter(), None, [], None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        details = getattr(getattr(chunk, "usage", None), "completion_tokens_details", None)
        accepted = getattr(details, "accepted_prediction_tokens", accepted)
    return {"text": "".join(pieces), "start": start, "first": first or time.perf_counter(),
            "end": time.perf_counter(), "accepted": accepted}


def load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, tokenizer,
         rate: float | None = None) -> list[dict]:
    """`concurrency` closed-loop clients; with `rate`, open loop instead: each request sent at Poisson arrival times
    of `rate` per second (seeded), whatever is still running."""
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    clock, arrivals = random.Random(0), []
    for _ in prompts:
        arrivals.append((arrivals[-1] if arrivals else 0.0) + (clock.expovariate(rate) if rate else 0.0))
    start = time.perf_counter()

    def send(item):
        time.sleep(max(0.0, start + item[1] - time.perf_counter()))
        return one_request(client, model, item[0], max_tokens)

    with ThreadPoolExecutor(len(prompts) if rate else concurrency) as pool:
        answers = list(pool.map(send, zip(prompts, arrivals)))
    for answer in answers:
        answer["tokens"] = len(tokenizer(answer["text"], add_special_tokens=False).input_ids)
    return answers


def summary(answers: list[dict]) -> dict:
    def quantile(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    seconds = max(a["end"] for a in answers) - min(a["start"] for a in answers)
    ttft = [a["first"] - a["start"] for a in answers]
    tpot = [(a["end"] - a["first"]) / (a["tokens"] - 1) for a in answers if a["tokens"] > 1]
    kappas = [a["tokens"] / (a["tokens"] - a["accepted"]) for a in answers
              if a["accepted"] is not None and a["tokens"] > a["accepted"]]
    return {"requests": len(answers), "seconds": seconds, "output_tokens": sum(a["tokens"] for a in answers),
            "tokens_per_second": sum(a["tokens"] for a in answers) / seconds,
            "ttft_p50": quantile(ttft, 0.5), "ttft_p99": quantile(ttft, 0.99), "tpot_p50": quantile(tpot, 0.5),
            "tpot_p99": quantile(tpot, 0.99), "kappa": statistics.mean(kappas) if kappas else None}


def resident_mib(pid: int) -> float:
    return int(next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS"))) / 1024


def soak(url: str, pid: int, prompts: list[str], seconds: float, clients: int, max_tokens: int) -> dict:
    """`clients` closed-loop clients for `seconds`: of each ten requests one is dropped after its first chunk and one
    is bad (answered 400), the others are greedy and must equal the first answer to the same prompt. The server's
    resident memory is sampled every 10 s and compared after the warm-up."""
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    first, counts, lock, end = {}, dict.fromkeys(("good", "differing", "failed", "dropped", "bad"), 0), \
        threading.Lock(), time.time() + seconds

    def run(index: int) -> None:
        for i in itertools.count(index * 7):
            if time.time() > end:
                return
            prompt, kind = prompts[i % len(prompts)], ("dropped" if i % 10 == 3 else "bad" if i % 10 == 7 else "good")
            try:
                if kind == "bad":
                    client.chat.completions.create(model="smollm2", messages=[], max_tokens=max_tokens)
                    kind = "failed"  # a bad request answered as a good one
                else:
                    stream = client.chat.completions.create(
                        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                        temperature=0, stream=True)
                    if kind == "dropped":
                        next(iter(stream))
                        stream.close()
                    else:
                        text = "".join(c.choices[0].delta.content or "" for c in stream)
                        with lock:
                            kind = "good" if first.setdefault(prompt, text) == text else "differing"
            except openai.BadRequestError:
                pass
            except Exception:  # noqa: BLE001 (counted: any failure of a good request)
                kind = "failed"
            with lock:
                counts[kind] += 1

    memory, started = [], time.time()
    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(run, index) for index in range(clients)]
        while not all(future.done() for future in futures):
            memory.append((time.time() - started, resident_mib(pid)))
            time.sleep(10)
    settled = [mib for t, mib in memory if t >= min(120.0, seconds / 4)]  # after the warm-up (two minutes at most)
    return {"seconds": seconds, "clients": clients, **counts, "rss_mib": memory,
            "rss_after_warmup_min": min(settled), "rss_after_warmup_max": max(settled),
            "rss_growth": max(settled) / min(settled) - 1}


def lossless(url: str, prompts: list[str], tokenizer, reference: dict[str, list[int]], clients: int = 32,
             drop_every: int | None = None) -> dict:
    """256 greedy streamed requests (`prompts` at 16, 32, 48 and 64 new tokens) from `clients` clients against
    `reference`, their plain `generate` answers (64 tokens, of which an answer of n tokens is the first n); with
    `drop_every`, one request in that many is dropped after its first chunk."""
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    counts = dict.fromkeys(("identical", "differing", "failed", "dropped"), 0)

    def ask(i: int) -> str:
        prompt, length = prompts[i % len(prompts)], (16, 32, 48, 64)[i // len(prompts) % 4]
        try:
            stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=length, temperature=0, stream=True)
            if drop_every and i % drop_every == 3:
                next(iter(stream))
                stream.close()
                return "dropped"
            text = "".join(c.choices[0].delta.content or "" for c in stream)
        except Exception:  # noqa: BLE001 (counted: any failure)
            return "failed"
        return "identical" if text == tokenizer.decode(reference[prompt][:length], skip_special_tokens=True) \
            else "differing"

    started = time.time()
    with ThreadPoolExecutor(clients) as pool:
        for kind in pool.map(ask, range(256)):
            counts[kind] += 1
    return {"requests": 256, "clients": clients, "drop_every": drop_every, "seconds": time.time() - started,
            **counts}


def plain_answers(prompts: list[str], max_new_tokens: int, tokenizer) -> dict[str, list[int]]:
    """prompt -> the target's plain greedy `generate` tokens for it as a chat turn, one prompt at a time."""
    import torch

    target = load_target()
    answers = {}
    for prompt in dict.fromkeys(prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True).input_ids
        with torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False)
        answers[prompt] = out[0, ids.shape[1]:].tolist()
    return answers


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(row["server"] for row in rows):
        mine = [row for row in rows if row["server"] == name]
        left.plot([r["concurrency"] for r in mine], [r["tokens_per_second"] for r in mine], marker="o", label=name)
        right.plot([r["concurrency"] for r in mine], [1000 * r["tpot_p50"] for r in mine], marker="o", label=name)
    left.set(xlabel="concurrent clients", ylabel="output tokens/s", xscale="log", title="throughput")
    right.set(xlabel="concurrent clients", ylabel="ms per output token (p50)", xscale="log", title="latency")
    left.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=None, help="per round (default: max(8, 2 C))")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--anchor-dir", default="runs/smollm2-hf", help="SmolLM2 saved for transformers serve")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--output", required=True, help="writes OUTPUT.json and OUTPUT.png")
    parser.add_argument("--poisson-rate", type=float, default=None,
                        help="instead of --concurrency: open-loop Poisson arrivals, this many requests per second")
    parser.add_argument("--soak-seconds", type=float, default=None,
                        help="instead: ours alone at saturation this long, drops and bad requests mixed in")
    parser.add_argument("--lossless", action="store_true",
                        help="instead: ours alone, 256 requests from 32 clients (then 1 in 10 dropped) vs generate")
    parser.add_argument("--prompts", nargs="+", default=["mixed"], help="prompt sets (default: %(default)s)")
    args = parser.parse_args()
    prompts = bench_prompts(args.prompts)
    if args.soak_seconds or args.lossless:
        url = f"http://127.0.0.1:{args.port}"
        if args.lossless:
            tokenizer = load_tokenizer()
            reference = plain_answers(prompts[:64], 64, tokenizer)
        command = servers(args.anchor_dir, args.port)["ours"][0]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_healthy(url, process)
            if args.lossless:
                report = {"runs": [lossless(url, prompts[:64], tokenizer, reference, drop_every=drop)
                                   for drop in (None, 10)]}
            else:
                report = soak(url, process.pid, prompts, args.soak_seconds, 32, args.max_tokens)
        finally:
            process.terminate()
            process.wait(60)
        report = {"machine": describe_machine("cpu", "float32"), "prompts": args.prompts,
                  "max_tokens": args.max_tokens, **report}
        Path(args.output + ".json").write_text(json.dumps(report, indent=1, allow_nan=False))
        print(json.dumps({k: v for k, v in report.items() if k != "rss_mib"}))
        return
    tokenizer = load_tokenizer()
    if not (Path(args.anchor_dir) / "config.json").exists():
        save_plain_copy(load_target(), args.anchor_dir)
        tokenizer.save_pretrained(args.anchor_dir)
    url, rows, texts = f"http://127.0.0.1:{args.port}", [], {}
    for concurrency in [None] if args.poisson_rate else args.concurrency:
        count = args.requests or (48 if args.poisson_rate else max(8, 2 * concurrency))
        round_prompts = (prompts * count)[:count]
        for name, (command, model) in servers(args.anchor_dir, args.port).items():
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_healthy(url, process)
                load(url, model, round_prompts[:2], 2, 8, tokenizer)  # warm-up
                answers = load(url, model, round_prompts, concurrency, args.max_tokens, tokenizer, args.poisson_rate)
            finally:
                process.terminate()
                process.wait(60)
            texts[name, concurrency] = [a["text"] for a in answers]
            row = {"server": name, "concurrency": concurrency, "arrival_rate": args.poisson_rate, **summary(answers)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for row in rows:
        anchor = texts[("transformers serve", row["concurrency"])]
        row["answers_differing_from_anchor"] = sum(
            a != b for a, b in zip(texts[row["server"], row["concurrency"]], anchor))
    report = {"machine": describe_machine("cpu", "float32"), "max_tokens": args.max_tokens, "results": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output + ".json").write_text(json.dumps(report, indent=1, allow_nan=False))
    if not args.poisson_rate:
        plot(rows, Path(args.output + ".png"))
    print(f"wrote {args.output}.json" + ("" if args.poisson_rate else " and .png"))


if __name__ == "__main__":
    main()
