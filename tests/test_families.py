"""Model families beyond Llama, each from its entry in quantkit/arch.py: Gemma 3 (tiny random and real weights) and
Phi-3 (tiny random)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli
from test_calibrated import calib_file  # noqa: F401  (the fixture: word sequences the tiny tokenizer knows)
from test_runtime import hf_greedy, prefill_logits, run_staggered

from quantkit.runtime.engine import EngineConfig, LLMEngine
from quantkit.runtime.sampler import SamplingParams

# prompts and outputs longer than the tiny model's 8-token window, so sliding layers forget and full ones do not
GEMMA_PROMPTS = [[1] + [(5 * i + j) % 250 + 4 for j in range(n)] for i, n in enumerate([3, 12, 20, 7, 30, 16])]


FAMILIES = ["gemma3", "phi3"]
WINDOWS = {"gemma3": [8, 8, 0, 8], "phi3": [8, 8]}


@pytest.fixture(params=FAMILIES)
def family(request):
    """(name, tiny checkpoint directory) of each family beyond Llama."""
    return request.param, request.getfixturevalue({"gemma3": "tiny_gemma_dir", "phi3": "tiny_phi3_dir"}[request.param])


def test_greedy_matches_hf_under_continuous_batching(family):
    """Sliding-window layers keep each sequence's last tokens in a ring that the sequences outgrow here (prompts
    chunked to the window, the ring overwritten as they decode); under a small budget, sequences wait for a ring."""
    name, path = family
    want = hf_greedy(path, GEMMA_PROMPTS, 24)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = LLMEngine(path, EngineConfig(dtype="fp32", block_size=4))
    assert run_staggered(engine, GEMMA_PROMPTS, params) == want
    assert [layer.window for layer in engine.model.layers] == WINDOWS[name]
    assert engine.ring.size * 4 < max(map(len, GEMMA_PROMPTS)) + 24  # outgrown
    windowed = [i for i, w in enumerate(WINDOWS[name]) if w]
    assert all(engine.cache.k[i].shape[0] == engine.rings * engine.ring.size for i in windowed)
    assert engine.blocks.num_used == 0 and len(engine.blocks.free_rings) == engine.rings

    ring_seq = engine.ring.size * len(windowed) * engine.cache.spec.layer_block_bytes
    small = LLMEngine(path, EngineConfig(dtype="fp32", block_size=4, kv_cache_memory=4 * ring_seq))
    assert small.rings < len(GEMMA_PROMPTS)  # rings for fewer sequences than arrive: the others wait for one
    assert run_staggered(small, GEMMA_PROMPTS, params) == want


@pytest.mark.parametrize("args", [["--bits", "4", "-g", "32"], ["--bits", "8"], ["--bits", "4", "-g", "32", "--method", "gptq"],
                                  ["--bits", "4", "-g", "32", "--method", "awq"]], ids=["w4", "w8", "gptq", "awq"])
def test_checkpoints_load_in_hf_and_match_the_runtime(family, tmp_path, capsys, args):
    from transformers import AutoModelForCausalLM

    from quantkit.formats.load import load_dequantized_model

    out = tmp_path / "q"
    code, _, err = run_cli(capsys, "quantize", str(family[1]), "-o", str(out), "-q", "--calib-samples", "8",
                           "--calib-seqlen", "64", *args)
    assert code == 0, err
    if "awq" in args:  # asymmetric: HF + compressed-tensors re-initialise packed zero points (see test_runtime)
        hf = load_dequantized_model(out)
    else:
        hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
        assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    prompt = torch.tensor(GEMMA_PROMPTS[4])
    with torch.no_grad():
        want = hf.eval()(prompt[None]).logits[0, -1].float()
    got = prefill_logits(LLMEngine(out, EngineConfig(dtype="fp32", kernel="reference")), prompt)
    packed = prefill_logits(LLMEngine(out, EngineConfig(dtype="fp32")), prompt)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 1e-4 * scale
    assert (packed - want).abs().max().item() < 2e-2 * scale and packed.argmax() == want.argmax()


def _tiny_qwen2_mha(path):
    """Qwen2 without grouped-query attention: AWQ's v -> o mapping applies, and v_proj has a bias."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, max_position_embeddings=256)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.bias.normal_(0, 1.0)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("which", ["gemma3", "qwen2-mha", "phi3"])
def test_awq_folds_its_scales_without_changing_the_float_layer(which, tiny_gemma_dir, tiny_phi3_dir, tmp_path):
    """AWQ divides the producer of a Linear's input by s and multiplies that Linear's columns by s: before any
    rounding the layer computes what it did. Gemma's norms scale by (1 + w), so the fold is (1 + w) / s - 1, not
    w / s; a producing Linear's bias is divided too (Qwen's v_proj, folded into o_proj without grouped-query heads)."""
    from transformers import AutoModelForCausalLM

    from quantkit.arch import GEMMA3, LLAMA, PHI3
    from quantkit.calib.sequential import first_layer_inputs, quantize_awq
    from quantkit.config import Scheme

    path, arch, folded_into = {
        "gemma3": (tiny_gemma_dir, GEMMA3, ["pre_feedforward_layernorm"]),
        "qwen2-mha": (_tiny_qwen2_mha(tmp_path / "qwen2"), LLAMA, ["self_attn.v_proj"]),
        "phi3": (tiny_phi3_dir, PHI3, ["self_attn.qkv_proj", "mlp.gate_up_proj"]),  # v rows, up rows
    }[which]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = model.model.layers
    ids = torch.randint(4, 250, (4, 24), generator=torch.Generator().manual_seed(0))
    batches = first_layer_inputs(model, layers, ids, 2, "cpu")
    for i in (0, 2) if which == "gemma3" else (0,):  # a sliding and a full-attention layer
        layer = layers[i]
        for b in batches:
            b.to_layer(layer)
        with torch.no_grad():
            before = [layer(b.hidden, **b.kwargs) for b in batches]
            local = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
            weights = [layer.get_submodule(n).weight.clone() for n in folded_into]
            quantize_awq(layer, local, batches, dict.fromkeys(local, Scheme(bits=4, group_size=32)), torch.float32, arch)
            after = [layer(b.hidden, **b.kwargs) for b in batches]
        for n, w in zip(folded_into, weights):
            assert not torch.equal(w, layer.get_submodule(n).weight), n  # a scale was folded there
        for x, y in zip(before, after):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-4)


def test_a_checkpoint_at_odds_with_its_config_is_one_line_naming_the_tensor(tiny_gemma_dir, tiny_phi3_dir, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file
    from test_cli import assert_one_line_error

    def damaged(src, name, change):
        out = tmp_path / f"{src.parent.name}-{name}"
        shutil.copytree(src, out)
        tensors = load_file(out / "model.safetensors")
        change(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return out

    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    norm = "model.layers.2.post_feedforward_layernorm.weight"
    cases = [(damaged(tiny_phi3_dir, "narrow", lambda t: t.update({qkv: t[qkv][:256].contiguous()})), qkv.removesuffix(".weight")),
             (damaged(tiny_gemma_dir, "missing", lambda t: t.pop(norm)), norm)]
    for path, name in cases:
        for args in (["quantize", str(path), "--bits", "4", "-g", "32", "-q", "-o", str(tmp_path / "out")],
                     ["bench", "--offline", str(path), "--input-len", "8", "--output-len", "2"]):
            code, _, err = run_cli(capsys, *args)
            assert_one_line_error(code, err, name)
        assert not (tmp_path / "out").exists()


@pytest.mark.integration
def test_gemma_3_270m_greedy_matches_hf_under_continuous_batching(gemma270_dir):
    """The real weights: 20 prompts x 64 tokens, requests arriving every 2 steps, float32, token for token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.calib.data import builtin_texts

    tok = AutoTokenizer.from_pretrained(gemma270_dir)
    words = " ".join(builtin_texts("eval")).split()
    prompts = [tok(" ".join(words[i * 40 : i * 40 + 60]))["input_ids"][:32] for i in range(20)]  # <bos> first
    assert all(p[0] == tok.bos_token_id and len(p) == 32 for p in prompts)
    engine = LLMEngine(gemma270_dir, EngineConfig(dtype="fp32", kv_cache_memory=512 << 20))
    got = run_staggered(engine, prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(gemma270_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    want = model.generate(torch.tensor(prompts), max_new_tokens=64, do_sample=False, pad_token_id=0)[:, 32:].tolist()
    same = sum(g == w for g, w in zip(got, want))
    assert same == 20, f"{same}/20 prompts identical"


@pytest.mark.integration
def test_gemma_3_270m_serves_completions_with_its_bos_and_refuses_chat_without_a_template(gemma270_dir):
    """A base model: /v1/completions tokenizes a text prompt with the tokenizer's BOS (as vLLM does: Gemma without
    <bos> degenerates), `add_special_tokens: false` leaves it out; chat is a 400, since it has no template."""
    import httpx
    from conftest import Server

    server = Server(gemma270_dir, "--kv-cache-memory", "0.25")
    try:
        client = server.client()
        body = {"model": server.client().models.list().data[0].id, "prompt": "The capital of France is", "max_tokens": 4,
                "temperature": 0}
        assert client.completions.create(**body).usage.prompt_tokens == 6  # <bos> + 5
        bare = httpx.post(server.base + "/v1/completions", json={**body, "add_special_tokens": False}).json()
        assert bare["usage"]["prompt_tokens"] == 5
        chat = httpx.post(server.base + "/v1/chat/completions", json={"model": body["model"], "max_tokens": 4,
                                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "chat_template" in chat.json()["error"]["message"]
    finally:
        assert server.stop() == 0


@pytest.mark.integration
def test_offline_generate_tokenizes_text_with_the_bos_as_the_server_does(gemma270_dir):
    """`LLM.generate("text")` has completions' semantics: the tokenizer's special tokens (Gemma's <bos>) come first."""
    from quantkit.runtime.engine import LLM

    llm = LLM(gemma270_dir, dtype="fp32", kv_cache_memory=256 << 20)
    text = "The capital of France is"
    ids = llm.engine.tokenizer(text)["input_ids"]
    assert ids[0] == llm.engine.tokenizer.bos_token_id
    params = SamplingParams(max_tokens=4, temperature=0.0)
    out = llm.generate(text, params)[0]
    assert out.prompt_tokens == len(ids) and out.token_ids == llm.generate([ids], params)[0].token_ids


def test_fp8_kv_scales_per_layer_cover_each_layers_keys(family, calib_file, tmp_path):
    """FP8 KV-cache scales for every layer, sliding and full alike, taken where the cache stores them: Gemma's keys
    after its k norm and its layer kind's rope, Phi-3's from the fused qkv. HF's cache holds the same post-rope keys
    (a sliding layer's only for its window): the scale is their absmax / 448 on a full layer and covers them on a
    sliding one. The runtime decodes through the FP8 cache as it does through bf16, within FP8's rounding."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from test_calibrated import SAMPLES, SEQLEN, calib_ids, quantize

    name, path = family
    quantize(path, tmp_path / "out", calib_file, method="none", kv_cache="fp8")  # weights dense: HF sees the same keys
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = calib_ids(path, calib_file)
    assert ids.shape == (SAMPLES, SEQLEN)
    with torch.no_grad():
        cache = hf(ids, use_cache=True).past_key_values
    with safe_open(str(tmp_path / "out/model.safetensors"), "pt") as f:
        for i, window in enumerate(WINDOWS[name]):
            for kind, held in (("k", cache.layers[i].keys), ("v", cache.layers[i].values)):
                stored, seen = f.get_tensor(f"model.layers.{i}.self_attn.{kind}_scale").float().item(), held.abs().max().item() / 448
                assert stored >= seen * 0.99, (kind, i)  # bf16 calibration forwards round a little
                if not window:
                    assert stored <= seen * 1.02, (kind, i)

    prompt = torch.tensor(GEMMA_PROMPTS[4])
    fp8 = LLMEngine(tmp_path / "out", EngineConfig(dtype="fp32", kv_cache_dtype="fp8", block_size=4))
    plain = LLMEngine(tmp_path / "out", EngineConfig(dtype="fp32", kv_cache_dtype="bf16", block_size=4))
    assert fp8.cache.k[0].dtype == torch.float8_e4m3fn
    a, b = prefill_logits(fp8, prompt), prefill_logits(plain, prompt)
    assert (a - b).abs().max().item() < 0.1 * b.abs().max().item() and a.argmax() == b.argmax()


def test_the_layer_walk_feeds_each_layer_what_hf_does(family):
    """The calibration walk runs each layer on its own kind's mask and rope (Gemma's sliding and full layers differ
    in both): the inputs it hands each layer equal HF's hidden states there (float32, no weights changed)."""
    from transformers import AutoModelForCausalLM

    from quantkit.arch import arch_of
    from quantkit.calib.sequential import first_layer_inputs, quantize_layer
    from quantkit.config import build_recipe
    from quantkit.models import decoder_layers, read_config

    name, path = family
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([GEMMA_PROMPTS[4][:20], GEMMA_PROMPTS[2][:20]])  # longer than the 8-token window
    with torch.no_grad():
        want = model(ids, output_hidden_states=True).hidden_states
    layers = decoder_layers(model)
    batches = first_layer_inputs(model, layers, ids, 2, "cpu")
    recipe, arch = build_recipe([], {"method": "none"}), arch_of(read_config(path))
    for i, layer in enumerate(layers):
        assert torch.allclose(batches[0].hidden, want[i], atol=1e-5, rtol=1e-4), (name, i)
        _, batches = quantize_layer(layer, f"model.layers.{i}", [], batches, recipe, torch.bfloat16, arch)
