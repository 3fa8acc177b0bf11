"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral), from tiny random models built with
`from_config`: the runtime's routed layer against HF, checkpoints HF loads, calibration per expert."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from conftest import make_tiny_moe, run_cli
from test_families import GEMMA_PROMPTS
from test_runtime import hf_greedy, prefill_logits, run_staggered

from quantkit.runtime.engine import EngineConfig, LLMEngine
from quantkit.runtime.sampler import SamplingParams


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """Calibration text the tiny word-level tokenizer reads as varied tokens (its real-text calibration is all <unk>,
    which would send every token to the same two experts)."""
    r = random.Random(0)
    path = tmp_path_factory.mktemp("calib") / "words.txt"
    path.write_text("\n\n".join(" ".join(f"w{r.randrange(252)}" for _ in range(80)) for _ in range(40)))
    return path


def quantize(capsys, src, out, words, *args, samples: int = 8):
    code, stdout, err = run_cli(capsys, "quantize", str(src), "-o", str(out), "--json", "--calib", str(words),
                                "--calib-samples", str(samples), "--calib-seqlen", "64", *args)
    assert code == 0, err
    return json.loads(stdout)


def test_greedy_matches_hf_under_continuous_batching(tiny_moe):
    """Tokens routed to experts per step, sequences joining while others decode: token for token HF's, float32."""
    family, path = tiny_moe
    want = hf_greedy(path, GEMMA_PROMPTS, 24)
    engine = LLMEngine(path, EngineConfig(dtype="fp32", block_size=4))
    assert run_staggered(engine, GEMMA_PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True)) == want
    sparse = [layer.moe is not None for layer in engine.model.layers]
    assert sparse == ([True, False, True] if family == "qwen3_moe" else [True, True])  # Qwen3's mlp_only_layers


@pytest.mark.parametrize("args", [["--bits", "4", "-g", "32"], ["--bits", "8"], ["--bits", "4", "-g", "32", "--method", "gptq"],
                                  ["--bits", "4", "-g", "32", "--method", "awq"]], ids=["w4", "w8", "gptq", "awq"])
def test_checkpoints_name_each_expert_load_in_hf_and_match_the_runtime(tiny_moe, words, tmp_path, capsys, args):
    """Each expert's Linears packed under the checkpoint's own names (what vLLM's MoE loaders map to their fused
    w13/w2), routers dense and in `ignore`; HF transformers loads it with nothing missing or unexpected."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from quantkit.formats.load import load_dequantized_model

    family, path = tiny_moe
    out = tmp_path / "q"
    report = quantize(capsys, path, out, words, *args)
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    w1 = {"mixtral": "w1", "qwen3_moe": "gate_proj", "qwen2_moe": "gate_proj"}[family]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert f"model.layers.0.{block}.experts.7.{w1}.weight_packed" in keys and f"model.layers.0.{block}.gate.weight" in keys
    assert not any(k.endswith("gate_up_proj") or ".gate.weight_packed" in k for k in keys)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert f"model.layers.0.{block}.gate" in config["ignore"]
    if family == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert_gate" in config["ignore"]
        assert "model.layers.0.mlp.shared_expert.down_proj.weight_packed" in keys
    if "--method" in args:  # every expert was reached by the calibration rows
        assert all(min(tokens) > 0 for tokens in report["expert_tokens"].values()), report["expert_tokens"]
    prompt = torch.tensor(GEMMA_PROMPTS[4])
    with torch.no_grad():
        want = load_dequantized_model(out)(prompt[None]).logits[0, -1].float()  # float32 (q - z) * s, as the runtime
    got = prefill_logits(LLMEngine(out, EngineConfig(dtype="fp32", kernel="reference")), prompt)
    packed = prefill_logits(LLMEngine(out, EngineConfig(dtype="fp32")), prompt)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 1e-4 * scale
    assert (packed - want).abs().max().item() < 2e-2 * scale and packed.argmax() == want.argmax()
    if "awq" not in args:  # (asymmetric: HF + compressed-tensors re-initialise packed zero points, see test_runtime)
        hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
        assert not any(info.values()), info
        with torch.no_grad():  # HF dequantizes experts in the scales' dtype (bf16): weights within 2^-8 of ours
            assert (hf.eval()(prompt[None]).logits[0, -1] - want).abs().max().item() < 3e-3 * scale


def _starve(src, dst, expert: int):
    """Copy a Qwen3-MoE checkpoint with layer 0's router rewritten so `expert` is never among a token's top 2: three
    pairs of opposite rows (u, -u), (v, -v), (w, -w) always give two non-negative logits, and its row is zero."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    name = "model.layers.0.mlp.gate.weight"
    router = tensors[name].float()
    g = torch.Generator().manual_seed(1)
    pairs = torch.randn(3, router.shape[1], generator=g)
    router[:6] = torch.stack([pairs[0], -pairs[0], pairs[1], -pairs[1], pairs[2], -pairs[2]])
    router[expert] = 0
    tensors[name] = router.to(tensors[name].dtype)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_an_expert_without_calibration_tokens_is_calibrated_on_all_and_named(tiny_moe, words, tmp_path, capsys):
    """The stated rule: an expert routed fewer than 16 calibration tokens gets its Hessian from every token of its
    layer (as if all were routed to it), and the run warns naming it; the report counts tokens per expert."""
    from quantkit.formats.load import read_tensors, unpacked_module
    from quantkit.quant.rtn import rtn

    family, path = tiny_moe
    if family != "qwen3_moe":
        pytest.skip("one family suffices: the walk is the same for all")
    src = _starve(path, tmp_path / "starved", expert=6)
    out = tmp_path / "q"
    report = quantize(capsys, src, out, words, "--bits", "4", "-g", "32", "--method", "gptq")
    tokens = report["expert_tokens"]["model.layers.0"]
    assert tokens[6] == 0 and sum(tokens) == 2 * 8 * 64
    assert any(n.startswith("model.layers.0: expert 6 received fewer than 16") for n in report["notes"]), report["notes"]
    manifest = json.loads((out / "quantkit.json").read_text())
    assert manifest["expert_tokens"]["model.layers.0"] == tokens
    # quantized with a Hessian (GPTQ's error feedback), not left dense or rounded alone
    tensors = read_tensors(out)
    from quantkit.config import Scheme

    scheme = Scheme(bits=4, group_size=32)
    q, _, _ = unpacked_module(tensors, "model.layers.0.mlp.experts.6.down_proj", scheme)
    dense = read_tensors(src)["model.layers.0.mlp.experts.6.down_proj.weight"].float()
    assert not torch.equal(q, rtn(dense, scheme, torch.bfloat16).q)


def _mean_kl(reference, model, ids) -> float:
    with torch.no_grad():
        p = torch.log_softmax(reference(ids).logits.float(), -1)
        q = torch.log_softmax(model(ids).logits.float(), -1)
    return torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1).mean().item()


def test_gptq_never_loses_to_rtn_on_the_tiny_moe(tiny_moe, words, tmp_path, capsys):
    """Same calibration rows, held-out tokens: GPTQ's mean KL against the dense model is at most RTN's. With 32 x 64
    rows each expert sees ~500 tokens; at 8 x 64 (~100, fewer than its 128 inputs) the Hessians are rank-deficient
    and GPTQ only ties RTN (Qwen3-MoE: 0.00095 both)."""
    from transformers import AutoModelForCausalLM

    from quantkit.formats.load import load_dequantized_model

    _, path = tiny_moe
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(4, 256, (4, 48), generator=torch.Generator().manual_seed(7))
    kl = {}
    for method in ("rtn", "gptq"):
        quantize(capsys, path, tmp_path / method, words, "--bits", "4", "-g", "32", "--method", method, samples=32)
        kl[method] = _mean_kl(dense, load_dequantized_model(tmp_path / method).eval(), ids)
    assert kl["gptq"] <= kl["rtn"], kl


def test_a_missing_expert_is_one_line_naming_the_tensor(tiny_moe, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    from test_cli import assert_one_line_error

    family, path = tiny_moe
    name = {"mixtral": "model.layers.1.block_sparse_moe.experts.3.w2.weight"}.get(family, "model.layers.1.mlp.experts.3.down_proj.weight")
    if family == "qwen3_moe":
        name = name.replace("layers.1", "layers.2")  # (layer 1 is dense)
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    tensors = load_file(damaged / "model.safetensors")
    del tensors[name]
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    for args in (["quantize", str(damaged), "--bits", "4", "-g", "32", "-q", "-o", str(tmp_path / "out")],
                 ["bench", "--offline", str(damaged), "--input-len", "8", "--output-len", "2"]):
        code, _, err = run_cli(capsys, *args)
        assert_one_line_error(code, err, name.removesuffix(".weight"))
    assert not (tmp_path / "out").exists()


def test_routing_follows_each_family(tmp_path):
    """Mixtral renormalises the chosen experts' probabilities, Qwen2-MoE (norm_topk_prob false) does not, Qwen3-MoE as
    its config says; the sparse layers are those HF builds with experts."""
    from transformers import AutoModelForCausalLM

    from quantkit.arch import arch_of
    from quantkit.runtime.models.llama import ModelConfig

    for family in ("qwen3_moe", "qwen2_moe", "mixtral"):
        path = make_tiny_moe(tmp_path / family, family)
        config = json.loads((path / "config.json").read_text())
        cfg = ModelConfig.from_hf(config, arch_of(config))
        hf = AutoModelForCausalLM.from_pretrained(path)
        assert cfg.sparse == [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
        assert cfg.routing.normalise == {"qwen3_moe": True, "qwen2_moe": False, "mixtral": True}[family]
        assert cfg.experts == 8 and cfg.routing.top_k == 2


def test_a_quantized_moe_serves_chat_and_evaluates(tiny_moe, words, tmp_path, capsys):
    """The serve and eval paths, unchanged: chat through the official client on a loopback port, greedy as the engine;
    `quantkit eval` against the dense baseline."""
    from conftest import Server

    family, path = tiny_moe
    if family != "qwen2_moe":
        pytest.skip("one family suffices: the paths are the family-blind runtime's")
    out = tmp_path / "q"
    quantize(capsys, path, out, words, "--bits", "4", "-g", "32", "--method", "gptq")
    server = Server(out, "--dtype", "fp32", "--kv-cache-memory", "0.05")
    try:
        reply = server.client().chat.completions.create(model="q", messages=[{"role": "user", "content": "w5 w9 w12"}],
                                                        max_tokens=8, temperature=0)
    finally:
        server.stop()
    assert reply.usage.completion_tokens == 8 and reply.choices[0].message.content
    code, stdout, err = run_cli(capsys, "eval", str(out), "--tasks", "ppl,kl", "--json", "--out", str(tmp_path / "eval"))
    assert code == 0, err
    verdicts = {r["task"]: r for r in json.loads(stdout)["summary"]}
    assert verdicts["kl"]["n"] > 0 and verdicts["kl"]["diff"] > 0  # a quantized model differs, measurably
