"""The GPU visit's graph script (examples/cuda_graph_verify.py), run without the graph on the CPU."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "cuda_graph_verify.py"


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(SCRIPT.parent))  # it imports gpu_curve's target, as when run from examples/
    try:
        spec = importlib.util.spec_from_file_location("cuda_graph_verify", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_the_static_cache_forward_equals_the_engine_cache_forward(script):
    """The forward a graph would capture (every column, the unused ones masked) computes the engine's logits, and
    each call leaves its cache as it found it (the next call gives the same)."""
    target = script.peaked_target(script.TINY, "cpu", torch.float32)
    with torch.no_grad():
        inputs = script.step_inputs(target, batch_size=3, prompt_length=20, width=4, capacity=28)
        calls = script.forwards(target, inputs, capacity=28)
        engine, static = calls["eager, engine cache"](), calls["eager, static cache"]()
        torch.testing.assert_close(static, engine, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(calls["eager, static cache"](), static, rtol=0, atol=0)
        torch.testing.assert_close(calls["eager, engine cache"](), engine, rtol=0, atol=0)


def test_the_report_has_each_call_at_each_batch_size(script, tmp_path):
    report = script.main(["--tiny", "--device", "cpu", "--batch-sizes", "1", "2", "--prompt-length", "16",
                          "--repeats", "2", "--output", str(tmp_path / "graph")])
    assert [(row["batch_size"], row["call"]) for row in report["results"]] == [
        (size, call) for size in (1, 2) for call in ("eager, engine cache", "eager, static cache")]
    assert all(row["same_tokens"] and row["host_ms"] > 0 for row in report["results"])
    assert (tmp_path / "graph.json").exists() and (tmp_path / "graph.png").exists()
