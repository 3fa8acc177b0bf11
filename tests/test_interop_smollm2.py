"""Interop with a real consumer: HF transformers loads quantkit's SmolLM2-135M checkpoints unchanged."""

import logging
import subprocess
import sys

import pytest
import torch

from quantkit.config import build_recipe
from quantkit.quantize import quantize_loaded

pytestmark = pytest.mark.integration
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def fake_quantized_fp32(smollm2_dir, bits):
    """quantkit's fake-quantized SmolLM2 in float32 (scales bf16, as on disk): the reference for HF."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    quantize_loaded(model, build_recipe([], {"bits": bits}), torch.bfloat16)
    return model


@pytest.mark.parametrize("bits", [4, 8])
def test_hf_transformers_loads_and_matches(smollm2_dir, tokenizer, tmp_path, bits, caplog):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    out = tmp_path / f"w{bits}"
    cli = subprocess.run([sys.executable, "-m", "quantkit", "quantize", "smollm2-135m", "--bits", str(bits),
                          "-o", str(out), "-q"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr

    hf_logging.set_verbosity_warning()
    hf_logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_logging.disable_propagation()
    complaints = [r.getMessage() for r in caplog.records if any(
        w in r.getMessage().lower() for w in ("missing", "unexpected", "not used", "newly initialized", "not initialized"))]
    assert complaints == []

    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    ref = fake_quantized_fp32(smollm2_dir, bits)
    with torch.no_grad():
        ours, theirs = ref(ids).logits, hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-3, (ours - theirs).abs().max().item()
    assert torch.equal(ours[0, -1].argmax(), theirs[0, -1].argmax())

    gen = hf.generate(ids, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
