"""Layer-by-layer quantization keeps peak memory far below the model's dense size.

A random Llama of ~540 MB (bf16, 16 layers, stored as 100 MB shards) is quantized (RTN weights plus FP8 KV
scales, so calibration activations flow through every layer) in a subprocess; its peak resident memory, less that of a process that has merely imported the same
libraries, must stay under half the dense size. Measured figures are printed (pytest -s shows them).
"""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.integration

BASELINE = """
import torch, transformers, quantkit.quantize, quantkit.cli
from transformers import LlamaForCausalLM
from quantkit.memory import peak_rss_bytes
print(peak_rss_bytes())
"""


@pytest.fixture(scope="module")
def big_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import make_tokenizer

    config = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02 if p.ndim > 1 else torch.ones(p.shape))
    path = tmp_path_factory.mktemp("big") / "model"
    model.save_pretrained(path, max_shard_size="100MB")
    make_tokenizer().save_pretrained(path)
    return path


def test_peak_memory_stays_well_below_dense_size(big_dir, tmp_path):
    shards = list(big_dir.glob("*.safetensors"))
    dense = sum(f.stat().st_size for f in shards)
    assert len(shards) >= 4
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"w{i % 250}" for i in range(20000)))
    run = subprocess.run(
        [sys.executable, "-m", "quantkit", "quantize", str(big_dir), "-o", str(tmp_path / "out"), "--method", "rtn",
         "-g", "128", "--kv-cache", "fp8", "--calib", str(calib), "--calib-samples", "8", "--calib-seqlen", "128",
         "--max-shard-size", "50MB", "--json"],
        capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stderr
    peak = json.loads(run.stdout)["peak_rss_bytes"]
    base = int(subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True, check=True).stdout)
    print(f"\ndense {dense / 1e6:.0f} MB in {len(shards)} shards; quantize peak RSS {peak / 1e6:.0f} MB; "
          f"import baseline {base / 1e6:.0f} MB; added {(peak - base) / 1e6:.0f} MB = {(peak - base) / dense:.0%} of dense")
    assert peak - base < 0.5 * dense
