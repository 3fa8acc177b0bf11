"""The runtime's panel cache: weights laid out for the kernels once, mapped by later starts of the same checkpoint."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import save_file

from quantkit.runtime.layers.panel_cache import FILE, PanelCache


def _checkpoint(path, value: float = 1.0):
    path.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.full((16, 16), value)}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return path


def _made(cache: PanelCache, name: str, t: torch.Tensor, calls: list) -> torch.Tensor:
    return cache.get(name, lambda: calls.append(name) or t)


def test_kept_once_then_mapped_aligned_and_never_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_PANEL_CACHE", str(tmp_path / "panels"))
    ckpt = _checkpoint(tmp_path / "ckpt")
    a, b = torch.arange(64, dtype=torch.int32).view(4, 16), torch.randn(2, 8, 16)  # 256 and 1,024 bytes
    calls = []
    first = PanelCache.of(ckpt, {"dtype": "float32"}, min_bytes=0)
    _made(first, "a", a, calls), _made(first, "b", b, calls)
    first.save()
    assert calls == ["a", "b"] and not first.hit and (first.entry / FILE).is_file()

    again = PanelCache.of(ckpt, {"dtype": "float32"}, min_bytes=0)
    got = _made(again, "a", a, calls), _made(again, "b", b, calls)
    assert calls == ["a", "b"] and again.hit  # nothing made the second time
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
    assert all(t.data_ptr() % 64 == 0 for t in got)  # kernels load whole cache lines

    # other settings, or the checkpoint rewritten: another entry, made afresh
    assert PanelCache.of(ckpt, {"dtype": "bfloat16"}, min_bytes=0).entry != first.entry
    time.sleep(0.01)
    _checkpoint(ckpt, 2.0)
    changed = PanelCache.of(ckpt, {"dtype": "float32"}, min_bytes=0)
    assert changed.entry != first.entry and not changed.found


def test_a_damaged_entry_is_made_again_and_the_cache_is_trimmed(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_PANEL_CACHE", str(tmp_path / "panels"))
    ckpt = _checkpoint(tmp_path / "ckpt")
    t = torch.ones(4, 64)  # 1 KiB
    first = PanelCache.of(ckpt, {"n": 1}, min_bytes=0)
    first.get("t", lambda: t)
    first.save()
    data = (first.entry / FILE).read_bytes()
    (first.entry / FILE).write_bytes(data[: len(data) // 2])  # cut short, as a full disk would leave it
    calls = []
    again = PanelCache.of(ckpt, {"n": 1}, min_bytes=0)
    assert torch.equal(_made(again, "t", t, calls), t) and calls == ["t"]
    again.save()
    assert PanelCache.of(ckpt, {"n": 1}, min_bytes=0).hit

    # two more entries under a limit that holds one: the older ones go, the newest stays
    monkeypatch.setenv("QUANTKIT_PANEL_CACHE_GB", str(1.5 * 1024 / 2**30))
    os.utime(first.entry, (1, 1))
    second = PanelCache.of(ckpt, {"n": 2}, min_bytes=0)
    second.get("t", lambda: t)
    second.save()
    assert second.entry.is_dir() and not first.entry.exists()

    # small layouts are not worth a file; QUANTKIT_PANEL_CACHE=0 keeps nothing
    small = PanelCache.of(ckpt, {"n": 3})
    small.get("t", lambda: t)
    small.save()
    assert not small.entry.exists()
    monkeypatch.setenv("QUANTKIT_PANEL_CACHE", "0")
    off = PanelCache.of(ckpt, {"n": 1}, min_bytes=0)
    assert off.entry is None and torch.equal(off.get("t", lambda: t), t) and not off.made


def test_a_second_start_maps_the_kept_panels_and_decodes_the_same(smollm2_w4, tmp_path, monkeypatch):
    """SmolLM2 W4 (110 MB of panels): the first engine keeps them, the second maps them, and both decode exactly
    what an engine without the cache decodes."""
    from quantkit.runtime.engine import LLM
    from quantkit.runtime.sampler import SamplingParams

    monkeypatch.setenv("QUANTKIT_PANEL_CACHE", str(tmp_path / "panels"))
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=24, temperature=0.0)

    def run():
        llm = LLM(str(smollm2_w4), kv_cache_memory=256 << 20)
        return llm, [o.token_ids for o in llm.generate(prompts, params)]

    first, made = run()
    if not first.engine.model.fused:
        pytest.skip("no fused CPU kernels on this machine: nothing is laid out for them")
    second, mapped = run()
    assert not first.engine.model.panels_cached and second.engine.model.panels_cached
    linears = [(a, b) for a, b in zip(first.engine.model.modules(), second.engine.model.modules()) if hasattr(a, "packed")]
    assert linears and all(torch.equal(a.packed, b.packed) and torch.equal(a.params, b.params) for a, b in linears)
    monkeypatch.setenv("QUANTKIT_PANEL_CACHE", "0")
    _, plain = run()
    assert made == mapped == plain
