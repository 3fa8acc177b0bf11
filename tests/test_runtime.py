"""The decode runtime against HF transformers and against its own reference paths, on the tiny model.

Greedy output must be token-identical to HF `generate` on a dense checkpoint (float32), whatever the
batching: requests arriving at different steps, chunked prefill, preemption, prefix caching.
"""

import json

import pytest
import torch

from quantkit import QuantkitError
from quantkit.runtime import EngineConfig, LLMEngine, SamplingParams
from quantkit.runtime.engine import LLM
from tests.conftest import run_cli

PROMPTS = [[1] + [(7 * i + j) % 250 + 4 for j in range(n)] for i, n in enumerate([3, 17, 40, 9, 64, 25, 33, 5])]


def hf_greedy(path, prompts, max_new):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: run on through EOS (min_new_tokens would forbid it instead)
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def run_staggered(engine: LLMEngine, prompts, params, every: int = 2) -> list[list[int]]:
    """Add one request every `every` steps while stepping: continuous batching with late arrivals."""
    pending = list(enumerate(prompts))
    ids, done = {}, {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, p = pending.pop(0)
            ids[engine.add_request(p, params)] = i
        for out in engine.step():
            if out.finished:
                done[ids[out.id]] = out.token_ids
        step += 1
    return [done[i] for i in range(len(prompts))]


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_reference(tiny_dir):
    return hf_greedy(tiny_dir, PROMPTS, 12)


@pytest.mark.parametrize("cfg", [
    dict(),
    dict(max_num_batched_tokens=16),  # prompts split into chunks, mixed with decodes
    dict(kv_cache_memory=5 * 16384),  # 5 blocks of 16 tokens (16 KiB each here): preemption by recompute
    dict(block_size=4, max_num_seqs=3),
    dict(kernel="reference"),
    dict(fused=False),  # the PyTorch ops a machine without a C++ compiler decodes with
])
def test_greedy_matches_hf_token_for_token(tiny_dir, hf_reference, cfg):
    engine = LLMEngine(tiny_dir, EngineConfig(dtype="fp32", **cfg))
    assert run_staggered(engine, PROMPTS, GREEDY) == hf_reference
    assert engine.blocks.num_used == 0 and not engine.has_unfinished()
    if "kv_cache_memory" in cfg:
        assert engine.scheduler.preemptions > 0


def test_prefix_caching_reuses_blocks_and_changes_nothing(tiny_dir):
    shared = [1] + [(5 * j) % 250 + 4 for j in range(70)]
    prompts = [shared + [10 + i, 20 + i] for i in range(4)]
    outs = {}
    for caching in (False, True):
        engine = LLMEngine(tiny_dir, EngineConfig(dtype="fp32", prefix_caching=caching))
        outs[caching] = run_staggered(engine, prompts, GREEDY, every=30)
        hits = engine.stats()["prefix_cache_hits"]
        assert (hits >= 3 * (len(shared) // 16)) if caching else hits == 0
    assert outs[True] == outs[False]


def test_abort_frees_blocks(tiny_dir):
    engine = LLMEngine(tiny_dir, EngineConfig(dtype="fp32"))
    a = engine.add_request(PROMPTS[4], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.blocks.num_used > 0
    engine.abort(a)
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_used == 0


def prefill_logits(engine: LLMEngine, prompt: torch.Tensor) -> torch.Tensor:
    """The engine's next-token logits [vocab] after prefilling `prompt` [n] into blocks 0, 1, ..."""
    return engine.model(engine.single(prompt), engine.cache)[0]


def test_quantized_logits_match_hf_loading_the_same_checkpoint(tiny_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from quantkit.formats.load import load_dequantized_model

    prompt = torch.tensor(PROMPTS[4])
    for args in (["--bits", "4", "-g", "32"], ["--bits", "4", "-g", "32", "--asym"], ["--bits", "8"], ["--bits", "4", "-g", "-1"],
                 ["--bits", "6"], ["--bits", "5", "-g", "32", "--asym"]):  # 5 and 6 bits straddle words; run as int8
        out = tmp_path / "-".join(args)
        code, _, err = run_cli(capsys, "quantize", str(tiny_dir), "-o", str(out), "-q", *args)
        assert code == 0, err
        if "--asym" in args:  # HF 5.24 + compressed-tensors 0.20 re-initialise packed zero points (size mismatch)
            hf = load_dequantized_model(out)  # so: quantkit's reading, bit-exact with compressed-tensors' decompressor
        else:
            hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            want = hf(prompt[None]).logits[0, -1].float()
        got = {k: prefill_logits(LLMEngine(out, EngineConfig(dtype="fp32", kernel=k)), prompt) for k in ("packed", "reference")}
        bf16 = LLMEngine(out, EngineConfig(dtype="bf16"))  # int4: quantkit's int4 GEMM where the CPU has AVX-512 BF16
        got["bf16"] = prefill_logits(bf16, prompt)
        scale = want.abs().max().item()
        assert (got["reference"] - want).abs().max().item() < 1e-4 * scale, args
        assert (got["packed"] - want).abs().max().item() < 2e-2 * scale, args  # packed ops round activations to bf16 internally
        assert (got["bf16"] - want).abs().max().item() < 5e-2 * scale, args  # bf16 activations throughout
        assert got["packed"].argmax() == want.argmax() == got["bf16"].argmax()


def test_fp8_kv_cache_uses_calibrated_scales_and_warns_without(tiny_dir, tmp_path, capsys):
    code, _, err = run_cli(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "kv"), "--method", "none",
                           "--kv-cache", "fp8", "--calib-samples", "4", "--calib-seqlen", "64", "-q")
    assert code == 0, err
    engine = LLMEngine(tmp_path / "kv", EngineConfig(dtype="fp32"))
    assert engine.cache.fp8 and engine.kv_warning is None  # auto picks FP8 when the scales are there
    dense = LLMEngine(tmp_path / "kv", EngineConfig(dtype="fp32", kv_cache_dtype="fp32"))
    for p in PROMPTS[4:6]:
        a, b = prefill_logits(engine, torch.tensor(p)), prefill_logits(dense, torch.tensor(p))
        kl = (b.log_softmax(-1).exp() * (b.log_softmax(-1) - a.log_softmax(-1))).sum().item()
        assert 0 < kl < 1e-3 and (a - b).abs().max() < 0.05 * b.abs().max()
    engine = LLMEngine(tiny_dir, EngineConfig(dtype="fp32", kv_cache_dtype="fp8"))
    assert "without calibrated" in engine.kv_warning and "without calibrated" in capsys.readouterr().err


def test_sampling_options(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="fp32")
    p = PROMPTS[2]
    greedy = llm.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    assert llm.generate([p], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_k=1))[0].token_ids == greedy
    a, b = (llm.generate([p], SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True))[0].token_ids for s in (1, 1))
    assert a == b
    runs = {tuple(llm.generate([p], SamplingParams(max_tokens=8, temperature=1.5, seed=s, ignore_eos=True))[0].token_ids) for s in range(4)}
    assert len(runs) > 1
    out = llm.generate([p], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3))[0]
    assert all(len(s.top) == 3 and s.top[0][0] == t and s.logprob == pytest.approx(s.top[0][1]) for s, t in zip(out.samples, greedy))
    stop = llm.generate([p], SamplingParams(max_tokens=8, stop_token_ids=[greedy[2]]))[0]
    assert stop.token_ids == greedy[:3] and stop.finish_reason == "stop"
    streamed = [o.new_token_ids[0] for o in llm.stream(p, SamplingParams(max_tokens=8, ignore_eos=True))]
    assert streamed == greedy


def test_bad_requests_are_clear_errors(tiny_dir):
    engine = LLMEngine(tiny_dir, EngineConfig(dtype="fp32", kv_cache_memory=1 << 20))
    assert engine.describe().startswith(f"KV cache: {engine.cache.tokens:,} tokens (") and "float32, 1 MiB" in engine.describe()
    with pytest.raises(QuantkitError, match="does not fit"):
        engine.add_request([5] * 300)
    with pytest.raises(QuantkitError, match="top_p"):
        SamplingParams(top_p=0)


def test_bench_offline_cli(tiny_dir, capsys):
    import json

    code, stdout, err = run_cli(capsys, "bench", "--offline", str(tiny_dir), "--batch-sizes", "1,3", "--input-len", "16",
                                "--output-len", "4", "--hf", "--repeats", "2", "--json")
    assert code == 0, err
    assert json.loads(stdout)["repeats"] == 2
    assert set(json.loads(stdout)["load_s"]) == {"kernels", "load", "repack", "warm-up"}
    rows = json.loads(stdout)["results"]  # the median of the two runs per system and batch size
    assert [(r["system"], r["batch"]) for r in rows] == [("quantkit", 1), ("hf generate", 1), ("quantkit", 3), ("hf generate", 3)]
    assert all(r["output_tok_s"] > 0 and r["ttft_s"] > 0 for r in rows)
    code, _, err = run_cli(capsys, "bench", "http://127.0.0.1:1/v1", "-q")  # nothing listens there
    assert code == 2 and err.count("error:") == 1 and "cannot read the served model" in err


@pytest.mark.integration
def test_smollm2_greedy_matches_hf_under_continuous_batching(smollm2_dir):
    """20 prompts x 64 tokens, requests arriving every 2 steps, float32: token for token equal to HF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.calib.data import builtin_texts

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    words = " ".join(builtin_texts("eval")).split()
    prompts = [tok(" ".join(words[i * 40 : i * 40 + 60]), add_special_tokens=False)["input_ids"][:32] for i in range(20)]
    engine = LLMEngine(smollm2_dir, EngineConfig(dtype="fp32", kv_cache_memory=512 << 20))
    got = run_staggered(engine, prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: run on through EOS (min_new_tokens would forbid it instead)
    want = model.generate(torch.tensor(prompts), max_new_tokens=64, do_sample=False, pad_token_id=2)[:, 32:].tolist()
    same = sum(g == w for g, w in zip(got, want))
    assert same == 20, f"{same}/20 prompts identical"
    assert engine.blocks.num_used == 0


def test_bench_and_engine_errors_are_one_line(tiny_dir, capsys):
    for args, words in [(["--batch-sizes", "x"], "--batch-sizes"), (["--kernel", "fast"], "kernel fast"),
                        (["--dtype", "fp64"], "dtype fp64"), (["--kv-cache-dtype", "int2"], "kv cache dtype int2"),
                        (["--input-len", "100000"], "--input-len 100000 plus --output-len 2 exceed the")]:
        code, _, err = run_cli(capsys, "bench", "--offline", str(tiny_dir), "--input-len", "8", "--output-len", "2", *args)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(capsys, "bench", "--offline", "no/such-model-dir-here")
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_json_prefix_automaton():
    from quantkit.runtime.json_mode import JsonPrefix

    for doc in ['{"a": 1, "b": [true, false, null, -1.5e+3, "x\\u00e9\\n"], "c": {}}', "{}", '{"k": [[], {}]}', '{"n": 0}']:
        state = JsonPrefix()
        for ch in doc:  # every prefix is accepted, character by character
            state = state.feed(ch)
            assert state is not None, (doc, ch)
        assert state.complete and json.loads(doc) is not None
    for doc in ["[1]", '{"a" 1}', '{"a": 01}', '{"a": tru }', "{a: 1}", '{"a": 1,}', '{"a": 1}}', '{"a": 1} x', '{"a":     \n 1}']:
        state = JsonPrefix().feed(doc)
        assert state is None or not state.complete, doc
    assert not JsonPrefix().feed('{"a": 12').complete


@pytest.mark.integration
def test_int8_lm_head_is_opt_in_and_close(smollm2_dir):
    from quantkit.calib.data import eval_rows

    engines = {h: LLMEngine(smollm2_dir, EngineConfig(dtype="bf16", kv_cache_memory=64 << 20, lm_head=h)) for h in ("auto", "int8")}
    auto = engines["auto"].model
    assert auto.lm_head.mode in ("dense", "bf16_panels") and engines["int8"].model.lm_head.mode in ("int8", "int8_panels")
    if auto.lm_head.mode == "dense":  # tied: one copy, shared
        assert auto.lm_head.weight.data_ptr() == auto.embed.data_ptr()
    else:  # tied: the embedding reads its rows from the head's panels
        assert auto.embed is None
    rows = eval_rows(engines["auto"].tokenizer, 256, 4)
    lp = {h: torch.cat([e.model(e.single(r, all_logits=True), e.cache).log_softmax(-1) for r in rows]) for h, e in engines.items()}
    kl = (lp["auto"].exp() * (lp["auto"] - lp["int8"])).sum(-1)
    assert 0 < kl.mean().item() < 0.02 and (lp["auto"].argmax(-1) == lp["int8"].argmax(-1)).float().mean() > 0.9
    with pytest.raises(QuantkitError, match="lm_head"):
        LLMEngine(smollm2_dir, EngineConfig(lm_head="int4"))


def test_fused_decode_loop_equals_the_python_layers(tiny_dir, tmp_path, capsys):
    """The C++ layer loop of a pure-decode step makes the Python layers' calls with their roundings: same tokens
    and log-probabilities to the bit, int4 and int8 checkpoints, bf16 and FP8 caches, several sequences at once."""
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)
    for args, kv in ((["--bits", "4", "-g", "32"], "bf16"), (["--bits", "8"], "fp8")):
        out = tmp_path / args[1]
        code, _, err = run_cli(capsys, "quantize", str(tiny_dir), "-o", str(out), "-q", *args)
        assert code == 0, err
        results = []
        for loop in ("c++", "python"):
            engine = LLMEngine(out, EngineConfig(dtype="bf16", kv_cache_dtype=kv))
            if not engine.model.fused:
                pytest.skip("the fused CPU kernels could not be built here (no C++ compiler)")
            assert engine.model.decoder is not None
            if loop == "python":
                engine.model.decoder = None
            ids = [engine.add_request(p, params) for p in PROMPTS[:4]]
            done = {}
            while engine.has_unfinished():
                done |= {o.id: (o.token_ids, [(s.logprob, s.top) for s in o.samples]) for o in engine.step() if o.finished}
            results.append([done[i] for i in ids])
        assert results[0] == results[1]


def test_without_a_compiler_the_engine_says_so_once_and_decodes(tiny_dir, hf_reference, tmp_path):
    """No C++ compiler: one line on stderr, then the PyTorch ops, still token-identical to HF."""
    import os
    import subprocess
    import sys

    script = ("from quantkit.runtime import LLM, SamplingParams\n"
              f"llm = LLM({str(tiny_dir)!r}, dtype='fp32')\n"
              f"print(llm.generate([{PROMPTS[0]}], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids)\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-compiler"), "QUANTKIT_CACHE": str(tmp_path / "cache"), "QUANTKIT_FUSED": "1"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("fused CPU kernels unavailable") == 1 and "no C++ compiler" in r.stderr
    assert r.stdout.strip() == str(hf_reference[0])


@pytest.mark.parametrize("layout", ["transformers5", "older", "llama3"])
def test_rotary_equals_hf_for_both_config_layouts_and_scaled_ropes(tmp_path, layout):
    """The plain rope is computed without HF's rotary class (its import is seconds of start-up): it must be
    bit-identical to it, from either config.json layout; a scaled rope goes through HF's class."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from quantkit.runtime.layers.basic import Rotary

    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
          "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 32, "max_position_embeddings": 8192}
    if layout == "transformers5":
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 100000.0}
    elif layout == "older":
        hf |= {"rope_theta": 500000.0, "rope_scaling": None}
    else:
        hf |= {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    positions = torch.tensor([0, 1, 7, 300, 4000, 8191])
    for dtype in (torch.float32, torch.bfloat16):
        ours = Rotary(tmp_path, hf, dtype, "cpu")
        assert (ours.rope is not None) == (layout == "llama3")
        theirs = LlamaRotaryEmbedding(LlamaConfig.from_pretrained(tmp_path))
        want = theirs(torch.empty(0, dtype=dtype), positions.unsqueeze(0))
        for got, ref in zip(ours(positions), want):
            assert got.dtype == dtype and torch.equal(got, ref[0])


CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
    [{"role": "user", "content": "Weather in Paris? ünïcödé 日本語 🙂"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"},
     {"role": "assistant", "content": "21 degrees."}, {"role": "user", "content": "And Oslo?"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather «here»", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("which", ["smollm2_dir", "qwen05_dir"])
def test_the_serving_tokenizer_is_autotokenizers(request, which):
    """The runtime reads tokenizer.json through `tokenizers` alone and renders the chat template itself (a second
    faster to start than importing transformers): on the built-in models it must encode, decode and render
    chat templates (tools, tool calls, tool results) exactly as AutoTokenizer."""
    from transformers import AutoTokenizer

    from quantkit.models import serving_tokenizer
    from quantkit.tokenizer import Tokenizer

    path = request.getfixturevalue(which)
    ours, auto = serving_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert isinstance(ours, Tokenizer) and len(ours) == len(auto)
    texts = ["Hello world", "  def f(x):\n\treturn x**2  # ünïcödé 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", "7 " * 40]
    for text in texts:
        for special in (False, True):
            ids = auto(text, add_special_tokens=special)["input_ids"]
            assert ours(text, add_special_tokens=special)["input_ids"] == ids
            assert ours.decode(ids) == auto.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    for messages in CONVERSATIONS:
        for kw in ({}, {"tools": TOOLS}):
            for gen in (False, True):
                want = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw)
                assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw) == want
                assert ours.apply_chat_template(messages, add_generation_prompt=gen, **kw) == auto(want, add_special_tokens=False)["input_ids"]
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids", "eos_token"):
        assert getattr(ours, attr) == getattr(auto, attr), attr


def test_chat_template_helpers_render_as_transformers(tmp_path, smollm2_dir):
    """A template using what transformers gives templates (tojson with indent and non-ASCII, raise_exception,
    loop controls, {% generation %}, named templates with tool_use): rendered the same, and the same error."""
    import shutil

    import jinja2
    from transformers import AutoTokenizer

    from quantkit.tokenizer import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    default = ("{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
               "{% if loop.index > 3 %}{% break %}{% endif %}{{ bos_token }}{{ m.role }}: "
               "{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}"
               "{% if add_generation_prompt %}assistant:{% endif %}")
    tool_use = "{{ tools | tojson(indent=2) }}\n{% for m in messages %}{{ m.content }}{% continue %}{% endfor %}"
    config = {**__import__("json").loads((smollm2_dir / "tokenizer_config.json").read_text()),
              "chat_template": [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]}
    (tmp_path / "tokenizer_config.json").write_text(__import__("json").dumps(config))
    ours, auto = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    messages = CONVERSATIONS[1]
    for kw in ({}, {"tools": TOOLS}):
        for gen in (False, True):
            want = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw)
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw) == want
    bad = [{"role": "bad", "content": "x"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="no bad roles"):
        ours.apply_chat_template(bad, tokenize=False)
    with pytest.raises(jinja2.exceptions.TemplateError, match="no bad roles"):
        auto.apply_chat_template(bad, tokenize=False)


@pytest.mark.parametrize("kv", ["bf16", "fp16"])
def test_float32_compute_over_a_narrower_kv_cache(tiny_dir, kv):
    """`--dtype fp32 --kv-cache-dtype bf16` (half the KV memory where bf16 arithmetic is emulated): keys and values
    are rounded once on store and read back as float32 by prefill, the fused decode loop and the reference alike."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = {}
    for kernel in ("packed", "reference"):
        engine = LLMEngine(tiny_dir, EngineConfig(dtype="fp32", kv_cache_dtype=kv, kernel=kernel, block_size=4))
        assert engine.cache.k[0].dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[kv]
        runs[kernel] = run_staggered(engine, PROMPTS[:4], params)
    assert runs["packed"] == runs["reference"]
    want = hf_greedy(tiny_dir, PROMPTS[:4], 16)  # a random model's near-ties may flip on the rounded keys, later on
    assert sum(a[:4] == b[:4] for a, b in zip(runs["packed"], want)) >= 3
