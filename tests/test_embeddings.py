"""Quantized vocabulary tables (`--embeddings w8|head`): the embedding and the head as int8 rows, one scale each, read
by the runtime as compressed-tensors dequantizes them; a quantized untied head alone loads in HF transformers."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file
from test_budget import budgeted, texts  # noqa: F401  (a fixture)
from test_cli import assert_one_line_error
from test_runtime import prefill_logits

from quantkit.formats.load import load_dequantized_model, scheme_for
from quantkit.runtime.engine import EngineConfig, LLMEngine

PROMPT = torch.tensor([1, 20, 31, 7, 99, 140, 8, 61])


def _reference(path, dtype=torch.float32):
    """Logits at the prompt's last position from quantkit's own dequantized reading of the checkpoint, in HF."""
    with torch.no_grad():
        return load_dequantized_model(path, dtype)(PROMPT[None]).logits[0, -1]


def _close(got, want):
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("which,fmt", [("tiny_dir", "w8"), ("tiny_gemma_dir", "w8"), ("tiny_dir", "w8g32"),
                                       ("tiny_gemma_dir", "w8g32")])
def test_w8_tables_are_int8_rows_the_runtime_reads(request, which, fmt, tmp_path, capsys):
    """Untied Llama (embedding and head each int8) and tied Gemma 3 (one int8 table, looked up and scaled by
    sqrt(hidden), and read again as the head), per row (w8) or a scale per 32 values (w8g32): the runtime's logits
    are HF's on the dequantized weights."""
    src = request.getfixturevalue(which)
    out = tmp_path / "q"
    code, _, err = run_cli(capsys, "quantize", str(src), "-o", str(out), "--bits", "4", "--group-size", "32",
                           "--embeddings", fmt, "-q")
    assert code == 0, err
    tied = json.loads((src / "config.json").read_text()).get("tie_word_embeddings", False)
    tables = ["model.embed_tokens"] + ([] if tied else ["lm_head"])
    tensors = load_file(out / "model.safetensors")
    groups = 1 if fmt == "w8" else tensors["model.embed_tokens.weight_packed"].shape[1] * 4 // 32  # (4 int8 values a word)
    for t in tables:
        assert tensors[f"{t}.weight_packed"].dtype == torch.int32 and tensors[f"{t}.weight_scale"].shape[1] == groups
        assert f"{t}.weight" not in tensors
    assert "lm_head.weight" not in tensors
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    table_group = next(g for g in qc["config_groups"].values() if g["targets"] != ["Linear"])
    assert sorted(table_group["targets"]) == sorted(tables)
    weights = table_group["weights"]
    assert (weights["num_bits"], weights["strategy"], weights["group_size"]) == ((8, "channel", None) if fmt == "w8" else (8, "group", 32))
    assert "lm_head" not in qc["ignore"] or tied
    assert scheme_for("model.embed_tokens", qc).bits == 8 and scheme_for("model.layers.0.mlp.up_proj", qc).bits == 4

    want = _reference(out)
    for kernel in ("reference", "packed"):
        engine = LLMEngine(out, EngineConfig(dtype="fp32", kernel=kernel))
        got = prefill_logits(engine, PROMPT)
        if kernel == "reference":
            _close(got, want)
        else:  # the int8 head on the panel GEMM: same greedy token, logits to the kernel's rounding
            assert got.argmax() == want.argmax() and (got - want).abs().max() < 1e-2 * want.abs().max()
    code, stdout, _ = run_cli(capsys, "inspect", str(out))
    assert code == 0
    ignored = next(line for line in stdout.splitlines() if "ignored (dense)" in line)
    assert "lm_head" not in ignored  # a tied head is the int8 table, not dense


def test_embeddings_head_quantizes_the_untied_head_alone_and_loads_in_hf(tiny_dir, tmp_path, capsys):
    """`--embeddings head` (also how a budget may leave the tables): the head as int8 rows, the embedding dense; HF
    transformers builds the head as a quantized Linear with no missing or unexpected weights, and agrees with the
    runtime."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "head"
    code, _, err = run_cli(capsys, "quantize", str(tiny_dir), "-o", str(out), "--bits", "4", "--group-size", "32",
                           "--embeddings", "head", "-q")
    assert code == 0, err
    tensors = load_file(out / "model.safetensors")
    assert tensors["lm_head.weight_packed"].dtype == torch.int32 and tensors["lm_head.weight_scale"].shape[1] == 1
    assert tensors["model.embed_tokens.weight"].is_floating_point() and "model.embed_tokens.weight_packed" not in tensors
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head" not in qc["ignore"] and scheme_for("lm_head", qc).bits == 8
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        want = hf.eval()(PROMPT[None]).logits[0, -1]
    _close(want, _reference(out))
    _close(prefill_logits(LLMEngine(out, EngineConfig(dtype="fp32", kernel="reference")), PROMPT), want)


def test_a_budget_decides_the_tables(tiny_dir, texts, tmp_path, capsys):  # noqa: F811
    """`--embeddings auto`: each table is a unit with dense, int8 rows and int8 per 32 values, its sensitivity
    measured like a Linear's (groups err less); what the budget chose is what the checkpoint holds. `--embeddings
    w8g32` with a budget keeps the tables in that format."""
    for fmt, bits in (("auto", "6"), ("auto", "7"), ("w8g32", "6")):
        out = tmp_path / f"{fmt}-{bits}"
        code, stdout, err = budgeted(capsys, tiny_dir, out, texts, "--budget", f"bits={bits}", "--embeddings", fmt)
        assert code == 0, err
        report = json.loads(stdout)
        tables = {u["name"]: u for u in report["units"] if not u["name"].startswith("model.layers.")}
        assert set(tables) == {"model.embed_tokens", "lm_head"}
        tensors = load_file(out / "model.safetensors")
        for name, u in tables.items():
            kl = u["sensitivity"]
            assert set(kl) == {"w8", "w8g32", "dense"} and 0 < kl["w8g32"] < kl["w8"]
            assert fmt == "auto" or u["choice"] == fmt
            assert (f"{name}.weight_packed" in tensors) == (u["choice"] != "dense")
            if u["choice"] != "dense":
                hidden = tensors[f"{name}.weight_packed"].shape[1] * 4  # (4 int8 values a word)
                assert tensors[f"{name}.weight_scale"].shape[1] == (1 if u["choice"] == "w8" else hidden // 32)
        assert report["average_bits"] <= float(bits)


def test_embeddings_flag_errors_are_one_line(tiny_dir, tmp_path, capsys):
    code, _, err = run_cli(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "x"), "--embeddings", "auto")
    assert_one_line_error(code, err, "--embeddings auto needs --budget")
    code, _, err = run_cli(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "x"), "--embeddings", "w4")
    assert_one_line_error(code, err, "--embeddings must be one of dense, w8, w8g32, head, auto")
    code, _, err = run_cli(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "x"), "--embeddings", "w8", "--method", "bnb-int8")
    assert_one_line_error(code, err, "bitsandbytes' own layout")
    code, _, err = run_cli(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "x"), "--embeddings", "head", "--budget", "bits=6")
    assert_one_line_error(code, err, "with --budget use auto")
    assert not (tmp_path / "x").exists()


def test_grouped_tables_need_groups_that_divide_the_rows():
    from quantkit import QuantkitError
    from quantkit.config import Recipe
    from quantkit.quant.apply import vocab_tables

    assert vocab_tables({"hidden_size": 64}, Recipe(embeddings="w8g32"))["model.embed_tokens"].group_size == 32
    with pytest.raises(QuantkitError, match="hidden size divisible by 32; this model's is 48"):
        vocab_tables({"hidden_size": 48}, Recipe(embeddings="w8g32"))


def test_embeddings_head_refuses_a_tied_head(tiny_gemma_dir, tmp_path, capsys):
    code, _, err = run_cli(capsys, "quantize", str(tiny_gemma_dir), "-o", str(tmp_path / "x"), "--embeddings", "head")
    assert_one_line_error(code, err, "this model's head is its embedding (tied)")
    assert not (tmp_path / "x").exists()
