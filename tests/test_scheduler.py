"""Scheduler and block manager on their own, no model: token budgets, preemption and resume, prefix-cache
hits and eviction, abort freeing blocks. A step is simulated as the engine does it: compute the scheduled
tokens, commit full blocks, and append one output token to each sequence whose tokens are all computed."""

from quantkit.runtime.block_manager import BlockManager
from quantkit.runtime.sampler import SamplingParams
from quantkit.runtime.scheduler import Scheduler, SchedulerConfig
from quantkit.runtime.sequence import Sequence, Status

BS = 4


def make(num_blocks: int, max_seqs: int = 8, budget: int = 64, caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget), BlockManager(num_blocks, BS, caching))


def seq(i: int, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(f"s{i}", prompt, SamplingParams(max_tokens=max_tokens))


def step(s: Scheduler) -> list[tuple[str, int]]:
    work = s.schedule()
    for q, n in work:
        q.computed += n
        s.blocks.commit(q)
    for q, _ in work:
        if q.computed == len(q):
            q.output.append(100 + len(q.output))
            if len(q.output) >= q.params.max_tokens:
                s.finish(q, "length")
    return [(q.id, n) for q, n in work]


def test_chunked_prefill_respects_the_token_budget():
    s = make(num_blocks=32, budget=8)
    a, b = seq(0, list(range(20))), seq(1, list(range(50, 55)))
    s.add(a)
    s.add(b)
    assert step(s) == [("s0", 8)]  # a's prompt takes the whole budget
    assert step(s) == [("s0", 8)]
    assert step(s) == [("s0", 4), ("s1", 4)]  # a finishes its prefill (and samples), b starts
    assert a.output == [100] and not b.output
    assert step(s) == [("s0", 1), ("s1", 1)]  # a decodes, b finishes its prefill
    assert all(n <= 8 for _, n in step(s))


def test_preemption_frees_blocks_and_the_sequence_resumes_by_recompute():
    s = make(num_blocks=4)  # 16 slots
    a, b = seq(0, list(range(7)), max_tokens=6), seq(1, list(range(20, 27)), max_tokens=6)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled: 2 + 2 blocks, cache full
    assert s.blocks.num_free == 0
    step(s)  # each decodes its 8th token, still in 2 blocks
    assert s.preemptions == 0
    step(s)  # a needs a third block for its 9th token: b (the newest) is preempted
    assert s.preemptions == 1 and b.status is Status.WAITING and b.computed == 0 and not b.blocks
    assert len(b.output) == 2  # its sampled tokens survive, to be recomputed with the prompt
    while s.unfinished:
        step(s)
    assert len(a.output) == 6 and len(b.output) == 6 and s.blocks.num_used == 0


def test_prefix_cache_hits_share_blocks_and_evict_least_recently_freed():
    s = make(num_blocks=8)
    shared = list(range(12))  # 3 full blocks
    a = seq(0, shared + [90], max_tokens=1)
    s.add(a)
    step(s)
    assert a.status is Status.FINISHED and s.blocks.num_used == 0  # freed, but its blocks keep their hashes
    b = seq(1, shared + [91], max_tokens=5)
    s.add(b)
    work = step(s)
    assert work == [("s1", 1)] and s.blocks.hits == 3  # only the token after the shared prefix is computed
    c = seq(2, shared + [92], max_tokens=2)
    s.add(c)
    step(s)
    assert c.blocks[:3] == b.blocks[:3] and all(s.blocks.refs[x] == 2 for x in b.blocks[:3])
    while s.unfinished:
        step(s)
    # fill the cache with unrelated prompts: the shared blocks are evicted, the prefix no longer hits
    others = [seq(10 + i, [200 + 10 * i + j for j in range(15)], max_tokens=1) for i in range(2)]
    for o in others:
        s.add(o)
    while s.unfinished:
        step(s)
    d = seq(3, shared + [93], max_tokens=1)
    hits = s.blocks.hits
    s.add(d)
    step(s)
    assert s.blocks.hits == hits  # evicted
    assert s.blocks.num_used == 0


def test_abort_frees_blocks_and_leaves_others_running():
    s = make(num_blocks=16)
    a, b = seq(0, list(range(9)), max_tokens=50), seq(1, list(range(5)), max_tokens=3)
    s.add(a)
    s.add(b)
    step(s)
    used = s.blocks.num_used
    s.finish(a, "abort")
    assert a.finish_reason == "abort" and s.blocks.num_used == used - 3 and s.running == [b]
    while s.unfinished:
        step(s)
    assert s.blocks.num_used == 0 and len(b.output) == 3


def test_argmax_rows_equals_torch_argmax_with_ties_and_odd_widths():
    """The sampler's two-pass argmax picks what torch.argmax picks (the first maximum) for any width, including
    ties inside one chunk and across chunks, -inf rows and widths that are not a multiple of the chunk."""
    import torch

    from quantkit.runtime.sampler import ARGMAX_CHUNK, argmax_rows

    gen = torch.Generator().manual_seed(0)
    for vocab in (7, ARGMAX_CHUNK, ARGMAX_CHUNK + 1, 49152, 151936):
        x = torch.randn(5, vocab, generator=gen)
        x[1, :] = 0.0  # all tied: index 0
        x[2, vocab // 2] = x[2, -1] = 100.0  # tied across chunks: the first
        x[3, :] = float("-inf")
        x[3, vocab - 1] = 1.0  # the last, in a padded chunk
        x[4] = x[4].round()  # many ties inside each chunk
        assert torch.equal(argmax_rows(x), x.argmax(-1)), vocab


def test_sample_rows_scores_only_the_rows_that_ask():
    """Log-probabilities for the rows whose request asked (their value under the full log-softmax), none for
    the others, whose tokens are the same either way."""
    import torch

    from quantkit.runtime.sampler import sample_rows

    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, logprobs=2), SamplingParams(max_tokens=1)]
    out = sample_rows(logits, params, [[], [], []], [None] * 3)
    assert [s.token for s in out] == logits.argmax(-1).tolist()
    assert out[0].logprob is None and out[2].logprob is None and out[0].top == out[2].top == []
    want = logits[1].log_softmax(-1)
    assert out[1].logprob == want[out[1].token].item() and [t for t, _ in out[1].top] == want.topk(2).indices.tolist()
