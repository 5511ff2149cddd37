"""Writes a prompt set of one domain that the shipped SmolLM2 drafter was not trained on: small Python coding tasks.

Used by `examples/adapt_drafter_lora.sh` to show LoRA domain adaptation of a drafter. The prompts are built from
templates (task x data type x style), deterministic, so the example repeats exactly:

    python examples/make_code_prompts.py runs/code_prompts.jsonl
"""

import itertools
import json
import random
import sys

TASKS = [
    "returns the sum of {x}", "returns the largest element of {x}", "reverses {x}", "removes duplicates from {x}",
    "counts how often each item occurs in {x}", "sorts {x} without using sorted()", "returns the average of {x}",
    "checks whether {x} is a palindrome", "returns every second element of {x}", "splits {x} into chunks of size n",
    "returns the running total of {x}", "finds the index of the smallest element of {x}",
    "returns the product of {x}", "filters the even numbers out of {x}", "merges two sorted versions of {x}",
    "rotates {x} by k positions", "flattens {x} one level deep", "returns the median of {x}",
    "checks whether {x} is sorted", "returns the second largest element of {x}",
]
DATA = ["a list of integers", "a list of floats", "a tuple of numbers", "a list of strings", "a string",
        "a list read from a text file, one item per line"]
STYLES = [
    "Write a Python function that {task}.",
    "Write a Python function that {task}. Add a docstring and one example call.",
    "In Python, implement a function that {task}, and explain it in one sentence.",
    "Show me Python code that {task}. Use type hints.",
]


def main(path: str) -> None:
    prompts = [style.format(task=task.format(x=data))
               for task, data, style in itertools.product(TASKS, DATA, STYLES)]
    random.Random(0).shuffle(prompts)
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": prompt}) + "\n" for prompt in prompts)
    print(f"{len(prompts)} prompts in {path}")


if __name__ == "__main__":
    main(sys.argv[1])
