"""The command line: summaries, --json, --help, and one clear line with exit 2 for every expected failure."""

import json
import subprocess
import sys

import pytest

from tests.conftest import run_cli

run = run_cli


def assert_one_line_error(code, err, pattern):
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert pattern in lines[0], lines[0]
    assert "Traceback" not in err


def test_quantize_json_then_inspect(tiny_dir, tmp_path, capsys):
    out = tmp_path / "w4"
    code, stdout, _ = run(capsys, "quantize", str(tiny_dir), "-o", str(out), "--bits", "4", "-g", "64", "--json")
    assert code == 0
    summary = json.loads(stdout)
    assert summary["quantized_modules"] == 14 and summary["recipe"]["group_size"] == 64
    assert summary["out_bytes"] == sum(f.stat().st_size for f in out.glob("*.safetensors"))
    code, stdout, _ = run(capsys, "inspect", str(out), "--json")
    info = json.loads(stdout)
    assert code == 0 and info["layers"] == 2 and info["quant_format"] == "pack-quantized"
    # 2 layers x (4 attention + 3 MLP) linears, all quantized; embeddings, norms and lm_head dense.
    assert info["quantized_parameters"] == 2 * (128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 256)
    assert info["parameters"] == info["quantized_parameters"] + 2 * 256 * 128 + 5 * 128
    assert info["config_groups"]["group_0"]["weights"]["group_size"] == 64
    assert info["bytes_on_disk"] < info["dense_fp16_bytes"]


def test_quantize_table_and_inspect_table(tiny_dir, tmp_path, capsys):
    code, stdout, _ = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "w8"), "--bits", "8")
    assert code == 0 and "int8 per channel sym" in stdout and "smaller" in stdout
    code, stdout, _ = run(capsys, "inspect", str(tmp_path / "w8"))
    assert code == 0 and "int8 per channel symmetric" in stdout and "self_attn.q_proj" in stdout


def test_quiet_prints_nothing(tiny_dir, tmp_path, capsys):
    code, stdout, err = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "q"), "-g", "32", "-q")
    assert code == 0 and stdout == "" and err == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bits", "7"], "--bits must be 4, 5, 6 or 8"),
        (["-g", "48"], "group size 48 does not divide the input width 128 of model.layers.0.self_attn.q_proj"),
        (["--recipe", "nope"], "recipe 'nope' not found"),
        (["--dtype", "fp32"], "--dtype must be one of bf16, fp16"),
        (["--max-shard-size", "lots"], "--max-shard-size must look like"),
        (["--bogus"], "No such option"),
    ],
)
def test_bad_options(tiny_dir, tmp_path, capsys, args, message):
    code, _, err = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "o"), *args)
    assert_one_line_error(code, err, message)
    assert not (tmp_path / "o").exists()


def test_quantizing_a_quantized_checkpoint_names_its_baseline(tiny_dir, tmp_path, capsys):
    assert run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "w4"), "-g", "32", "-q")[0] == 0
    for extra in ([], ["--budget", "kl=0.1"]):
        code, _, err = run(capsys, "quantize", str(tmp_path / "w4"), "-o", str(tmp_path / "again"), *extra)
        assert_one_line_error(code, err, f"is already quantized (compressed-tensors): quantize its dense baseline, {tiny_dir}")
        assert not (tmp_path / "again").exists()


def test_model_not_found(tmp_path, capsys):
    code, _, err = run(capsys, "quantize", str(tmp_path / "missing"), "-o", str(tmp_path / "o"))
    assert_one_line_error(code, err, "model not found")


def test_hub_unreachable_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run(capsys, "quantize", "nobody-here/no-such-model", "-o", str(tmp_path / "o"))
    assert_one_line_error(code, err, "cannot fetch nobody-here/no-such-model from the Hugging Face hub")


def test_output_exists(tiny_dir, tmp_path, capsys):
    (tmp_path / "o").mkdir()
    code, _, err = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "o"))
    assert_one_line_error(code, err, "already exists; pass --force")


def test_unsupported_architecture(tiny_dir, tmp_path, capsys):
    bad = tmp_path / "gpt"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    code, _, err = run(capsys, "quantize", str(bad), "-o", str(tmp_path / "o"))
    assert_one_line_error(code, err, "unsupported architecture 'gpt2'")


def test_corrupt_safetensors(tiny_dir, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, _, err = run(capsys, "quantize", str(bad), "-o", str(tmp_path / "o"))
    assert_one_line_error(code, err, "corrupt safetensors file")
    code, _, err = run(capsys, "inspect", str(bad))
    assert_one_line_error(code, err, "corrupt safetensors file")


def test_debug_shows_the_traceback(tmp_path, capsys):
    code, _, err = run(capsys, "quantize", str(tmp_path / "missing"), "-o", str(tmp_path / "o"), "--debug")
    assert code == 2 and "Traceback" in err and "model not found" in err


@pytest.mark.parametrize("command", ["quantize", "inspect"])
def test_help_has_an_example(capsys, command):
    code, stdout, _ = run(capsys, command, "--help")
    assert code == 0 and "quantkit " + command in stdout


def test_console_entry_points():
    version = subprocess.run([sys.executable, "-m", "quantkit", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("quantkit ")
    bad = subprocess.run([sys.executable, "-m", "quantkit", "quantize", "x", "-o", "y", "--bits", "3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --bits must be 4, 5, 6 or 8, got 3"


def test_cuda_requested_without_one(tiny_dir, tmp_path, capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("a CUDA device is present")
    code, _, err = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "o"), "--device", "cuda")
    assert_one_line_error(code, err, "no CUDA device is available")


@pytest.mark.parametrize("args, message", [(["--kv-cache", "int4"], "--kv-cache must be fp8 or none"),
                                           (["--kv-strategy", "token"], "--kv-strategy must be one of tensor, head"),
                                           (["--method", "magic"], "--method must be one of"),
                                           (["--method", "gptq", "--calib", "no-such-dir/calib.txt"],
                                            "text file not found: no-such-dir/calib.txt")])
def test_bad_calibrated_options(tiny_dir, tmp_path, capsys, args, message):
    code, _, err = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "o"), *args)
    assert_one_line_error(code, err, message)


def test_gptq_with_kv_cache_from_the_cli(tiny_dir, tmp_path, capsys):
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"w{i * 13 % 250}" for i in range(3000)))
    code, stdout, _ = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "g"), "--recipe", "w4a16_gptq_g128",
                          "--recipe", "fp8_kv", "--calib", str(calib), "--calib-samples", "8", "--calib-seqlen", "64",
                          "--json")
    summary = json.loads(stdout)
    assert code == 0 and summary["recipe"]["method"] == "gptq" and summary["recipe"]["kv_cache"] == "fp8"
    assert summary["calibration"].startswith(f"{calib}: 8 x 64 tokens")
    assert any("small calibration set" in n for n in summary["notes"])
    code, stdout, _ = run(capsys, "inspect", str(tmp_path / "g"), "--json")
    assert json.loads(stdout)["kv_cache_scheme"]["type"] == "float"


def test_bitsandbytes_baseline(tiny_dir, tmp_path, capsys):
    """Writes an HF bitsandbytes checkpoint where bitsandbytes runs; otherwise one clear line."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception:
        code, _, err = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "b"), "--method", "bnb-nf4")
        assert_one_line_error(code, err, "needs bitsandbytes")
        return
    code, stdout, _ = run(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "b"), "--method", "bnb-nf4", "--json")
    assert code == 0 and json.loads(stdout)["quantized_modules"] == 14
    config = json.loads((tmp_path / "b/config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bitsandbytes"
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "b", device_map="cpu")
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(8).unsqueeze(0)).logits).all()
