"""GPTQ on synthetic problems: never worse than RTN under the same Hessian, and exact where it must be."""

import pytest
import torch

from quantkit.config import Scheme
from quantkit.quant.gptq import GPTQConfig, cholesky_lower, fill_lower, gptq, inverse_hessian_cholesky
from quantkit.quant.rtn import rtn


def problem(out=96, inp=128, tokens=2048, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # Correlated inputs with uneven channel scales: the case where GPTQ's error feedback pays off.
    mix = torch.randn(inp, inp, generator=g) / inp**0.5 + torch.eye(inp)
    x = (torch.randn(tokens, inp, generator=g) @ mix) * torch.linspace(0.2, 3.0, inp)
    w = torch.randn(out, inp, generator=g) * 0.05
    return w.to(device), (x.t() @ x).to(device)


def output_error(qw, w, h):
    d = qw.dequantize(torch.float32) - w
    return torch.einsum("oi,ij,oj->", d, h, d).item()  # sum over rows of d H d^T = ||(W - Q) X^T||^2


@pytest.mark.parametrize("scheme", [Scheme(4, 32, True), Scheme(4, 32, False), Scheme(4, None, True), Scheme(8, None, True)])
@pytest.mark.parametrize("actorder", [False, True])
def test_never_worse_than_rtn(scheme, actorder, device):
    w, h = problem(device=device)
    ours = gptq(w, h, scheme, torch.float32, GPTQConfig(actorder=actorder))
    base = rtn(w, scheme, torch.float32)
    assert output_error(ours, w, h) <= output_error(base, w, h)
    assert ours.q.shape == w.shape and ours.scale.shape == base.scale.shape
    assert int(ours.q.min()) >= scheme.qmin and int(ours.q.max()) <= scheme.qmax


def test_clearly_better_than_rtn_at_4_bits():
    w, h = problem(seed=1)
    scheme = Scheme(4, 32, True)
    assert output_error(gptq(w, h, scheme, torch.float32), w, h) < 0.8 * output_error(rtn(w, scheme, torch.float32), w, h)


def test_identity_hessian_is_rtn():
    """With uncorrelated unit inputs there is no error to push anywhere: GPTQ reduces to RTN."""
    w, _ = problem()
    scheme = Scheme(4, 32, True)
    ours = gptq(w, torch.eye(w.shape[1]) * 10, scheme, torch.float32, GPTQConfig(damp=1e-6))
    assert torch.equal(ours.q, rtn(w, scheme, torch.float32).q)


def test_dead_inputs_are_zeroed():
    w, h = problem()
    h[5, :] = 0
    h[:, 5] = 0
    qw = gptq(w, h, Scheme(4, 32, True), torch.float32)
    assert torch.isfinite(qw.scale).all() and (qw.dequantize(torch.float32)[:, 5] == 0).all()


def test_damping_rises_until_cholesky_succeeds():
    h = torch.ones(16, 16)  # rank one: singular without damping
    u, damp = inverse_hessian_cholesky(h, torch.arange(16), h.diagonal().clone(), 1e-12, 12)
    assert u is not None and damp > 1e-12
    assert torch.equal(h, torch.ones(16, 16))  # the Hessian is read, never written: the work has its own buffer


def test_singular_hessian_falls_back_to_rtn():
    w, _ = problem(inp=32)
    h = -torch.eye(32)  # negative definite: no damping of this size fixes it
    with pytest.warns(UserWarning, match="falling back to RTN"):
        qw = gptq(w, h, Scheme(4, 32, True), torch.float32, GPTQConfig(max_damp_tries=2))
    assert torch.equal(qw.q, rtn(w, Scheme(4, 32, True), torch.float32).q)


def test_stacked_rows_equal_separate_runs():
    """q/k/v share a Hessian and are solved as one stacked weight: rows are independent in GPTQ."""
    w, h = problem(out=64)
    scheme = Scheme(4, 32, True)
    stacked = gptq(w, h, scheme, torch.float32)
    top, bottom = gptq(w[:40], h, scheme, torch.float32), gptq(w[40:], h, scheme, torch.float32)
    assert torch.equal(stacked.q, torch.cat([top.q, bottom.q]))


@pytest.mark.parametrize("dtype,bf16_products", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_block_triangle_hessian_equals_full_product(dtype, bf16_products, monkeypatch):
    """The layer walk sums x^T x over the upper block triangle, in chunks, and mirrors it once at the end; bf16
    inputs are summed in float32 as well (a bf16 GEMM's rounded partial sums miss this tolerance by ~100x), also
    where oneDNN multiplies them as bf16 (the AMX path, forced here on any CPU)."""
    from quantkit.calib import sequential

    monkeypatch.setattr(sequential, "HESSIAN_BLOCK", 16)  # 70 features -> 4 blocks (one shorter)
    monkeypatch.setattr(sequential, "HESSIAN_CHUNK", 100)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 70, generator=g).to(dtype) for n in (250, 37)]
    h = None
    for x in xs:
        h = sequential._hessian(x, h, bf16_products)
    h = fill_lower(h)
    full = sum(x.double().t() @ x.double() for x in xs)
    assert torch.allclose(h.double(), full, rtol=1e-5, atol=1e-5 * full.abs().max().item())
    assert torch.equal(h, h.t())
    assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"  # the setting does not leak out of the walk


def test_overwriting_h_gives_the_same_result():
    """With `overwrite_h`, H is permuted and factored in its own buffer: the same result, with or without actorder."""
    w, h = problem()
    for actorder in (False, True):
        cfg = GPTQConfig(actorder=actorder)
        kept = gptq(w, h.clone(), Scheme(4, 32, True), torch.float32, cfg)
        consumed = gptq(w, h.clone(), Scheme(4, 32, True), torch.float32, cfg, overwrite_h=True)
        assert torch.equal(kept.q, consumed.q) and torch.equal(kept.scale, consumed.scale)


@pytest.mark.parametrize("n", [7, 100])
def test_blocked_cholesky_keeps_the_upper_triangle(n):
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, n + 5, generator=g, dtype=torch.float64)
    h = a @ a.mT
    work = h.clone()
    assert cholesky_lower(work, block=16)  # several blocks and a short last one at n = 100
    assert torch.allclose(work.tril(), torch.linalg.cholesky(h))
    assert torch.equal(work.triu(1), h.triu(1))
    h[3, 3] = -1.0  # indefinite: fails part way, and the upper triangle still holds H
    work = h.clone()
    assert not cholesky_lower(work, block=2)
    assert torch.equal(fill_lower(work).triu(1), h.triu(1)) and torch.equal(work, work.mT)


@pytest.mark.parametrize("overwrite", [False, True])
def test_failed_factorization_retries_from_the_same_hessian(overwrite):
    """Damping rises until the Cholesky succeeds; the result is the one that damping gives from the start."""
    h = torch.ones(16, 16)  # rank one: singular without damping
    perm = torch.arange(16).flip(0)
    u, damp = inverse_hessian_cholesky(h.clone(), perm, h.diagonal().clone(), 1e-12, 12, overwrite)
    assert u is not None and damp > 1e-12
    expected, _ = inverse_hessian_cholesky(h, perm, h.diagonal().clone(), damp, 1)
    assert torch.allclose(u, expected)


@pytest.mark.parametrize("n", [5, 70])
def test_blocked_triangular_inverse_leaves_the_upper_triangle(n):
    g = torch.Generator().manual_seed(n)
    l = torch.randn(n, n, generator=g, dtype=torch.float64).tril() + 4 * torch.eye(n, dtype=torch.float64)
    junk = torch.randn(n, n, generator=g, dtype=torch.float64).triu(1)
    a = l + junk
    from quantkit.quant.gptq import invert_lower

    invert_lower(a, block=16)
    assert torch.allclose(a.tril(), torch.linalg.inv(l)) and torch.equal(a.triu(1), junk)


def test_inverse_cholesky_equals_torch_formula():
    """U from the reversed factorization and triangular inverse is torch's cholesky(inverse(P H P^T), upper)."""
    _, h = problem()
    h = h.double()
    perm = torch.randperm(h.shape[0], generator=torch.Generator().manual_seed(0))
    u, damp = inverse_hessian_cholesky(h, perm, h.diagonal().clone(), 0.01, 1)
    a = h[perm][:, perm]
    a.diagonal().add_(0.01 * h.diagonal().mean())
    assert torch.allclose(u, torch.linalg.cholesky(torch.linalg.inv(a), upper=True), rtol=1e-8, atol=1e-10)


def textbook_gptq(w: torch.Tensor, h: torch.Tensor, scheme: Scheme, damp: float = 0.01) -> torch.Tensor:
    """GPTQ as the paper writes it, in float64: one column at a time, its error pushed onto every later column,
    each group's qparams taken from the updated weights at its first column. Returns q."""
    from quantkit.quant.qparams import minmax_qparams

    w, h = w.double().clone(), h.double().clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    q = torch.empty_like(w)
    column = Scheme(scheme.bits, None, scheme.symmetric)
    for j in range(w.shape[1]):
        if j % scheme.group_size == 0:
            s, z = minmax_qparams(w[:, j : j + scheme.group_size], column, torch.float32)
            s, z = s[:, 0].double(), (z[:, 0].double() if z is not None else 0.0)
        q[:, j] = torch.clamp(torch.round(w[:, j] / s + z), scheme.qmin, scheme.qmax)
        e = (w[:, j] - (q[:, j] - z) * s) / u[j, j]
        w[:, j:] -= torch.outer(e, u[j, j:])
    return q


@pytest.mark.parametrize("sub_block", [1, 16, 32])
@pytest.mark.parametrize("scheme", [Scheme(4, 32, True), Scheme(4, 48, False)])
def test_blocked_updates_equal_the_textbook_order(sub_block, scheme):
    """Columns one by one inside a sub-block, one GEMM for the rest of the block, another for the rest of the row:
    the paper's arithmetic in another order, so the same integers but for rare float32 ties, each of which carries
    on along its row through the error feedback (~0.1% here; a lost update flips tens of percent). Groups of 48 with
    sub-blocks of 32: a group's qparams still see every earlier column's error."""
    w, h = problem(out=64, inp=192, seed=2)
    ours = gptq(w, h, scheme, torch.float32, GPTQConfig(sub_block=sub_block))
    assert (ours.q.double() != textbook_gptq(w, h, scheme)).float().mean() < 0.01
