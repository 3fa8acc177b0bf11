"""quantkit's checkpoints in vLLM itself: generated there, agreeing with HF transformers and quantkit's runtime, and
`quantkit serve --engine vllm` answering `quantkit bench URL` and `quantkit eval --endpoint`.

Runs where vLLM is installed in its own environment and named by QUANTKIT_VLLM (its python or `vllm`); skipped with
the reason otherwise. vLLM's CPU build has its W4A16 kernel only for AVX-512 (or a GPU): without one, the dense
checkpoint is what runs, never a failure for lack of AVX-512."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

VLLM = os.environ.get("QUANTKIT_VLLM")
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not VLLM or not Path(VLLM).is_file(),
                                 reason="vLLM is not installed: set QUANTKIT_VLLM to the python of its environment")]


def w4_kernel() -> bool:
    """Whether vLLM has a W4A16 kernel here: a GPU, or an AVX-512 CPU (its CPU wheel's cpu_gemm_wna16)."""
    import torch

    if torch.cuda.is_available():
        return True
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.fixture(scope="module")
def served(smollm2_w4, smollm2_dir, tmp_path_factory):
    """`quantkit serve CKPT --engine vllm` on a free port (W4 where vLLM has the kernel, else the dense baseline)."""
    ckpt = smollm2_w4 if w4_kernel() else smollm2_dir
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("vllm") / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "quantkit", "serve", str(ckpt), "--engine", "vllm", "--vllm", VLLM,
                                 "--port", str(port), "--served-model-name", "smollm2", "--kv-cache-memory", "1",
                                 "--", "--enforce-eager", "--max-model-len", "4096"], stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            time.sleep(1)
    if proc.poll() is not None or time.monotonic() >= deadline:
        proc.kill()
        pytest.fail(f"vLLM did not come up: {log.read_text()[-2000:]}")
    yield ckpt, url
    proc.terminate()
    assert proc.wait(timeout=120) is not None


def test_checkpoints_generate_in_vllm_and_agree(smollm2_w4, smollm2_dir):
    from vllm_interop import MAX_TOLERANCE, MEAN_TOLERANCE, SCORED, interop

    checkpoints = {"dense": smollm2_dir, **({"w4-g64-sym": smollm2_w4} if w4_kernel() else {})}
    rows = interop(checkpoints, VLLM, n_prompts=2, max_tokens=SCORED)
    for row in rows:
        assert "error" not in row, row
        for side in ("hf", "quantkit"):
            assert row[side]["mean_logprob_diff"] <= MEAN_TOLERANCE and row[side]["max_logprob_diff"] <= MAX_TOLERANCE, row
            assert row[side]["agreement"] > 0, row  # the first tokens of a confident answer at least


@pytest.mark.skipif(not w4_kernel(), reason="vLLM's CPU build has its W4A16 kernels only for AVX-512 (or a GPU)")
def test_moe_checkpoints_generate_in_vllm_and_agree(tiny_moe, tmp_path, capsys):
    """Each expert's Linears under the checkpoint's own names, routers dense in `ignore`: vLLM's MoE loader maps them
    onto its fused expert weights, and what it generates agrees with HF's and the runtime's reading."""
    from vllm_interop import MAX_TOLERANCE, MEAN_TOLERANCE, interop

    family, model = tiny_moe
    code, _, err = run_cli(capsys, "quantize", str(model), "--bits", "4", "-o", str(tmp_path / "w4"))
    assert code == 0, err
    [row] = interop({f"{family}-w4": tmp_path / "w4"}, VLLM, n_prompts=2, max_tokens=16)
    assert "error" not in row, row
    for side in ("hf", "quantkit"):
        assert row[side]["mean_logprob_diff"] <= MEAN_TOLERANCE and row[side]["max_logprob_diff"] <= MAX_TOLERANCE, row
        assert row[side]["agreement"] > 0.5, row  # a random model's greedy run: near-ties are rare at 16 tokens


def test_bench_and_eval_endpoint_against_vllm(served, tmp_path, capsys):
    ckpt, url = served
    code, out, err = run_cli(capsys, "bench", url, "--sweep", "1,2", "-n", "4", "--input-len", "32", "--output-len", "16",
                             "--tokenizer", str(ckpt), "--plot", str(tmp_path / "sweep.png"), "--json")
    assert code == 0, err
    runs = json.loads(out)["runs"]
    for r in runs:  # ignore_eos held on vLLM too: every request made its 16 tokens
        assert r["completed"] == 4 and r["failed"] == 0 and r["output_tokens"] == 64, r
    code, out, err = run_cli(capsys, "eval", str(ckpt), "--endpoint", url + "/v1", "--tasks", "retrieval", "--lengths", "1k",
                             "--limit", "2", "--out", str(tmp_path / "eval"), "--json")
    assert code == 0, err
    row = next(r for r in json.loads(out)["summary"] if r["task"] == "retrieval")
    assert row["n"] > 0 and row["verdict"]
