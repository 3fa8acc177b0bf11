"""Triton kernels against the reference ops: under TRITON_INTERPRET=1 on CPU, natively on CUDA."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from quantkit.formats.pack import pack_int32
from quantkit.kernels import reference
from quantkit.kernels.triton.attention import paged_decode_attention, store_kv
from quantkit.kernels.triton.gemm import wqa16_linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("bits, group, sym, m", [(4, 32, True, 3), (4, 64, False, 20), (8, 96, True, 5), (4, 96, True, 1)])
def test_wqa16_gemm(bits, group, sym, m):
    gen = torch.Generator().manual_seed(0)
    n, k = 80, 192
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=gen) * 0.05 + 0.01
    zp = None if sym else torch.randint(lo, hi, (n, k // group), generator=gen, dtype=torch.int8)
    x = torch.randn(m, k, generator=gen)
    want = reference.dequant_linear(x, q, scale, zp)
    packed = pack_int32(q, bits, dim=1)
    got = wqa16_linear(x.to(DEV), packed.to(DEV), scale.to(DEV), None if zp is None else zp.to(DEV), bits, k)
    assert torch.allclose(got.cpu(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("fp8", [False, True])
def test_paged_decode_attention_and_store(fp8):
    if fp8 and DEV == "cpu":
        pytest.skip("the interpreter has no float8 type: FP8 runs in scripts/gpu_check.py on a GPU")
    gen = torch.Generator().manual_seed(1)
    blocks, bs, kvh, heads, d = 12, 16, 2, 6, 32
    lengths = torch.tensor([37, 5, 16])
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [9, 0, 0, 0]])
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    k_cache = torch.zeros(blocks, bs, kvh, d, dtype=dtype, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    scale = torch.tensor([0.01, 0.02]).view(-1, 1, 1) if fp8 else None
    keys, values = [], []
    for s, n in enumerate(lengths.tolist()):
        k, v = torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen)
        slots = torch.tensor([tables[s, p // bs] * bs + p % bs for p in range(n)])
        store_kv(k.to(DEV), k_cache, slots.to(DEV), None if scale is None else scale.to(DEV))
        store_kv(v.to(DEV), v_cache, slots.to(DEV), None if scale is None else scale.to(DEV))
        if fp8:
            sc = scale.view(-1, 1)
            k = reference.dequantize_fp8(reference.quantize_fp8(k, sc), sc, torch.float32)
            v = reference.dequantize_fp8(reference.quantize_fp8(v, sc), sc, torch.float32)
        keys.append(k)
        values.append(v)
    q = torch.randn(3, heads, d, generator=gen)
    got = paged_decode_attention(q.to(DEV), k_cache, v_cache, tables.to(DEV), lengths.to(DEV),
                                 None if scale is None else scale.to(DEV), None if scale is None else scale.to(DEV))
    want = torch.stack([reference.attention(q[i : i + 1], keys[i], values[i], int(n) - 1)[0] for i, n in enumerate(lengths)])
    assert torch.allclose(got.cpu().float(), want, atol=2e-3)


def test_engine_on_triton_kernels_matches_reference(tiny_dir, tmp_path, capsys):
    """The whole runtime on the Triton path (GEMM, KV store, paged decode) gives the reference path's greedy tokens."""
    from quantkit.runtime import EngineConfig, LLMEngine, SamplingParams
    from tests.conftest import run_cli
    from tests.test_runtime import PROMPTS, run_staggered

    code, _, err = run_cli(capsys, "quantize", str(tiny_dir), "-o", str(tmp_path / "q"), "-g", "32", "-q")
    assert code == 0, err
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {}
    for kernel in ("reference", "triton"):
        engine = LLMEngine(tmp_path / "q", EngineConfig(dtype="fp32", kernel=kernel, device=DEV, max_num_seqs=4))
        outs[kernel] = run_staggered(engine, PROMPTS[:4], params)
    assert outs["triton"] == outs["reference"]
