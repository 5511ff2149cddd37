"""Clients of `hf-specformer serve` at once, with the `openai` package: each answer streamed, and its accepted drafts.

    hf-specformer serve &                                   # SmolLM2 + the shipped drafter on 127.0.0.1:8000
    python examples/serve_client.py [--url http://127.0.0.1:8000/v1] [--clients 4]
"""

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
             "Give three tips for a job interview.", "What does a compiler do?", "Name two uses of copper."]


def ask(client: OpenAI, question: str) -> tuple[str, int, int, float]:
    """One streamed greedy chat answer -> (text, completion tokens, accepted drafts, seconds)."""
    start, pieces, usage = time.perf_counter(), [], None
    for chunk in client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                                max_tokens=96, temperature=0, stream=True):
        pieces.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    accepted = usage.completion_tokens_details.accepted_prediction_tokens
    return "".join(pieces), usage.completion_tokens, accepted, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args()
    client = OpenAI(base_url=args.url, api_key=args.api_key)
    questions = (QUESTIONS * args.clients)[: args.clients]
    with ThreadPoolExecutor(args.clients) as pool:
        for question, (text, tokens, accepted, seconds) in zip(questions, pool.map(lambda q: ask(client, q),
                                                                                   questions)):
            print(f"{question}\n  {text.strip()[:200]!r}\n  {tokens} tokens in {seconds:.1f} s, {accepted} accepted "
                  f"drafts\n")


if __name__ == "__main__":
    main()
