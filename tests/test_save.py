"""The checkpoint on disk: names, shapes, config, exact round trip, sharding, atomic writes."""

import errno
import json
from types import SimpleNamespace

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import (
    PackedQuantizationCompressor,
)
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from safetensors import safe_open

import quantkit.quantize as quantize_mod
from quantkit import QuantkitError
from quantkit.config import build_recipe
from quantkit.formats import save as save_mod
from quantkit.formats.load import dense_state_dict, load_dequantized_model, read_tensors
from quantkit.quantize import quantize_loaded, run_quantize
from quantkit.ui import Reporter

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def quantize_tiny(src, out, **overrides):
    extra_ignore = overrides.pop("extra_ignore", [])
    shard = overrides.pop("max_shard_bytes", 5 * 10**9)
    force = overrides.pop("force", False)
    recipe = build_recipe([], overrides, extra_ignore)
    return run_quantize(str(src), out, recipe, shard, force, Reporter(quiet=True))


def reference(src, dtype=torch.bfloat16, **overrides):
    """The same recipe applied to the model fully loaded in memory: what the checkpoint must dequantize to."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).eval()
    quantize_loaded(model, build_recipe([], overrides), torch.bfloat16)
    return model


@pytest.fixture(scope="module")
def w4(tiny_dir, tmp_path_factory):
    result = quantize_tiny(tiny_dir, tmp_path_factory.mktemp("w4") / "out", bits=4, group_size=32)
    return SimpleNamespace(out=result.out, model=reference(tiny_dir, bits=4, group_size=32))


def test_tensor_names_shapes_and_dtypes(w4):
    with safe_open(str(w4.out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for layer in range(2):
            for lin in LINEARS:
                p = f"model.layers.{layer}.{lin}"
                assert f"{p}.weight" not in keys and f"{p}.weight_zero_point" not in keys
                packed, scale, shape = (f.get_tensor(f"{p}.weight_{s}") for s in ("packed", "scale", "shape"))
                out_f, in_f = shape.tolist()
                assert shape.dtype == torch.int64
                assert packed.dtype == torch.int32 and packed.shape == (out_f, in_f // 8)
                assert scale.dtype == torch.bfloat16 and scale.shape == (out_f, in_f // 32)
        assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= keys
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16


def test_config_is_valid_compressed_tensors(w4):
    qc = json.loads((w4.out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.format == "pack-quantized" and parsed.quantization_status == "compressed"
    w = parsed.config_groups["group_0"].weights
    assert (w.num_bits, w.group_size, w.symmetric, w.strategy, w.type) == (4, 32, True, "group", "int")
    assert qc["ignore"] == ["lm_head"] and qc["kv_cache_scheme"] is None


def test_manifest_records_recipe_source_and_timings(w4):
    m = json.loads((w4.out / "quantkit.json").read_text())
    assert m["recipe"]["group_size"] == 32 and m["recipe"]["dtype"] == "bf16"
    assert len(m["source"]["sha256"]) == 64 and m["source"]["files"] == ["model.safetensors"]
    assert set(m["timings_s"]) == {"load", "quantize", "hash", "save"}
    assert m["calibration"] is None  # RTN needs none


def test_round_trip_equals_fake_quantized_weights_exactly(w4):
    dense = dense_state_dict(w4.out)
    fake = w4.model.state_dict()
    for name, value in dense.items():
        assert torch.equal(value, fake[name]), name


@pytest.mark.parametrize("bits, group_size, asym", [(4, 32, True), (8, -1, False), (8, 64, True)])
def test_compressed_tensors_decompresses_to_our_weights(tiny_dir, tmp_path, bits, group_size, asym):
    quantize_tiny(tiny_dir, tmp_path / "out", bits=bits, group_size=group_size, symmetric=not asym)
    model = reference(tiny_dir, bits=bits, group_size=group_size, symmetric=not asym)
    qc = json.loads((tmp_path / "out/config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(targets=["Linear"], weights=qc["config_groups"]["group_0"]["weights"])
    tensors = read_tensors(tmp_path / "out")
    fake = model.state_dict()
    for layer in range(2):
        for lin in LINEARS:
            p = f"model.layers.{layer}.{lin}"
            local = {k.removeprefix(p + "."): v for k, v in tensors.items() if k.startswith(p + ".")}
            assert ("weight_zero_point" in local) == asym
            ref = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
            assert torch.equal(ref, fake[f"{p}.weight"]), p


def test_dequantized_model_gives_identical_logits(w4):
    model = load_dequantized_model(w4.out, torch.bfloat16)
    ids = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, w4.model(ids).logits)


def test_sharding_writes_index(tiny_dir, tmp_path):
    result = quantize_tiny(tiny_dir, tmp_path / "out", bits=8, max_shard_bytes=100_000)
    assert len(result.files) > 1 and all((tmp_path / "out" / f).is_file() for f in result.files)
    index = json.loads((tmp_path / "out/model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(result.files)
    assert set(index["weight_map"]) == set(read_tensors(tmp_path / "out"))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    with torch.no_grad():
        hf(torch.arange(4).unsqueeze(0))  # compressed-tensors decompresses on the first forward
    theirs = hf.state_dict()
    for name, value in reference(tiny_dir, bits=8).state_dict().items():  # HF decompresses in bf16: bit-identical
        assert torch.equal(theirs[name], value), name


def test_ignore_keeps_modules_dense(tiny_dir, tmp_path):
    quantize_tiny(tiny_dir, tmp_path / "out", bits=4, group_size=32, extra_ignore=["re:.*down_proj"])
    keys = set(read_tensors(tmp_path / "out"))
    assert "model.layers.0.mlp.down_proj.weight" in keys and "model.layers.0.mlp.up_proj.weight_packed" in keys
    qc = json.loads((tmp_path / "out/config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "re:.*down_proj"]


def test_failed_save_leaves_nothing(tiny_dir, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk vanished")

    monkeypatch.setattr(quantize_mod, "write_layer", boom)
    with pytest.raises(RuntimeError):
        quantize_tiny(tiny_dir, tmp_path / "out", bits=4, group_size=32)
    assert list(tmp_path.iterdir()) == []


def test_full_disk_is_one_clear_error(tiny_dir, tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(save_mod.ShardWriter, "add", full)
    with pytest.raises(QuantkitError, match="no space left"):
        quantize_tiny(tiny_dir, tmp_path / "out", bits=4, group_size=32)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(tiny_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(QuantkitError, match="already exists"):
        quantize_tiny(tiny_dir, out, bits=4, group_size=32)
    assert (out / "keep.txt").read_text() == "mine"
    quantize_tiny(tiny_dir, out, bits=4, group_size=32, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_default_group_falls_back_and_explicit_one_errors(odd_dir, tmp_path):
    result = quantize_tiny(odd_dir, tmp_path / "a", bits=4)
    assert result.recipe.group_size == 32 and any("using group size 32" in n for n in result.notes)
    with pytest.raises(QuantkitError, match=r"group size 64 does not divide the input width 96 of model\.layers\.0\.self_attn\.q_proj"):
        quantize_tiny(odd_dir, tmp_path / "b", bits=4, group_size=64)
    assert not (tmp_path / "b").exists()
