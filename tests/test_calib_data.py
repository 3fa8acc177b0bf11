"""Calibration data: sources, determinism, held-out split, BOS handling, clear errors and warnings."""

import json

import pytest
import torch

from quantkit import QuantkitError
from quantkit.calib.data import CalibConfig, adds_bos, build, builtin_texts


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def words(n, offset=0):
    return " ".join(f"w{(i * 7 + offset) % 250}" for i in range(n))


def test_builtin_split_is_disjoint_and_deterministic():
    calib, held = builtin_texts("calib"), builtin_texts("eval")
    assert set(calib).isdisjoint(held)
    assert 0.15 < sum(map(len, held)) / sum(map(len, calib + held)) < 0.25
    assert builtin_texts("eval") == held


def test_rows_are_deterministic_per_seed(tokenizer, tmp_path):
    f = tmp_path / "c.txt"
    f.write_text(words(4000))
    a = build(CalibConfig(str(f), samples=8, seqlen=32, seed=1), tokenizer).ids
    b = build(CalibConfig(str(f), samples=8, seqlen=32, seed=1), tokenizer).ids
    c = build(CalibConfig(str(f), samples=8, seqlen=32, seed=2), tokenizer).ids
    assert a.shape == (8, 32) and torch.equal(a, b) and not torch.equal(a, c)


def test_jsonl_text_column_and_chat_messages(tokenizer, tmp_path):
    f = tmp_path / "c.jsonl"
    rows = [{"body": words(300, i)} for i in range(3)] + [{"messages": [{"role": "user", "content": words(300)}]}]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    s = build(CalibConfig(str(f), samples=4, seqlen=64, column="body", chat_template=True), tokenizer)
    assert s.ids.shape == (4, 64)
    with pytest.raises(QuantkitError, match="no text column 'text'"):
        build(CalibConfig(str(f), samples=4, seqlen=64), tokenizer)


def test_bos_follows_the_tokenizer(tokenizer, tmp_path):
    f = tmp_path / "c.txt"
    f.write_text(words(2000))
    s = build(CalibConfig(str(f), samples=4, seqlen=32), tokenizer)
    assert s.bos == adds_bos(tokenizer)
    assert (s.ids[:, 0] == tokenizer.bos_token_id).all() == s.bos


def test_small_sets_warn_and_short_text_errors(tokenizer, tmp_path):
    f = tmp_path / "c.txt"
    f.write_text(words(300))
    s = build(CalibConfig(str(f), samples=64, seqlen=64), tokenizer)
    assert any("only" in w for w in s.warnings) and any("small calibration set" in w for w in s.warnings)
    with pytest.raises(QuantkitError, match="fewer than one row"):
        build(CalibConfig(str(f), samples=4, seqlen=4096), tokenizer)


def test_unreachable_hub_dataset_is_one_clear_error(tokenizer, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(QuantkitError, match="cannot load dataset 'nobody/nothing'"):
        build(CalibConfig("nobody/nothing", samples=4, seqlen=32), tokenizer)
