"""Triton kernels against their PyTorch references, on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`,
set by conftest before Triton is imported) and on CUDA with the `gpu` marker: greedy verification exactly, sampling
verification from the same uniforms (and a chi-square of the kernel's own samples), the grouped RMSNorm within
rounding; and speculative generation through `HF_SPECFORMER_KERNELS=triton` equal to plain `generate`."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_drafter, make_target
from helpers import assert_same_as_generate, make_batch, noisy_oracle
from scipy.stats import chi2

from hf_specformer import generate
from hf_specformer.generation.verification import (
    EMPTY_SLOT,
    verify_greedy,
    verify_sampling,
)
from hf_specformer.kernels import KERNELS_ENV, kernel_backend, load, use_triton

pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]
SHAPES = [(1, 1, 5), (3, 2, 17), (17, 4, 96), (5, 3, 2500), (4, 0, 50)]  # (B, k, V): ragged rows, V over blocks


def _with_backend(monkeypatch, backend: str, fn):
    monkeypatch.setenv(KERNELS_ENV, backend)
    return fn()


def _greedy_case(batch, k, vocab, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, k + 1, vocab, generator=generator)
    best = vocab // 2
    scores[:, :, best] = scores.max() + 1
    scores[0, 0, best + 1] = scores[0, 0, best]  # a tie: the first index wins, as in torch.argmax
    scores[-1, -1, : vocab // 3] = float("-inf")  # processed scores (top-k) hold -inf
    drafts = torch.where(torch.rand(batch, k, generator=generator) < 0.7, best,
                         torch.randint(vocab, (batch, k), generator=generator))
    num_drafts = torch.randint(0, k + 1, (batch,), generator=generator)
    return drafts.to(device), scores.to(device), num_drafts.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-k{}-V{}".format(*s))
def test_greedy_kernel_equals_reference(monkeypatch, device, shape):
    drafts, scores, num_drafts = _greedy_case(*shape, device)
    kernel = _with_backend(monkeypatch, "triton", lambda: verify_greedy(drafts, scores, num_drafts))
    reference = _with_backend(monkeypatch, "torch", lambda: verify_greedy(drafts, scores, num_drafts))
    assert torch.equal(kernel[0], reference[0]) and torch.equal(kernel[1], reference[1])
    assert (kernel[0] == EMPTY_SLOT).any() or shape[1] == 0 or bool((kernel[1] == shape[1]).all())


def _sampling_case(batch, k, vocab, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    draft_probs = torch.rand(batch, k, vocab, generator=generator).mul(4).softmax(-1)
    target_probs = torch.rand(batch, k + 1, vocab, generator=generator).mul(4).softmax(-1)
    target_probs[0, 0] = torch.cat([draft_probs[0, 0], torch.zeros(0)]) if k else target_probs[0, 0]  # p == q
    drafts = torch.multinomial(draft_probs.flatten(0, 1), 1, generator=generator).view(batch, k) if k else \
        torch.zeros(batch, 0, dtype=torch.long)
    num_drafts = torch.randint(0, k + 1, (batch,), generator=generator)
    return [t.to(device) for t in (drafts, draft_probs, target_probs, num_drafts)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-k{}-V{}".format(*s))
def test_sampling_kernel_equals_reference_from_the_same_uniforms(monkeypatch, device, shape):
    case = _sampling_case(*shape, device)

    def run():
        return verify_sampling(*case, generator=torch.Generator(device=device).manual_seed(11))

    kernel, reference = _with_backend(monkeypatch, "triton", run), _with_backend(monkeypatch, "torch", run)
    assert torch.equal(kernel[1], reference[1])
    assert torch.equal(kernel[0], reference[0])


def test_sampling_kernel_keeps_the_target_distribution(monkeypatch):
    """2400 rows of one chain (k = 2, V = 6): the first committed token follows p_1 whatever q is (chi-square,
    p > 1e-3), and is told apart from q_1 (p < 1e-6)."""
    rows, vocab = 2400, 6
    generator = torch.Generator().manual_seed(3)
    q = torch.rand(2, vocab, generator=generator).mul(3).softmax(-1)
    p = torch.rand(3, vocab, generator=generator).mul(3).softmax(-1)
    drafts = torch.multinomial(q, rows, replacement=True, generator=generator).T  # [rows, 2], sampled from q
    monkeypatch.setenv(KERNELS_ENV, "triton")
    tokens, _ = verify_sampling(drafts, q.expand(rows, -1, -1), p.expand(rows, -1, -1), None,
                               generator=torch.Generator().manual_seed(4))
    counts = torch.bincount(tokens[:, 0], minlength=vocab).double()

    def p_value(probs):
        expected = probs.double() * rows
        return chi2.sf(float(((counts - expected) ** 2 / expected).sum()), vocab - 1)

    assert p_value(p[0]) > 1e-3 and p_value(q[0]) < 1e-6


@pytest.mark.parametrize("device, dtype", [
    *(("cpu", dtype) for dtype in (torch.float32, torch.float64)),
    # Triton 3.9's interpreter turns some float32 -> bfloat16 conversions into inf, so bfloat16 is checked on CUDA
    *(pytest.param(*case, marks=DEVICES[1].marks) for case in (("cuda", torch.float32), ("cuda", torch.bfloat16))),
])
@pytest.mark.parametrize("leading", [(3, 5), (1, 1), (0, 2)])
def test_grouped_rms_norm_kernel_equals_the_module(monkeypatch, device, dtype, leading):
    target = make_target("llama").to(device)
    norm = make_drafter(target).context_block.hooked_norm.to(device, dtype)
    with torch.no_grad():
        norm.weight.normal_()
    states = torch.randn(*leading, *norm.weight.shape, device=device, dtype=dtype)
    with torch.no_grad():
        kernel = _with_backend(monkeypatch, "triton", lambda: norm(states))
        reference = _with_backend(monkeypatch, "torch", lambda: norm(states))
    assert kernel.shape == reference.shape and kernel.dtype == reference.dtype
    tolerance = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(kernel, reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kind, batch_size, k, corrupt", [("llama", 6, 3, 0.3), ("qwen3", 4, 4, 0.0)])
def test_greedy_generation_with_triton_kernels_equals_generate(monkeypatch, kind, batch_size, k, corrupt):
    """The whole engine with the kernels: a drafter (grouped RMSNorm kernel) and a noisy oracle, ragged prompts."""
    monkeypatch.setenv(KERNELS_ENV, "triton")
    target = make_target(kind)
    input_ids, mask = make_batch(batch_size, seed=7)
    assert_same_as_generate(target, make_drafter(target), input_ids, mask, max_new_tokens=16, num_draft_tokens=k,
                            schedule="fixed")
    reference = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    oracle = noisy_oracle(reference[:, input_ids.shape[1]:], k, target.config.vocab_size, corrupt)
    assert_same_as_generate(target, oracle, input_ids, mask, max_new_tokens=16, schedule="fixed")


def test_sampled_generation_is_the_same_with_either_backend(monkeypatch):
    """Sampling draws the same uniforms under both backends, so a seeded generate gives the same rows: the kernels
    inherit the chi-square tests of the PyTorch path. The backend is passed to the call (`kernel_backend`), and the
    call's setting wins over the environment."""
    target = make_target("llama")
    drafter = make_drafter(target)
    input_ids, mask = make_batch(8, seed=2)
    monkeypatch.setenv(KERNELS_ENV, "torch")

    def run(backend):
        torch.manual_seed(5)
        return generate(target, input_ids=input_ids, attention_mask=mask, assistant_model=drafter, do_sample=True,
                        max_new_tokens=12, top_k=20, speculation_config={"num_draft_tokens": 3, "schedule": "fixed",
                                                                         "kernel_backend": backend})

    assert torch.equal(run("triton"), run("torch"))
    with pytest.raises(ValueError, match="kernel_backend='cuda-please'"):
        run("cuda-please")


def test_explicit_backend_is_used_and_the_environment_left_alone(monkeypatch):
    """`kernel_backend="triton"` runs the kernels although the environment says `torch`; and no backend writes
    `TRITON_INTERPRET` (a CPU without it is a clear error instead)."""
    monkeypatch.setenv(KERNELS_ENV, "torch")
    drafts, scores, num_drafts = _greedy_case(3, 2, 17, "cpu")
    calls = []
    kernels = load("verification")
    monkeypatch.setattr(kernels, "greedy_verification",
                        lambda *args, inner=kernels.greedy_verification: calls.append(1) or inner(*args))
    assert all(torch.equal(a, b) for a, b in zip(verify_greedy(drafts, scores, num_drafts, "triton"),
                                                verify_greedy(drafts, scores, num_drafts)))
    assert calls == [1]
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        verify_greedy(drafts, scores, num_drafts, "triton")
    assert "TRITON_INTERPRET" not in os.environ


def test_dispatcher(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "cuda-please")
    with pytest.raises(ValueError, match="auto"):
        kernel_backend()
    cpu_tensor = torch.zeros(1)
    monkeypatch.setenv(KERNELS_ENV, "auto")
    assert not use_triton(cpu_tensor)  # auto: Triton on CUDA only
    monkeypatch.setenv(KERNELS_ENV, "torch")
    assert not use_triton(cpu_tensor)
    monkeypatch.setenv(KERNELS_ENV, "triton")
    assert use_triton(cpu_tensor) and load("verification").BLOCK > 0
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        use_triton(cpu_tensor)
