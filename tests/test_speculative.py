"""Speculative decoding (n-gram drafts): lossless against the plain engine and HF, under continuous batching,
chunked prefill and preemption; seeded sampling draws the same tokens; the counters count."""

import pytest
import torch

from quantkit import QuantkitError
from quantkit.runtime import EngineConfig, LLMEngine, SamplingParams
from quantkit.runtime import engine as engine_module
from quantkit.runtime.speculative import SpeculativeConfig, ngram_draft
from tests.test_runtime import PROMPTS, hf_greedy, run_staggered

# prompts that repeat themselves, so prompt lookup has something to propose
LOOPY = [[1] + ([(11 * i + j) % 50 + 4 for j in range(6)] * 5)[: 12 + 5 * i] for i in range(6)] + PROMPTS[:3]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def test_ngram_draft_proposes_what_followed_the_latest_match():
    assert ngram_draft([5, 6, 7, 8, 9, 5, 6], 3, 2, 4) == [7, 8, 9]
    assert ngram_draft([5, 6, 7, 1, 5, 6, 2, 5, 6], 2, 2, 4) == [2, 5]  # the latest occurrence wins
    assert ngram_draft([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [9, 2]  # the longest n-gram first (1 2 3)
    assert ngram_draft([1, 2, 3, 4], 3, 2, 4) == []  # nothing recurs
    assert ngram_draft([7, 7, 7], 4, 1, 2) == [7]  # a run: what followed the earlier 7 7


@pytest.fixture(scope="module")
def hf_loopy(tiny_dir):
    return hf_greedy(tiny_dir, LOOPY, 24)


@pytest.mark.parametrize("cfg", [
    dict(),
    dict(max_num_batched_tokens=16),  # prompts in chunks, mixed with verifications
    dict(kv_cache_memory=6 * 16384),  # preemption by recompute while drafts hold blocks
    dict(block_size=4, max_num_seqs=3),
])
def test_greedy_with_ngram_drafts_matches_hf(tiny_dir, hf_loopy, cfg):
    engine = LLMEngine(tiny_dir, EngineConfig(dtype="fp32", speculative=SpeculativeConfig(num_tokens=4, ngram_min=1, max_batch=16), **cfg))
    assert run_staggered(engine, LOOPY, GREEDY) == hf_loopy
    assert engine.blocks.num_used == 0 and not engine.has_unfinished()
    stats = engine.spec_stats
    assert stats["drafts"] > 0 and 0 < stats["accepted"] <= stats["draft_tokens"]
    assert sum(stats["accepted_per_pos"]) == stats["accepted"]
    if "kv_cache_memory" in cfg:
        assert engine.scheduler.preemptions > 0


def test_bad_drafts_change_nothing(tiny_dir, hf_loopy, monkeypatch):
    """Drafts that are random tokens are all but always rejected: the output is still the target's."""
    rng = torch.Generator().manual_seed(0)
    monkeypatch.setattr(engine_module, "ngram_draft",
                        lambda tokens, k, lo, hi: torch.randint(4, 250, (k,), generator=rng).tolist())
    engine = LLMEngine(tiny_dir, EngineConfig(dtype="fp32", speculative=SpeculativeConfig(num_tokens=3, max_batch=16)))
    assert run_staggered(engine, LOOPY, GREEDY) == hf_loopy
    assert engine.spec_stats["draft_tokens"] > 100


def test_seeded_sampling_draws_the_same_tokens_with_and_without_drafts(tiny_dir):
    """Each output token is one draw from the target's distribution in the same order as plain decoding, so a
    seeded request gives the same tokens (the sampler, penalties and stop conditions included)."""
    params = [SamplingParams(max_tokens=30, temperature=t, top_k=k, seed=s, ignore_eos=True, repetition_penalty=r, logprobs=2)
              for s, (t, k, r) in enumerate([(0.7, 0, 1.0), (1.0, 20, 1.0), (0.5, 0, 1.3), (0.0, 0, 1.2)])]
    outs = {}
    for spec in (None, SpeculativeConfig(num_tokens=5, ngram_min=1)):
        engine = LLMEngine(tiny_dir, EngineConfig(dtype="fp32", speculative=spec))
        ids = [engine.add_request(LOOPY[i], p) for i, p in enumerate(params)]
        done = {}
        while engine.has_unfinished():
            done.update({o.id: o for o in engine.step() if o.finished})
        outs[spec is None] = [done[i] for i in ids]
        if spec:
            assert engine.spec_stats["accepted"] > 0
    for plain, drafted in zip(outs[True], outs[False]):
        assert drafted.token_ids == plain.token_ids
        for a, b in zip(drafted.samples, plain.samples):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def LLM_text(engine, prompt, params) -> tuple[str, str]:
    out = _run(engine, prompt, params)
    return out.text, out.finish_reason


def test_stop_strings_and_max_tokens_cut_inside_an_accepted_run(tiny_dir):
    """A stop id, a stop string or max_tokens reached in the middle of accepted drafts ends the output there,
    as without drafts."""
    plain = LLMEngine(tiny_dir, EngineConfig(dtype="fp32"))
    spec = LLMEngine(tiny_dir, EngineConfig(dtype="fp32", speculative=SpeculativeConfig(num_tokens=8, ngram_min=1)))
    full = run_staggered(plain, LOOPY[:4], GREEDY)
    for i, out in enumerate(full):
        stop = out[len(out) // 2]
        word = plain.tokenizer.decode([stop])  # the tiny tokenizer's words: "w17" for id 21
        for params in (SamplingParams(max_tokens=7 + i, ignore_eos=True), SamplingParams(max_tokens=24, stop_token_ids=[stop]),
                       SamplingParams(max_tokens=24, stop=[f" {word} "], ignore_eos=True)):
            texts = [LLM_text(e, LOOPY[i], params) for e in (spec, plain)]
            assert texts[0] == texts[1] and (not params.stop or texts[1][1] == "stop")
            assert run_staggered(spec, [LOOPY[i]], params) == run_staggered(plain, [LOOPY[i]], params)
    assert spec.spec_stats["accepted"] > 0


def test_bad_speculative_settings_are_one_clear_error():
    for kw, msg in [(dict(num_tokens=0), "1..16"), (dict(num_tokens=17), "1..16"), (dict(ngram_min=3, ngram_max=2), "n-gram"),
                    (dict(method="eagle"), "use ngram")]:
        with pytest.raises(QuantkitError, match=msg):
            SpeculativeConfig(**kw)


def copy_prompts(path, n: int) -> list[list[int]]:
    """Chat prompts that ask SmolLM2 to repeat, or lightly edit, a passage of the built-in held-out text: the
    copy-heavy work prompt lookup is for."""
    from quantkit.calib.data import builtin_texts
    from quantkit.models import serving_tokenizer

    tok = serving_tokenizer(path)
    texts = [t for t in builtin_texts("eval") if len(t) > 300]
    asks = ["Repeat this text exactly:", "Copy the text below, word for word:", "Rewrite this text with every 'the' in capitals:"]
    return [tok.apply_chat_template([{"role": "user", "content": f"{asks[i % 3]}\n\n{texts[i % len(texts)][:400]}"}],
                                    add_generation_prompt=True) for i in range(n)]


def test_smollm2_greedy_is_token_identical_with_ngram_drafts(smollm2_w4):
    """20 copy-heavy prompts x 64 tokens under continuous batching, with and without drafts, in the compute dtype
    this CPU runs by default (bf16 with native bf16 dot products, else float32): a verification's positions run
    as decode rows through the same batch-invariant kernels, so not even bf16 roundings differ."""
    prompts = copy_prompts(smollm2_w4, 20)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    outs, stats = {}, None
    for spec in (None, SpeculativeConfig(num_tokens=4, max_batch=32)):
        engine = LLMEngine(smollm2_w4, EngineConfig(kv_cache_memory=256 << 20, speculative=spec))
        outs[spec is None] = run_staggered(engine, prompts, params, every=1)
        stats = engine.spec_stats
    assert outs[False] == outs[True]
    assert stats["accepted"] > 0.3 * stats["draft_tokens"]  # copying: most drafts are right


def test_served_with_ngram_drafts_answers_as_without_and_counts(smollm2_w4, smollm2_server):
    """`quantkit serve --speculative ngram`: the same greedy answer as the plain server, and vLLM's four
    spec_decode counters in /metrics."""
    from tests.conftest import Server

    from quantkit.calib.data import builtin_texts

    passage = next(t for t in builtin_texts("eval") if len(t) > 300)[:400]
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}]
    server = Server(smollm2_w4, "--dtype", "fp32", "--kv-cache-memory", "0.5", "--speculative", "ngram")
    try:
        answers = [s.client().chat.completions.create(model=m, messages=messages, max_tokens=80, temperature=0).choices[0].message.content
                   for s, m in ((server, "smollm2-w4"), (smollm2_server, "smollm2-w4"))]
        assert answers[0] == answers[1]
        m = server.metrics()
        assert m["quantkit:spec_decode_num_drafts_total"] > 0
        assert 0 < m["quantkit:spec_decode_num_accepted_tokens_total"] <= m["quantkit:spec_decode_num_draft_tokens_total"]
        assert "quantkit:spec_decode_num_accepted_tokens_per_pos_total" in m
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def tiny_drafts(tmp_path_factory, tiny_dir):
    """Draft models for the tiny target: itself (every draft right), a smaller random one with its tokenizer
    (mostly wrong), one with another vocabulary, and one larger than the target."""
    import json
    import shutil

    from tests.conftest import make_tiny_llama

    root = tmp_path_factory.mktemp("drafts")
    other = make_tiny_llama(root / "other", hidden=64, intermediate=128, layers=1, seed=1)
    vocab = shutil.copytree(other, root / "vocab")
    tok = json.loads((vocab / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {("x" + w if i == 200 else w): i for w, i in tok["model"]["vocab"].items()}
    (vocab / "tokenizer.json").write_text(json.dumps(tok))
    large = make_tiny_llama(root / "large", hidden=256, intermediate=512, layers=2, seed=2)
    return {"self": tiny_dir, "other": other, "vocab": vocab, "large": large}


@pytest.mark.parametrize("draft", ["self", "other"])
@pytest.mark.parametrize("cfg", [dict(), dict(max_num_batched_tokens=16), dict(kv_cache_memory=8 * 16384 * 2)])
def test_greedy_with_a_draft_model_matches_hf(tiny_dir, tiny_drafts, hf_loopy, draft, cfg):
    """A draft model proposes greedily from its own paged cache; chunked prefill and preemption (both caches'
    blocks freed, the draft's rebuilt) change nothing in the output."""
    spec = SpeculativeConfig("draft", 4, max_batch=16, model=str(tiny_drafts[draft]))
    engine = LLMEngine(tiny_dir, EngineConfig(dtype="fp32", speculative=spec, **cfg))
    assert run_staggered(engine, LOOPY, GREEDY) == hf_loopy
    assert engine.blocks.num_used == 0
    stats = engine.spec_stats
    if draft == "self":  # the target drafting for itself: every draft is right
        assert stats["accepted"] == stats["draft_tokens"] > 0
    else:
        assert stats["draft_tokens"] > stats["accepted"]
    if "kv_cache_memory" in cfg:
        assert engine.scheduler.preemptions > 0
    assert "draft KV cache" in engine.describe()


def test_a_draft_with_another_tokenizer_or_larger_than_the_target_is_refused(tiny_dir, tiny_drafts, capsys):
    from tests.conftest import run_cli

    with pytest.raises(QuantkitError, match="another tokenizer.*'xw196'|another tokenizer.*'w196'"):
        LLMEngine(tiny_dir, EngineConfig(dtype="fp32", speculative=SpeculativeConfig("draft", model=str(tiny_drafts["vocab"]))))
    with pytest.raises(QuantkitError, match="larger than the target"):
        LLMEngine(tiny_dir, EngineConfig(dtype="fp32", speculative=SpeculativeConfig("draft", model=str(tiny_drafts["large"]))))
    code, out, err = run_cli(capsys, "bench", "--offline", str(tiny_dir), "--draft", str(tiny_drafts["large"]))
    assert code == 2 and "larger than the target" in err and "Traceback" not in err
    code, out, err = run_cli(capsys, "bench", "--offline", str(tiny_dir), "--draft", str(tiny_drafts["other"]), "--speculative", "ngram")
    assert code == 2 and "give one" in err


def test_expected_tokens_per_step_is_the_geometric_sum():
    from quantkit.eval.acceptance import expected_tokens

    assert expected_tokens(0.0, 4) == 1 and expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_eval_acceptance_of_a_model_drafting_for_itself_and_for_its_w4(tiny_dir, tmp_path, capsys):
    """`quantkit eval OUT --tasks acceptance`: a model drafting for itself has α = 1 and the measured run keeps
    every draft (k + 1 tokens a step); its W4 drafting for it keeps fewer, and the report says how many."""
    import json

    from tests.conftest import run_cli

    code, _, err = run_cli(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "q"), "-g", "32", "-q")
    assert code == 0, err
    code, out, err = run_cli(capsys, "eval", str(tiny_dir), "--baseline", str(tiny_dir), "--tasks", "acceptance",
                             "--limit", "2", "--dtype", "fp32", "--out", str(tmp_path / "self"), "--json")
    assert code == 0, err
    a = json.loads(out)["details"]["acceptance"]
    assert a["alpha"]["held_out"]["greedy"] == 1 and a["alpha"]["held_out"]["sampled"] == pytest.approx(1, abs=1e-4)
    assert a["predicted"][3]["tokens_per_step"] == 5 and a["measured"]["acceptance_rate"] == 1
    assert a["measured"]["tokens_per_step"] > 4.5  # (steps near max_tokens have room for fewer drafts)
    code, out, err = run_cli(capsys, "eval", str(tmp_path / "q"), "--tasks", "acceptance", "--limit", "2", "--dtype", "fp32",
                             "--out", str(tmp_path / "w4"))
    assert code == 0, err
    assert "drafting for" in out and "measured at k=4" in out
    report = (tmp_path / "w4" / "report.md").read_text()
    assert "Speculative decoding: the draft's acceptance" in report
    a = json.loads((tmp_path / "w4" / "results.json").read_text())["details"]["acceptance"]
    assert 0 < a["alpha"]["held_out"]["greedy"] < 1 and 1 <= a["measured"]["tokens_per_step"] <= 5
    code, _, err = run_cli(capsys, "eval", str(tmp_path / "q"), "--tasks", "ppl", "--draft", str(tiny_dir))
    assert code == 2 and "--draft is for --tasks acceptance" in err


@pytest.mark.parametrize("which", ["likely", "impossible"])
def test_sampled_tokens_follow_the_targets_distribution(tiny_dir, monkeypatch, which):
    """Chi-square goodness of fit: over 600 seeded requests (temperature 1, top-k 8), the second token — drawn at
    a drafted position — against the target's own probabilities given the first, per first token (a sum of
    independent chi-squares). The draft is the likeliest token (often kept) or one outside the top 8 (never
    kept). Seeded, so the outcome is fixed; at the 0.001 level a correct sampler fails one seed set in a thousand."""
    from collections import Counter, defaultdict

    prompt = LOOPY[1]
    plain = LLMEngine(tiny_dir, EngineConfig(dtype="fp32"))

    def top8(context):  # the target's 8 likeliest next tokens and their top-k-8 probabilities at temperature 1
        top = _run(plain, context, SamplingParams(max_tokens=1, logprobs=8)).samples[0].top
        return [t for t, _ in top], torch.tensor([lp for _, lp in top]).softmax(0).double()

    firsts, _ = top8(prompt)
    conditional = {t1: top8(prompt + [t1]) for t1 in firsts}
    drafts = {t1: (toks[0] if which == "likely" else next(t for t in range(4, 256) if t not in toks))
              for t1, (toks, _) in conditional.items()}
    monkeypatch.setattr(engine_module, "ngram_draft", lambda seq_tokens, k, lo, hi: [drafts[seq_tokens[-1]]] * k)
    spec = LLMEngine(tiny_dir, EngineConfig(dtype="fp32", speculative=SpeculativeConfig(num_tokens=2)))
    seconds = defaultdict(Counter)
    for s in range(600):
        out = _run(spec, prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=8, seed=1000 + s, ignore_eos=True))
        seconds[out.token_ids[0]][out.token_ids[1]] += 1
    stat, df = 0.0, 0
    for t1, (tokens, probs) in conditional.items():
        n = sum(seconds[t1].values())
        assert set(seconds[t1]) <= set(tokens)
        if n >= 30:  # enough draws for the chi-square approximation (expected counts mostly >= 5 here)
            observed = torch.tensor([seconds[t1][t] for t in tokens], dtype=torch.float64)
            stat += (((observed - probs * n) ** 2) / (probs * n)).sum().item()
            df += len(tokens) - 1
    assert df >= 28  # at least four first tokens tested
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)).item()
    assert p_value > 0.001, (p_value, stat, df)
    assert spec.spec_stats["draft_tokens"] > 0
    if which == "impossible":
        assert spec.spec_stats["accepted"] == 0
    else:
        assert spec.spec_stats["accepted"] > 0


def _run(engine, prompt, params):
    rid = engine.add_request(prompt, params)
    while True:
        for out in engine.step():
            if out.id == rid and out.finished:
                return out


def test_a_draft_model_after_prefix_cache_hits_matches_hf(tiny_dir, tiny_drafts):
    """Prompts sharing a 70-token prefix: later ones start from cached target blocks, and the draft, whose keys
    in those blocks may be another sequence's, catches up on the whole context first."""
    shared = [1] + [(5 * j) % 250 + 4 for j in range(70)]
    prompts = [shared + [10 + i, 20 + i] for i in range(4)]
    spec = SpeculativeConfig("draft", 3, model=str(tiny_drafts["other"]))
    engine = LLMEngine(tiny_dir, EngineConfig(dtype="fp32", speculative=spec))
    assert run_staggered(engine, prompts, GREEDY, every=30) == hf_greedy(tiny_dir, prompts, 24)
    assert engine.stats()["prefix_cache_hits"] >= 3 * (len(shared) // 16) and engine.spec_stats["drafts"] > 0
