"""A LoRA-adapted target (a PEFT `PeftModel`) as the target of speculative generation: lossless, adapters active."""

from __future__ import annotations

import pytest
import torch
from conftest import make_drafter, make_target
from helpers import TEST_STEP_COSTS, make_batch

from hf_specformer import generate

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's


def lora_target(kind: str):
    """A tiny float64 target with random (not identity) LoRA adapters on its attention and MLP projections."""
    target = make_target(kind)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                             init_lora_weights=False)
    torch.manual_seed(3)
    model = peft.get_peft_model(target, config).double().eval()
    model.requires_grad_(False)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("schedule", ["fixed", "goodput"])
def test_lora_target_greedy_equals_its_own_generate(kind, schedule):
    model = lora_target(kind)
    input_ids, mask = make_batch(6, seed=4)
    kwargs = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    reference = model.generate(**kwargs)
    with model.disable_adapter():
        without_adapters = model.generate(**kwargs)
    assert not torch.equal(reference, without_adapters), "the adapters must change the output"
    drafter = make_drafter(model.get_base_model())
    output = generate(model, assistant_model=drafter, **kwargs,
                      speculation_config={"schedule": schedule, "step_costs": TEST_STEP_COSTS})
    assert torch.equal(output, reference)
