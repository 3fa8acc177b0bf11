"""The fast kernels against the pure-torch reference ops."""

import os
import shutil

import pytest
import torch

from quantkit.kernels import cpu, reference


def random_int4(out_f: int, in_f: int, group: int | None, sym: bool, seed: int):
    """-> (generator, q int8 [out, in], scale [out, groups], zero point or None) of a random int4 weight."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if group is None else in_f // group
    q = torch.randint(-8, 8, (out_f, in_f), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_f, groups, generator=gen) * 0.05 + 0.01
    zp = None if sym else torch.randint(-8, 8, (out_f, groups), generator=gen, dtype=torch.int8)
    return gen, q, scale, zp


@pytest.mark.parametrize("group, sym", [(32, True), (64, False), (None, True), (None, False)])
def test_int4_packed_matmul_matches_reference(group, sym):
    gen, q, scale, zp = random_int4(96, 256, group, sym, seed=0)
    x = torch.randn(5, 256, generator=gen)
    packed, sz, g = cpu.repack_int4(q, scale, zp, group, torch.float32)
    want = reference.dequant_linear(x, q, scale, zp)
    got = cpu.int4_linear(x, packed, sz, g)
    assert (got - want).abs().max() < 2e-2 * want.abs().max()  # the op rounds activations to bf16


def test_int8_packed_matmul_matches_reference():
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (64, 96), generator=gen, dtype=torch.int8)
    scale = torch.rand(64, 1, generator=gen) * 0.01
    x = torch.randn(3, 96, generator=gen)
    want = reference.dequant_linear(x, q, scale, None)
    assert torch.allclose(cpu.int8_linear(x, q, scale[:, 0]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_agrees_across_the_prefill_threshold(dtype):
    """Above INT8_PACKED_MAX_ROWS the layer dequantises per call: the same rows give the same outputs either way."""
    from quantkit.runtime.layers.linear import INT8_PACKED_MAX_ROWS, Linear, QuantWeight

    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (64, 96), generator=gen, dtype=torch.int8)
    scale = torch.rand(64, 1, generator=gen) * 0.01
    layer = Linear(QuantWeight.of(q, scale, None, 8, None), None, dtype)
    assert layer.mode == "int8"
    x = torch.randn(INT8_PACKED_MAX_ROWS + 8, 96, generator=gen).to(dtype)
    want = reference.dequant_linear(x.float(), q, scale, None)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    big, small = layer(x).float(), torch.cat([layer(x[:8]), layer(x[8:INT8_PACKED_MAX_ROWS]), layer(x[INT8_PACKED_MAX_ROWS:])]).float()
    assert torch.allclose(big, want, rtol=tol, atol=tol * want.abs().max().item())
    assert torch.allclose(big, small, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("native", [False, True])
def test_bf16_gemms_run_in_float32_where_the_cpu_would_emulate_them(native, monkeypatch):
    """Without native bf16 dot products (forced either way, so every machine checks both paths), more than
    EMULATED_BF16_MAX_ROWS bf16 rows of a dense or int8 layer multiply in float32 and round once, which agrees with
    the emulated bf16 GEMM up to the order of its sums; fewer rows, or a CPU with native bf16, keep the bf16 GEMM."""
    from quantkit.kernels import fused as fused_kernels
    from quantkit.runtime.layers.linear import EMULATED_BF16_MAX_ROWS, INT8_PACKED_MAX_ROWS, Linear, QuantWeight

    monkeypatch.setattr(fused_kernels, "native_bf16", lambda: native)
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(80, 96, generator=gen) * 0.05).bfloat16()
    q = torch.randint(-127, 128, (80, 96), generator=gen, dtype=torch.int8)
    scale = torch.rand(80, 1, generator=gen) * 0.01
    dense, int8 = Linear(w, None, torch.bfloat16), Linear(QuantWeight.of(q, scale, None, 8, None), None, torch.bfloat16)
    assert (dense.mode, int8.mode) == ("dense", "int8")
    x = torch.randn(INT8_PACKED_MAX_ROWS + 8, 96, generator=gen).bfloat16()
    for layer, weight in ((dense, w), (int8, cpu.dequant_int8(q, scale[:, 0].bfloat16()))):
        float32, emulated = (x.float() @ weight.float().T).bfloat16(), x @ weight.T
        assert torch.equal(layer(x), emulated if native else float32)
        assert torch.allclose(float32.float(), emulated.float(), rtol=1e-2, atol=1e-2 * emulated.abs().max().item())
    few = x[:EMULATED_BF16_MAX_ROWS]
    assert torch.equal(dense(few), few @ w.T)


def test_attention_kernels_match_reference():
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, d = 6, 2, 16
    k, v = torch.randn(40, kv_heads, d, generator=gen), torch.randn(40, kv_heads, d, generator=gen)
    q = torch.randn(7, heads, d, generator=gen)
    assert torch.allclose(cpu.attention(q, k, v, 33), reference.attention(q, k, v, 33), atol=1e-5)
    lengths = torch.tensor([40, 3, 17])
    kb, vb = torch.randn(3, 40, kv_heads, d, generator=gen), torch.randn(3, 40, kv_heads, d, generator=gen)
    qd = torch.randn(3, heads, d, generator=gen)
    assert torch.allclose(cpu.decode_attention(qd, kb, vb, lengths), reference.decode_attention(qd, kb, vb, lengths), atol=1e-5)
    for i in range(3):  # one sequence alone takes its own (float32, unpadded) path
        one = (qd[i : i + 1], kb[i : i + 1], vb[i : i + 1], lengths[i : i + 1])
        assert torch.allclose(cpu.decode_attention(*one), reference.decode_attention(*one), atol=1e-5)
        bf16 = [t.bfloat16() for t in one[:3]]
        assert torch.allclose(cpu.decode_attention(*bf16, one[3]).float(), reference.decode_attention(*one), atol=3e-2)


def test_fp8_round_trip_saturates_and_keeps_precision():
    x = torch.tensor([0.0, 1.0, -3.5, 1000.0, -1e6])
    scale = torch.tensor([2.0])
    back = reference.dequantize_fp8(reference.quantize_fp8(x, scale), scale, torch.float32)
    assert back[:3].tolist() == [0.0, 1.0, -3.5] and back[3] == 896.0 and back[4] == -896.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fast_fp8_dequant_equals_reference_for_every_code(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[codes.float().isfinite()].view(-1, 1, 1).expand(-1, 3, 4)  # [254, kv_heads, d], subnormals included
    for scale in (torch.tensor([0.0371]), torch.tensor([[0.5], [3e-3], [7.0]])):  # per tensor, per KV head
        assert torch.equal(cpu.dequantize_fp8(codes, scale, dtype), reference.dequantize_fp8(codes, scale, dtype))


@pytest.mark.parametrize("sym", [True, False])
def test_int4_dequant_from_packed_words_equals_reference(sym):
    from quantkit.formats.pack import pack_int32

    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-8, 8, (48, 128), generator=gen, dtype=torch.int8)
    scale = (torch.rand(48, 4, generator=gen) * 0.05).to(torch.bfloat16)
    zp = None if sym else torch.randint(-8, 8, (48, 4), generator=gen, dtype=torch.int8)
    eye = torch.eye(128)
    for dtype in (torch.float32, torch.bfloat16):
        want = reference.dequant_linear(eye, q, scale, zp).T.to(dtype)
        assert torch.equal(cpu.dequant_int4(pack_int32(q, 4, dim=1), scale, zp, 128, dtype), want)


# --- the fused CPU decode ops (kernels/fused.py): each against the PyTorch chain it replaces, on every build ------
# (native, avx2, scalar) this CPU can run: QUANTKIT_ISA forces the lower ones, so an AVX-512 machine checks the AVX2
# and portable kernels too, and an AVX2-only one its own and the portable ones.

def _levels():
    from quantkit.kernels import fused

    return fused.runnable_levels()


@pytest.fixture(params=["native", "avx2", "scalar"])
def isa(request, monkeypatch) -> str:
    """The ISA build under test, selected for the runtime's layers too."""
    if request.param not in _levels():
        pytest.skip(f"{request.param}: not a separate build on this CPU")
    monkeypatch.setenv("QUANTKIT_ISA", request.param)
    return request.param


def fused_ops(level: str | None = None):
    from quantkit.kernels import fused

    m = fused.ops() if level is None else fused.build(level)
    if m is None and shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here: the fused CPU kernels cannot be built")
    assert m is not None, "the fused CPU kernels failed to build (see the line on stderr)"
    return m


def test_every_runnable_build_reports_its_instruction_set():
    """The builds this machine runs: the native one names what the CPU has, the forced ones what they were built
    for, and each takes float32 activations (bf16 only with native bf16 dot products)."""
    from quantkit.kernels import fused

    levels = _levels()
    assert levels[0] == "native" and levels[-1] in ("scalar", "native")
    for level in levels:
        m = fused_ops(level)
        assert m.isa() == (fused.native_isa() if level == "native" else level)
        assert "float32" in m.panel_dtypes()
        assert ("bfloat16" in m.panel_dtypes()) == (m.isa() == "avx512-bf16")


def test_the_panel_dtypes_predicted_before_a_build_are_the_builds(monkeypatch):
    """Weights are laid out while the kernels compile, from a prediction of what the build will take: it must be
    the built module's own answer, on every build this CPU runs."""
    from quantkit.kernels import fused

    for level in _levels():
        monkeypatch.setenv("QUANTKIT_ISA", level)
        built = tuple(fused_ops(level).panel_dtypes())
        monkeypatch.setattr(fused, "_BUILT", {})  # as before the build finishes
        assert fused.panel_dtypes() == built
        monkeypatch.undo()


def _panel_cases():
    return [(bits, group, sym, dtype) for dtype in (torch.float32, torch.bfloat16)
            for bits, group, sym in [(4, 32, True), (4, 128, False), (4, None, True), (4, None, False), (8, None, True), (8, 64, False)]]


@pytest.mark.parametrize("bits, group, sym, dtype", _panel_cases())
def test_panel_gemm_matches_reference_and_is_batch_invariant(isa, bits, group, sym, dtype):
    """quantkit's int4/int8 GEMM through the runtime's Linear: 3 panels (an odd one left after pairs), row counts
    that take every tile shape and cross a row block (84 rows at 1536 inputs). The weights are never rounded
    (scales apply in float32), so the result is the exact product up to float32 sums (and bf16 output rounding);
    each row's result is the same whatever the batch; and the portable loops agree on every build."""
    from quantkit.quant.qparams import dequantize
    from quantkit.runtime.layers.linear import F32_PANEL_MAX_ROWS, Linear, QuantWeight, panel_max_rows

    m = fused_ops(isa)
    if str(dtype).removeprefix("torch.") not in m.panel_dtypes():
        pytest.skip(f"{isa}: no bf16 dot products")
    gen, q, scale, zp = random_int4(48, 1536, group, sym, seed=6)
    if bits == 8:  # the full signed 8-bit range, zero points too
        q = torch.randint(-128, 128, q.shape, generator=gen, dtype=torch.int8)
        zp = None if zp is None else torch.randint(-128, 128, zp.shape, generator=gen, dtype=torch.int8)
        scale = scale / 16
    head = bits == 8 and dtype == torch.bfloat16  # bf16: int8 panels for the head only
    lin = Linear(QuantWeight.of(q, scale, zp, bits, group), None, dtype, "packed", fused=True, head=head)
    assert lin.mode == f"int{bits}_panels"
    assert lin.params.shape[0] == (1 if sym else 2)  # symmetric: no zero plane, the kernels' constant instead
    x = torch.randn(100, 1536, generator=gen).to(dtype)
    w = dequantize(q, scale, zp).double()  # exact: (q - zp) * scale in float32
    want = x.double() @ w.T
    # float32 sums of x * (bias + u) less bias * sum(x): the cancellation costs ~bias * 2**-24 of the outputs' scale
    # (bias 136 for int4, 2304 for int8 in bf16), far below bf16 rounding; float32 outputs are held to that floor
    floor = {4: 1e-5, 8: 6e-5}[bits] * want.abs().max()
    rel = 2**-8 if dtype == torch.bfloat16 else 1e-6
    small = x[:F32_PANEL_MAX_ROWS]  # float32 above F32_PANEL_MAX_ROWS rows: dequantised from the panels, then sgemm
    full = lin(small)
    assert ((full.double() - want[: len(small)]).abs() <= rel * want[: len(small)].abs() + floor).all()
    for rows in (1, 2, 3, 5, 7, 13, 30):
        assert torch.equal(lin(small[:rows]), full[:rows])
    big = lin(x)
    if dtype == torch.bfloat16 and len(x) > panel_max_rows(dtype):  # AMX: the weight dequantised to bf16 (below)
        assert torch.equal(big, x @ dequantize(q, scale, zp).to(dtype).T.contiguous())
    else:
        assert ((big.double() - want).abs() <= rel * want.abs() + floor).all()
    if dtype == torch.float32:
        portable = m.panel_gemm_scalar(x, lin.packed, lin.params, lin.group)
        assert ((portable.double() - want).abs() <= rel * want.abs() + floor).all()


@pytest.mark.parametrize("group, sym", [(32, True), (128, False), (None, True)])
def test_int8_activation_gemm_is_its_integer_arithmetic_on_every_build(isa, group, sym):
    """`int8_activations`: each row quantised per kernel group (max |x| / 127, round half to even), integer products,
    then scale * dx in float32. Against that arithmetic in float64, on every row count up to F32_PANEL_MAX_ROWS;
    the vector and portable loops give the same bits (integer sums); a row's result does not depend on its batch;
    above the threshold the float32 path runs; and the result really differs from float32 activations'."""
    from quantkit.quant.qparams import dequantize
    from quantkit.runtime.layers.linear import F32_PANEL_MAX_ROWS, Linear, QuantWeight

    m = fused_ops(isa)
    gen, q, scale, zp = random_int4(80, 1536, group, sym, seed=9)
    weight = QuantWeight.of(q, scale, zp, 4, group)
    lin = Linear(weight, None, torch.float32, "packed", fused=True, int8_activations=True)
    plain = Linear(weight, None, torch.float32, "packed", fused=True)
    assert lin.int8_activations and not plain.int8_activations
    x = torch.randn(F32_PANEL_MAX_ROWS + 4, 1536, generator=gen)
    x[3, :64] = 0.0  # an all-zero group
    g = lin.group
    xg = x.double().view(len(x), -1, g)
    dx = (xg.abs().amax(-1, keepdim=True).float() / 127).double()
    x8 = torch.round(xg / torch.where(dx > 0, dx, 1.0))  # torch.round: half to even, as nearbyint
    want = (x8 * dx).view(len(x), -1) @ dequantize(q, scale, zp).double().T
    small = x[:F32_PANEL_MAX_ROWS]
    got = lin(small)
    assert ((got.double() - want[:F32_PANEL_MAX_ROWS]).abs() <= 1e-6 * want.abs().max()).all()
    for rows in (1, 2, 3, 4, 5, 7, 13):
        assert torch.equal(lin(small[:rows]), got[:rows])
        assert torch.equal(lin(small[rows : rows + 1]), got[rows : rows + 1])
    assert torch.equal(m.panel_gemm_q8_scalar(small, lin.packed, lin.params, lin.group), got)
    assert torch.equal(lin(x), plain(x))  # above the threshold: float32 activations
    assert (got - plain(small)).abs().max() > 1e-4 * want.abs().max()


def test_int8_activations_decode_batch_invariant_and_refuse_what_they_cannot_run(isa, smollm2_w4):
    """SmolLM2 W4 with int8 activations: greedy tokens of three prompts decoded together equal each decoded alone
    (the C++ decode loop and the Python layers call the same kernel); describe() says so; a bfloat16 engine and an
    unknown choice are one-line errors."""
    from quantkit import QuantkitError
    from quantkit.runtime import LLM, SamplingParams

    llm = LLM(str(smollm2_w4), dtype="fp32", activations="int8")
    assert "int8 into 120 int4 layers" in llm.engine.describe()
    assert llm.engine.model.decoder is not None
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate([p], params)[0].token_ids for p in prompts]
    with pytest.raises(QuantkitError, match="int8 activations take float32"):
        LLM(str(smollm2_w4), dtype="bf16", activations="int8")
    with pytest.raises(QuantkitError, match="use float or int8"):
        LLM(str(smollm2_w4), activations="int4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_panel_gemm_lm_head_matches_and_serves_embedding_rows(isa, dtype):
    """A dense bf16 weight in panels (the lm_head): the product equals float64's up to float32 sums (and bf16
    output rounding), is batch-invariant, and `rows` reads back the exact weight rows (the tied embedding)."""
    from quantkit.runtime.layers.linear import Linear

    if str(dtype).removeprefix("torch.") not in fused_ops(isa).panel_dtypes():
        pytest.skip(f"{isa}: no bf16 dot products")
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(80, 576, generator=gen).bfloat16()
    head = Linear(w, None, dtype, "packed", fused=True, head=True)
    assert head.mode == "bf16_panels"
    x = torch.randn(40, 576, generator=gen).to(dtype)
    full = head(x)
    want = x.double() @ w.double().T
    rel = 2**-8 if dtype == torch.bfloat16 else 1e-6
    assert ((full.double() - want).abs() <= rel * want.abs() + 1e-5 * want.abs().max()).all()
    for rows in (1, 2, 5, 12, 33):
        assert torch.equal(head(x[:rows]), full[:rows])
    ids = torch.tensor([0, 17, 79, 17, 40])
    assert torch.equal(head.rows(ids), w[ids].to(dtype))


@pytest.mark.parametrize("layout", ["bf16_panels", "int8_panels", "dense"])
def test_scoring_logits_are_float32_sums_not_rounded_to_the_compute_dtype(isa, layout):
    """`Linear.exact`, the head of a scoring pass (perplexity, KL): float32 logits within float32 sums of
    float64's on every head layout and row count, where the ordinary call on bf16 activations rounds them to
    bf16 (on SmolLM2 that rounding alone adds ~0.001 nats to a KL between two bf16 models)."""
    from quantkit.runtime.layers.linear import Linear
    from quantkit.runtime.models.llama import _int8_rows

    dtype = torch.bfloat16 if "bfloat16" in fused_ops(isa).panel_dtypes() else torch.float32
    gen = torch.Generator().manual_seed(11)
    w = (4 * torch.randn(96, 576, generator=gen)).bfloat16()
    weight = _int8_rows(w) if layout == "int8_panels" else w
    head = Linear(weight, None, dtype, "packed", fused=layout != "dense", head=True)
    assert head.mode == layout
    dense = weight.dequantize(torch.float32) if layout == "int8_panels" else w.float()
    x = torch.randn(40, 576, generator=gen).to(dtype)
    for rows in (1, 8, 40):  # the panel kernel, and above its rows the dequantised weight
        got, want = head.exact(x[:rows]), x[:rows].double() @ dense.double().T
        assert got.dtype == torch.float32
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    if dtype == torch.bfloat16:  # (the check can fail: the ordinary product is rounded, by more than the bound above)
        assert (head(x).double() - x.double() @ dense.double().T).abs().max() > 1e-4 * want.abs().max()


@pytest.mark.parametrize("bits, sym", [(4, False), (8, False), (4, True), (8, True)])
def test_panel_dequant_equals_the_reference_weight(isa, bits, sym):
    """The dense copy prefill-sized float32 inputs multiply: bit for bit the reference's (q - zp) * scale."""
    from quantkit.quant.qparams import dequantize
    from quantkit.runtime.layers.linear import Linear, QuantWeight

    fused_ops(isa)
    gen, q, scale, zp = random_int4(48, 256, 64, sym, seed=9)
    if bits == 8:
        q = torch.randint(-128, 128, q.shape, generator=gen, dtype=torch.int8)
        zp = None if sym else torch.randint(-128, 128, zp.shape, generator=gen, dtype=torch.int8)
    lin = Linear(QuantWeight.of(q, scale, zp, bits, 64), None, torch.float32, "packed", fused=True)
    assert torch.equal(fused_ops(isa).panel_dequant_t(lin.packed, lin.params, 64).T, dequantize(q, scale, zp))
    out = torch.empty(256, 48, dtype=torch.bfloat16)  # into a kept buffer, rounded once more as c10::BFloat16 rounds
    fused_ops(isa).panel_dequant_t(lin.packed, lin.params, 64, out=out)
    assert torch.equal(out.T, dequantize(q, scale, zp).bfloat16())


def test_bf16_rows_above_the_amx_threshold_multiply_the_dequantised_weight(isa, monkeypatch):
    """With AMX (forced here, so every machine checks the path), more than AMX_PANEL_MAX_ROWS bf16 rows multiply the
    weight dequantised to bf16 (as a dequantised checkpoint holds it) with oneDNN's GEMM; fewer stay on the panels."""
    from quantkit.kernels import fused as fused_kernels
    from quantkit.quant.qparams import dequantize
    from quantkit.runtime.layers.linear import AMX_PANEL_MAX_ROWS, Linear, QuantWeight

    if "bfloat16" not in fused_ops(isa).panel_dtypes():
        pytest.skip(f"{isa}: no bf16 dot products")
    gen, q, scale, zp = random_int4(48, 256, 64, False, seed=10)
    lin = Linear(QuantWeight.of(q, scale, zp, 4, 64), None, torch.bfloat16, "packed", fused=True)
    x = torch.randn(AMX_PANEL_MAX_ROWS + 9, 256, generator=gen).bfloat16()
    monkeypatch.setattr(fused_kernels, "amx", lambda: False)
    panels = lin(x)
    monkeypatch.setattr(fused_kernels, "amx", lambda: True)
    assert torch.equal(lin(x), x @ dequantize(q, scale, zp).bfloat16().T.contiguous())
    assert torch.equal(lin(x[:AMX_PANEL_MAX_ROWS]), panels[:AMX_PANEL_MAX_ROWS])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_norm_rope_silu_equal_the_pytorch_chains(isa, dtype):
    from quantkit.runtime.layers.basic import RMSNorm, apply_rotary

    m = fused_ops(isa)
    gen = torch.Generator().manual_seed(4)
    x, r = torch.randn(5, 576, generator=gen).to(dtype), torch.randn(5, 576, generator=gen).to(dtype)
    norm = RMSNorm(torch.randn(576, generator=gen), 1e-5, dtype)
    gate_up = (torch.randn(5, 3072, generator=gen) * 4).to(dtype)
    qkv = torch.randn(5, 15, 64, generator=gen).to(dtype)
    cos, sin = torch.randn(5, 64, generator=gen).to(dtype), torch.randn(5, 64, generator=gen).to(dtype)
    total, normed = m.add_rms_norm(x, r, norm.weight, 1e-5)
    gemma = RMSNorm(torch.randn(576, generator=gen) * 0.1, 1e-5, dtype, offset=1.0)  # its float32 (1 + w): Gemma's rounding
    gemma_total, gemma_normed = m.add_rms_norm(x, r, gemma.weight, 1e-5)
    rotated = qkv.clone()
    m.rope_(rotated, cos, sin, 12)  # the 12 query and key heads; the 3 value heads stay
    gate, up = gate_up.chunk(2, dim=-1)
    exact = [(m.rms_norm(x, norm.weight, 1e-5), norm(x)), (total, x + r), (normed, norm(x + r)), (gemma_total, x + r),
             (rotated[:, :12], apply_rotary(qkv[:, :12], cos, sin)), (rotated[:, 12:], qkv[:, 12:])]
    silu = (m.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    # Gemma's product is rounded once, from float32 sums in another order than PyTorch's mean: a rare ulp in fp16
    near = [silu, (m.rms_norm(x, gemma.weight, 1e-5), gemma(x)), (gemma_normed, gemma(x + r))]
    if dtype == torch.float32:  # float32 sums and exp in another order: equal to a few ulp
        for got, want in exact + near:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    else:  # the half-precision roundings are the chain's own: equal to the bit (SiLU's exp differs: a rare ulp)
        for got, want in exact:
            assert torch.equal(got, want)
        for got, want in near:
            assert (got != want).float().mean() < 1e-3 and torch.allclose(got.float(), want.float(), rtol=1e-2)


@pytest.mark.parametrize("dtype, fp8, d", [(torch.bfloat16, False, 64), (torch.bfloat16, True, 64), (torch.float32, False, 64),
                                           (torch.float32, True, 64), (torch.bfloat16, False, 128), (torch.float32, True, 32)])
def test_fused_paged_decode_attention_matches_reference(isa, dtype, fp8, d):
    """Several sequences of different lengths over scattered blocks: the store equals the reference's (FP8 bytes
    included) and the attention output the reference's over the gathered, dequantised context. Head sizes 64 and
    128 have their own vector code; 32 takes the general loops."""
    m = fused_ops(isa)
    gen = torch.Generator().manual_seed(5)
    blocks, bs, kv_heads, heads = 40, 16, 3, 9
    ks = torch.tensor([0.02, 0.05, 0.03]) if fp8 else torch.ones(3)
    vs = torch.tensor([0.04, 0.01, 0.03]) if fp8 else torch.ones(3)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    kc = (torch.randn(blocks, bs, kv_heads, d, generator=gen) * 0.05 / ks.view(-1, 1)).to(cache_dtype)
    vc = (torch.randn(blocks, bs, kv_heads, d, generator=gen) * 0.05 / vs.view(-1, 1)).to(cache_dtype)
    lengths = torch.tensor([1, 17, 50, 127])
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:8] for _ in lengths])
    slots = torch.stack([tables[i, (n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lengths.tolist())])
    qkv = torch.randn(4, heads + 2 * kv_heads, d, generator=gen).to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]  # strided views, as the model passes them
    kc2, vc2 = kc.clone(), vc.clone()
    out = m.decode_attention(q, k, v, kc2, vc2, slots, tables, lengths, ks, vs)

    for cache, new, scale in ((kc, k, ks), (vc, v, vs)):
        flat = cache.view(-1, kv_heads, d)
        flat[slots] = reference.quantize_fp8(new, scale.view(-1, 1)) if fp8 else new
    assert torch.equal(kc2.view(torch.uint8), kc.view(torch.uint8)) and torch.equal(vc2.view(torch.uint8), vc.view(torch.uint8))

    def context(cache, scale):  # [S, 8 * bs, kv_heads, d] float32
        c = cache[tables].view(len(lengths), -1, kv_heads, d)
        return reference.dequantize_fp8(c, scale.view(-1, 1), torch.float32) if fp8 else c.float()

    want = reference.decode_attention(q.float(), context(kc, ks), context(vc, vs), lengths)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out.float(), want, atol=tol), (out.float() - want).abs().max()
    empty = q.new_empty(0)  # keys already stored: attend only
    assert torch.equal(m.decode_attention(q, empty, empty, kc2, vc2, slots, tables, lengths, ks, vs), out)
    for i in range(len(lengths)):  # one sequence alone: its KV heads split over the threads, the same arithmetic
        one = (q[i : i + 1], empty, empty, kc2, vc2, slots[i : i + 1], tables[i : i + 1], lengths[i : i + 1], ks, vs)
        assert torch.equal(m.decode_attention(*one), out[i : i + 1])


def test_fused_attention_reads_every_fp8_code_exactly(isa):
    """A sequence of one token attends to it with weight exactly 1, so float32 output = the cached values read
    back: every finite E4M3 code (subnormals included) times a per-head scale must equal the reference's."""
    m = fused_ops(isa)
    kv_heads, heads, d = 3, 3, 64
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[codes.float().isfinite()]
    codes = torch.cat([codes, codes[: 2 * kv_heads * d - len(codes)]]).view(2, 1, kv_heads, d)  # 2 sequences x 1 token
    cache_v = torch.zeros(4, 16, kv_heads, d, dtype=torch.float8_e4m3fn)
    cache_v[[1, 3], 0] = codes[:, 0]
    cache_k = torch.zeros_like(cache_v)
    vs = torch.tensor([0.0371, 3e-3, 7.0])
    q, empty = torch.randn(2, heads, d), torch.empty(0)
    out = m.decode_attention(q, empty, empty, cache_k, cache_v, torch.tensor([16, 48]), torch.tensor([[1], [3]]),
                             torch.tensor([1, 1]), torch.ones(kv_heads), vs)
    want = reference.dequantize_fp8(codes[:, 0], vs.view(-1, 1), torch.float32)
    assert torch.equal(out, want)


def test_panel_packing_in_cpp_equals_the_reference(isa):
    """Loading packs int4 panels from the checkpoint's words in one C++ pass: byte-equal to formats/pack.py."""
    from quantkit.formats.pack import int4_panels_from_words, pack_int32

    gen = torch.Generator().manual_seed(7)
    for n, k in ((16, 8), (48, 576), (160, 1536)):
        words = pack_int32(torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8), 4, dim=1)
        assert torch.equal(fused_ops(isa).panel_pack_int4(words), int4_panels_from_words(words))


@pytest.fixture(scope="module")
def tiny_w4(tiny_dir, tmp_path_factory):
    from quantkit.cli import main

    out = tmp_path_factory.mktemp("tiny-w4") / "w4"
    with pytest.raises(SystemExit) as exc:
        main(["quantize", str(tiny_dir), "--bits", "4", "-g", "32", "-o", str(out), "-q"])
    assert exc.value.code == 0
    return out


_GREEDY: dict = {}


def _greedy(path, dtype: str, kernel: str, tokens: int) -> list[list[int]]:
    from quantkit.runtime import LLM, SamplingParams

    prompts = [[1, 45, 99, 31, 44, 38, 200], [1, 90, 25, 26, 93]]  # ids the tiny vocabulary (256) has too
    llm = LLM(str(path), dtype=dtype, kernel=kernel)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))]


@pytest.mark.parametrize("model", ["tiny_w4", "smollm2_w4"])
def test_greedy_tokens_on_every_build_equal_the_reference_kernels(request, isa, model):
    """Each instruction-set build decodes the same greedy tokens as the pure-PyTorch reference kernels, in
    float32 (every build) and bf16 (where the build has bf16 panels), on the tiny model and on SmolLM2."""
    path = request.getfixturevalue(model)
    tokens = 24 if model == "smollm2_w4" else 16
    for dtype in ("fp32", "bf16"):
        if dtype == "bf16" and "bfloat16" not in fused_ops(isa).panel_dtypes():
            continue
        key = (model, dtype)
        if key not in _GREEDY:  # the reference does not depend on the build
            _GREEDY[key] = _greedy(path, dtype, "reference", tokens)
        assert _greedy(path, dtype, "packed", tokens) == _GREEDY[key], (isa, dtype)
