"""Recipes: bundled presets load, fields are validated by name, flags override, recipes compose."""

import pytest

from quantkit import QuantkitError
from quantkit.config import build_recipe, bundled_recipe_names, read_recipe_file


def test_bundled_recipes_are_valid():
    names = bundled_recipe_names()
    assert {"w4a16_rtn_g128", "w8a16_rtn", "w4a16_gptq_g128", "w4a16_awq_g128", "w8a16_gptq", "fp8_kv"} <= set(names)
    for name in names:
        assert read_recipe_file(name)["name"] == name


def test_defaults_by_bit_width():
    r4 = build_recipe([], {})
    assert (r4.bits, r4.group_size, r4.symmetric, r4.group_size_explicit) == (4, 128, True, False)
    r8 = build_recipe([], {"bits": 8})
    assert (r8.bits, r8.group_size) == (8, None)
    assert r4.ignore == ["lm_head"]


def test_flags_override_recipe_and_ignores_add_up(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("bits: 8\ngroup_size: 32\nignore: ['re:.*down_proj']\n")
    r = build_recipe([str(f)], {"bits": 4, "group_size": None}, ["model.layers.0.mlp.up_proj"])
    assert (r.bits, r.group_size, r.group_size_explicit) == (4, 32, True)
    assert r.ignore == ["lm_head", "re:.*down_proj", "model.layers.0.mlp.up_proj"]


def test_later_recipe_overrides_earlier(tmp_path):
    (tmp_path / "a.yaml").write_text("bits: 8\n")
    (tmp_path / "b.yaml").write_text("symmetric: false\n")
    r = build_recipe([str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml")], {})
    assert (r.bits, r.symmetric, r.group_size) == (8, False, None)


@pytest.mark.parametrize(
    "text, field",
    [("grup_size: 64\n", "grup_size"), ("bits: 7\n", "bits"), ("group_size: 60\n", "group_size"),
     ("symmetric: maybe\n", "symmetric"), ("method: magic\n", "method"), ("dtype: fp8\n", "dtype")],
)
def test_bad_field_is_named(tmp_path, text, field):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(QuantkitError, match=f"'{field}'"):
        build_recipe([str(f)], {})


def test_bad_flag_names_the_flag():
    with pytest.raises(QuantkitError, match="--bits must be 4, 5, 6 or 8"):
        build_recipe([], {"bits": 3})


def test_missing_recipe_lists_bundled_names():
    with pytest.raises(QuantkitError, match="w4a16_rtn_g128"):
        build_recipe(["nope"], {})


def test_recipes_compose_weights_and_kv_cache():
    r = build_recipe(["w4a16_gptq_g128", "fp8_kv"], {})
    assert (r.method, r.bits, r.group_size, r.actorder, r.kv_cache, r.kv_strategy) == ("gptq", 4, 128, "static", "fp8", "tensor")
    assert r.needs_calibration and r.name == "w4a16_gptq_g128+fp8_kv"
    kv_only = build_recipe(["fp8_kv"], {"method": "none"})
    assert kv_only.scheme() is None and kv_only.needs_calibration
