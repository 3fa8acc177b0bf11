"""Shared fixtures: a tiny random Llama (unit tests) and the real SmolLM2-135M (integration tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton: its kernels then run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def make_tokenizer():
    """A small word-level tokenizer with a chat template, so tiny checkpoints carry tokenizer files too."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(252)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return fast


def make_tiny_llama(path: Path, hidden: int = 128, intermediate: int = 256, layers: int = 2, seed: int = 0) -> Path:
    """Save a random 2-layer Llama (bf16) with a tokenizer; widths chosen per test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def odd_dir(tmp_path_factory) -> Path:
    """Widths 96 and 160: 128 divides neither, 64 does not divide 96 and 160, 32 divides both."""
    return make_tiny_llama(tmp_path_factory.mktemp("odd") / "model", hidden=96, intermediate=160)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted from the GGUF once (cached under QUANTKIT_CACHE)."""
    from quantkit import QuantkitError
    from quantkit.models import resolve

    try:
        return resolve("smollm2-135m").path
    except QuantkitError as e:
        if os.environ.get("QUANTKIT_REQUIRE_SMOLLM2"):
            raise
        pytest.skip(str(e))


def run_cli(capsys, *args):
    """Run `quantkit ARGS` in-process: (exit code, stdout, stderr)."""
    from quantkit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(args))
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return exc.value.code or 0, out, err
