"""Shared fixtures: a tiny random Llama (unit tests) and the real SmolLM2-135M (integration tests)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton: its kernels then run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the runtime's panel cache (runtime/layers/panel_cache.py) in a folder of this run, for in-process models and the
# servers the tests launch: test checkpoints never fill the user's cache
_PANELS = tempfile.mkdtemp(prefix="quantkit-panels-")
os.environ.setdefault("QUANTKIT_PANEL_CACHE", _PANELS)
atexit.register(shutil.rmtree, _PANELS, True)

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


def builtin_dir(alias: str, required_by: str) -> Path:
    """A built-in model's dense checkpoint (converted once, cached under QUANTKIT_CACHE); a missing package
    skips the test, except where the environment variable `required_by` is set (CI), where it fails."""
    from quantkit import QuantkitError
    from quantkit.models import resolve

    try:
        return resolve(alias).path
    except QuantkitError as e:
        if os.environ.get(required_by):
            raise
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct."""
    return builtin_dir("smollm2-135m", "QUANTKIT_REQUIRE_SMOLLM2")


@pytest.fixture(scope="session")
def qwen05_dir() -> Path:
    """The real Qwen2.5-Coder-0.5B-Instruct (tools in its chat template), joined from its six PyPI parts."""
    return builtin_dir("qwen2.5-coder-0.5b", "QUANTKIT_REQUIRE_QWEN")


@pytest.fixture(scope="session")
def gemma270_dir() -> Path:
    """The real Gemma 3 270M (base)."""
    return builtin_dir("gemma-3-270m", "QUANTKIT_REQUIRE_GEMMA")


def make_tiny_gemma3(path: Path, window: int = 8, seed: int = 0) -> Path:
    """A random 4-layer Gemma 3 (bf16): sliding-window layers around one full-attention layer, each kind with its own
    rope base, query_pre_attn_scalar unlike head_dim, and norms away from zero (Gemma's (1 + w) must matter)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=window, query_pre_attn_scalar=24, max_position_embeddings=256,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        tie_word_embeddings=True, pad_token_id=3, bos_token_id=1, eos_token_id=2,
    )
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)
    model.to(torch.bfloat16).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma") / "model")


def make_tiny_phi3(path: Path, window: int = 8, seed: int = 0) -> Path:
    """A random 2-layer Phi-3 (bf16): q/k/v and gate/up fused in the checkpoint, no grouped-query heads (so AWQ's
    v -> o applies to the fused qkv), half of each head rotated (as Phi-4-mini's partial rotary), every layer
    sliding-window (as Phi-3-mini-4k's config)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    config = Phi3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, max_position_embeddings=256, sliding_window=window, pad_token_id=3,
                        bos_token_id=1, eos_token_id=2,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    Phi3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> Path:
    return make_tiny_phi3(tmp_path_factory.mktemp("phi3") / "model")


def make_tiny_moe(path: Path, family: str, seed: int = 0) -> Path:
    """A random sparse model (bf16) of `family`: qwen3_moe (q/k norms, normalised top-k, layer 1 dense through
    `mlp_only_layers`), qwen2_moe (q/k/v bias, a shared expert behind a sigmoid gate, top-k not renormalised) or
    mixtral (its checkpoint's `block_sparse_moe.experts.{e}.w1/w2/w3`). 8 experts, 2 per token; the routers' weights
    are scaled up so that tokens prefer some experts over others, as trained routers do."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  num_experts_per_tok=2, tie_word_embeddings=False, pad_token_id=3, bos_token_id=1, eos_token_id=2)
    config = {
        "qwen3_moe": lambda: Qwen3MoeConfig(**common, num_hidden_layers=3, intermediate_size=256, moe_intermediate_size=64,
                                            head_dim=32, num_experts=8, norm_topk_prob=True, mlp_only_layers=[1]),
        "qwen2_moe": lambda: Qwen2MoeConfig(**common, num_hidden_layers=2, intermediate_size=256, moe_intermediate_size=64,
                                            shared_expert_intermediate_size=128, num_experts=8, norm_topk_prob=False),
        "mixtral": lambda: MixtralConfig(**common, num_hidden_layers=2, intermediate_size=64, num_local_experts=8),
    }[family]()
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    model.to(torch.bfloat16).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


@pytest.fixture(scope="session", params=MOE_FAMILIES)
def tiny_moe(request, tmp_path_factory) -> tuple[str, Path]:
    """(family, tiny sparse checkpoint) for each mixture-of-experts family."""
    return request.param, make_tiny_moe(tmp_path_factory.mktemp(request.param) / "model", request.param)


@pytest.fixture(scope="session")
def qwen05_w4(qwen05_dir, tmp_path_factory) -> Path:
    """`quantkit quantize qwen2.5-coder-0.5b --bits 4` (RTN, group 128), as a user runs it."""
    from quantkit.cli import main

    out = tmp_path_factory.mktemp("qwen") / "qwen05-w4"
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "qwen2.5-coder-0.5b", "--bits", "4", "-o", str(out), "-q"])
    assert exc.value.code == 0
    return out


def run_cli(capsys, *args):
    """Run `quantkit ARGS` in-process: (exit code, stdout, stderr)."""
    from quantkit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(args))
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return exc.value.code or 0, out, err


class Server:
    """`quantkit serve` in a subprocess on a free loopback port: the real server, as users start it."""

    def __init__(self, model: Path | str, *args: str, key: str | None = None, timeout: float = 180):
        import socket
        import subprocess
        import sys
        import time
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.key = key
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "quantkit", "serve", str(model), "--port", str(self.port), *args]
        if key:
            cmd += ["--api-key", key]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
            try:
                urllib.request.urlopen(self.base + "/health", timeout=1)
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("server did not come up") from None
                time.sleep(0.3)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.key or "none", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """Unlabelled-by-reason samples of /metrics: {name: value}."""
        import httpx

        text = httpx.get(self.base + "/metrics", headers=self.headers()).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "le=" not in line and "finished_reason" not in line:
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = float(value)
        return out

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def stop(self, timeout: float = 60) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


@pytest.fixture(scope="session")
def smollm2_w4(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2-135M at 4 bits (RTN, groups of 64): what the server tests serve."""
    from quantkit.cli import main

    out = tmp_path_factory.mktemp("w4") / "smollm2-w4"
    with pytest.raises(SystemExit) as exc:
        main(["quantize", str(smollm2_dir), "--bits", "4", "-g", "64", "-o", str(out), "-q"])
    assert exc.value.code == 0
    return out


SERVER_KEY = "test-key"


@pytest.fixture(scope="session")
def smollm2_server(smollm2_w4):
    """One server for the SmolLM2 tests: fp32 compute (so greedy output does not depend on how requests were
    batched together), a 512 MiB KV cache, an API key."""
    server = Server(smollm2_w4, "--dtype", "fp32", "--kv-cache-memory", "0.5", "--served-model-name", "smollm2-w4", key=SERVER_KEY)
    yield server
    assert server.stop() == 0
