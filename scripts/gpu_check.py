"""Check and time the Triton kernels on a GPU, in one run (for sessions lent a GPU machine).

    python scripts/gpu_check.py [--out gpu_check.json]

Only the source tree travels to the GPU machine, so every model here is built from a config with random
weights. Checks: W4A16/W8A16 GEMM (sym/asym, group/channel) against the reference dequantised matmul;
KV store + paged decode attention in bf16 and FP8 against the reference attention; the whole engine on
the Triton path against the reference path on a random 4-layer Llama. Times: W4A16 GEMM vs a dense bf16
matmul at several batch sizes on Llama-7B-like shapes, and engine decode throughput at batch 1/8/32.
Prints one JSON object; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.formats.pack import pack_int32
from quantkit.kernels import reference
from quantkit.kernels.triton.attention import paged_decode_attention, store_kv
from quantkit.kernels.triton.gemm import wqa16_linear


def timed(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def check_gemm(report: dict) -> None:
    for bits, group, sym in [(4, 128, True), (4, 128, False), (4, None, True), (8, None, True), (8, 128, False)]:
        n, k = 4096, 4096
        lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
        groups = 1 if group is None else k // group
        q = torch.randint(lo, hi, (n, k), dtype=torch.int8, device="cuda")
        scale = (torch.rand(n, groups, device="cuda") * 0.02 + 0.001).to(torch.bfloat16)
        zp = None if sym else torch.randint(lo, hi, (n, groups), dtype=torch.int8, device="cuda")
        packed = pack_int32(q.cpu(), bits, dim=1).cuda()
        for m in (1, 16, 64, 256):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            want = reference.dequant_linear(x.float(), q, scale.float(), zp)
            got = wqa16_linear(x, packed, scale, zp, bits, k).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            dense = reference.dequant_linear(torch.eye(k, device="cuda"), q, scale.float(), zp).T.to(torch.bfloat16).contiguous()
            t_q = timed(lambda: wqa16_linear(x, packed, scale, zp, bits, k))
            t_d = timed(lambda: x @ dense.T)
            report["gemm"].append({"bits": bits, "group": group, "sym": sym, "m": m, "rel_err": err, "ok": err < 2e-2,
                                   "triton_us": t_q * 1e6, "dense_bf16_us": t_d * 1e6, "speedup_vs_dense": t_d / t_q})


def check_attention(report: dict) -> None:
    blocks, bs, kvh, heads, d, seqs = 4096, 16, 8, 32, 128, 32
    lengths = torch.randint(100, 2000, (seqs,), device="cuda")
    width = int((lengths.max() + bs - 1) // bs)
    tables = torch.randperm(blocks, device="cuda")[: seqs * width].view(seqs, width)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        k_cache = torch.zeros(blocks, bs, kvh, d, dtype=dtype, device="cuda")
        v_cache = torch.zeros_like(k_cache)
        scale = torch.full((1,), 0.05, device="cuda") if dtype == torch.float8_e4m3fn else None
        keys, values = [], []
        for s in range(seqs):
            n = int(lengths[s])
            k = torch.randn(n, kvh, d, device="cuda")
            v = torch.randn(n, kvh, d, device="cuda")
            pos = torch.arange(n, device="cuda")
            slots = tables[s, pos // bs] * bs + pos % bs
            store_kv(k, k_cache, slots, scale)
            store_kv(v, v_cache, slots, scale)
            if scale is not None:
                k = reference.dequantize_fp8(reference.quantize_fp8(k, scale), scale, torch.float32)
                v = reference.dequantize_fp8(reference.quantize_fp8(v, scale), scale, torch.float32)
            keys.append(k)
            values.append(v)
        q = torch.randn(seqs, heads, d, device="cuda", dtype=torch.bfloat16)
        got = paged_decode_attention(q, k_cache, v_cache, tables, lengths, scale, scale).float()
        want = torch.stack([reference.attention(q[i : i + 1].float(), keys[i], values[i], int(lengths[i]) - 1)[0] for i in range(seqs)])
        err = (got - want).abs().max().item()
        t = timed(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lengths, scale, scale))
        report["attention"].append({"kv_dtype": str(dtype), "max_abs_err": err, "ok": err < 2e-2, "us": t * 1e6,
                                    "seqs": seqs, "mean_len": lengths.float().mean().item()})


def check_engine(report: dict) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.runtime import EngineConfig, LLMEngine, SamplingParams
    from tests.conftest import make_tokenizer

    work = Path(tempfile.mkdtemp())
    config = LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(work / "dense")
    make_tokenizer().save_pretrained(work / "dense")
    import subprocess

    subprocess.run([sys.executable, "-m", "quantkit", "quantize", str(work / "dense"), "--bits", "4", "-g", "128",
                    "-o", str(work / "w4"), "-q"], check=True)
    prompts = [[1] + [(7 * i + j) % 250 + 4 for j in range(50 + 13 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    outs = {}
    for kernel in ("reference", "triton"):
        engine = LLMEngine(work / "w4", EngineConfig(dtype="fp32", kernel=kernel, device="cuda"))
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.id] = o.token_ids
        outs[kernel] = [done[i] for i in ids]
    report["engine"] = {"triton_equals_reference": outs["triton"] == outs["reference"]}
    for batch in (1, 8, 32):
        engine = LLMEngine(work / "w4", EngineConfig(kernel="triton", device="cuda", max_num_seqs=batch))
        for p in range(batch):
            engine.add_request([1] + [5] * 127, SamplingParams(max_tokens=128, ignore_eos=True))
        torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        report["engine"][f"batch_{batch}_tok_s"] = batch * 128 / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    report: dict = {"device": torch.cuda.get_device_name(), "gemm": [], "attention": []}
    for step in (check_gemm, check_attention, check_engine):
        try:
            step(report)
        except Exception as e:  # keep what was measured; say what broke
            report.setdefault("errors", []).append(f"{step.__name__}: {type(e).__name__}: {e}")
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    ok = all(r["ok"] for r in report["gemm"] + report["attention"]) and report.get("engine", {}).get("triton_equals_reference")
    sys.exit(0 if ok and not report.get("errors") else 1)


if __name__ == "__main__":
    main()
