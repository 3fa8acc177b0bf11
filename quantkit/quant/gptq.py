"""GPTQ (Frantar et al., 2022): quantize columns one at a time, pushing each column's rounding error onto
the columns not yet quantized through the inverse Hessian of the layer's inputs, H = sum(x x^T).

Pure functions over tensors. Output is the same QuantizedWeight as RTN, so the exporter packs it the
same way. Updates are lazy at two levels: inside a block of 128 columns, column by column only within a
sub-block of 16 (a slice that stays in cache), then one GEMM for the rest of the block; after the block, one
GEMM for the rest of the row. `actorder` ("static") visits columns by decreasing H diagonal with every group's
qparams fixed up front from the original weights, so groups stay contiguous and no g_idx is needed on disk.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from quantkit.config import Scheme
from quantkit.quant.qparams import QuantizedWeight, minmax_qparams
from quantkit.quant.rtn import rtn


@dataclass(slots=True, frozen=True)
class GPTQConfig:
    block_size: int = 128
    sub_block: int = 16  # columns updated one by one; the rest of a block by one GEMM per sub-block
    damp: float = 0.01  # fraction of the mean Hessian diagonal added to it
    actorder: bool = False
    max_damp_tries: int = 6  # damping x10 each failed Cholesky, then RTN as the last resort


def inverse_hessian_cholesky(h: Tensor, perm: Tensor, diag: Tensor, damp: float, tries: int,
                             overwrite: bool = False) -> tuple[Tensor | None, float]:
    """Upper Cholesky factor U of (P H P^T)^-1 (U^T U = the inverse), inputs permuted by `perm`, with `diag` as H's
    diagonal (dead inputs' set to 1) and damping raised until it is positive definite; None if never.

    No inverse is formed: with J the reversal, if J A J = M M^T (M lower) then U = J M^-1 J, so one factorization
    and one triangular inverse, both in place, give U. All of it happens in one [in, in] buffer: h itself with
    `overwrite`, else a copy (for a 1.5B model's down projection each copy is 321 MB, and a copy per step made
    GPTQ's peak). The factor is written to the lower triangle only, so H survives in the upper one and a failed
    attempt (common for down projections, whose inputs' scales span orders of magnitude) retries from there."""
    work = h if overwrite else h.clone()
    rev = perm.flip(0)
    permute_in_place(work, rev)  # J P H P^T J
    mean_diag = diag.mean().item()
    for _ in range(tries):
        work.diagonal().copy_(diag[rev] + damp * mean_diag)
        if cholesky_lower(work):
            invert_lower(work)
            permute_in_place(work.tril_(), torch.arange(len(perm) - 1, -1, -1, device=perm.device))
            return work, damp
        fill_lower(work)
        damp *= 10
    return None, damp


def cholesky_lower(a: Tensor, block: int = 1024) -> bool:
    """a = L L^T in place, blocked, L written to the diagonal and lower triangle only: the strictly upper triangle
    keeps a's values (torch's own factorization zeroes it, even when it fails). False if a is not positive definite."""
    n = a.shape[0]
    for k in range(0, n, block):
        e = min(k + block, n)
        d = a[k:e, k:e]  # its lower triangle holds the updated Schur complement
        l, info = torch.linalg.cholesky_ex(d.tril() + d.tril(-1).mT)
        if info.item() != 0:
            return False
        _set_lower(d, l)
        panel = a[e:, k:e]  # [n - e, b]: becomes L21 = A21 L11^-T
        panel.copy_(torch.linalg.solve_triangular(l, panel.mT, upper=False).mT)
        for j in range(e, n, block):  # the trailing lower triangle -= L21 L21^T, a block column at a time
            je = min(j + block, n)
            upd = panel[j - e :] @ panel[j - e : je - e].mT  # [n - j, je - j]
            a[je:, j:je] -= upd[je - j :]
            a[j:je, j:je] -= upd[: je - j].tril()
    return True


def invert_lower(a: Tensor, block: int = 1024) -> None:
    """L^-1 in place of the lower triangular L held in a's diagonal and lower triangle (the strictly upper triangle
    is neither read nor written). Blocked, from the last block column back: a column's blocks below the diagonal
    need the inverse's trailing part, already done, and the column's own blocks above them, not yet overwritten."""
    n = a.shape[0]
    starts = list(range(0, n, block))
    for k in reversed(starts):
        e = min(k + block, n)
        eye = torch.eye(e - k, dtype=a.dtype, device=a.device)
        inv_kk = torch.linalg.solve_triangular(a[k:e, k:e].tril(), eye, upper=False)
        for i in reversed([s for s in starts if s >= e]):  # X_ik = -(sum_m X_im L_mk) L_kk^-1, m from e to i
            ie = min(i + block, n)
            acc = a[i:ie, i:ie].tril() @ a[i:ie, k:e]
            if i > e:
                acc += a[i:ie, e:i] @ a[e:i, k:e]
            a[i:ie, k:e] = -(acc @ inv_kk)
        _set_lower(a[k:e, k:e], inv_kk)


def _set_lower(d: Tensor, values: Tensor) -> None:
    """d's diagonal and lower triangle <- values', its strictly upper triangle kept."""
    d.copy_(torch.where(torch.ones_like(d, dtype=torch.bool).tril(), values, d))


def fill_lower(a: Tensor, block: int = 1024) -> Tensor:
    """Copy a's strictly upper triangle onto its strictly lower one, in place (a symmetric matrix again)."""
    n = a.shape[0]
    for i0 in range(0, n, block):
        i1 = min(i0 + block, n)
        a[i1:, i0:i1] = a[i0:i1, i1:].mT
        d = a[i0:i1, i0:i1]
        d.copy_(d.triu() + d.triu(1).mT)
    return a


def permute_in_place(h: Tensor, perm: Tensor, rows: int = 1024) -> None:
    """h <- P h P^T with [rows, n] temporaries: each block of rows gathers its own columns (h P^T), then each
    block of columns its own rows (P h P^T); a block reads only what it writes."""
    if torch.equal(perm, torch.arange(len(perm), device=perm.device)):
        return
    for i in range(0, h.shape[0], rows):
        h[i : i + rows] = h[i : i + rows].index_select(1, perm)
    for j in range(0, h.shape[1], rows):
        h[:, j : j + rows] = h[:, j : j + rows].index_select(0, perm)


def gptq(w: Tensor, h: Tensor, scheme: Scheme, scale_dtype: torch.dtype, cfg: GPTQConfig = GPTQConfig(),
         overwrite_h: bool = False) -> QuantizedWeight:
    """w [out, in], h [in, in] float32 (sum of x x^T over calibration tokens) -> QuantizedWeight.

    h is left unchanged, or with `overwrite_h` it becomes the factorization's work buffer: a layer walk, which
    needs it no more, then holds one [in, in] matrix instead of two."""
    w = w.to(torch.float32, copy=True)
    h = h.float()
    out_f, in_f = w.shape
    dead = torch.diag(h) == 0  # inputs that were always zero: their weights cannot matter
    w[:, dead] = 0.0
    group = scheme.group_size or in_f
    fixed = cfg.actorder or scheme.group_size is None
    scale, zp = minmax_qparams(w, scheme, scale_dtype) if fixed else (None, None)
    diag = torch.where(dead, torch.ones_like(h.diagonal()), h.diagonal())
    perm = torch.argsort(diag, descending=True) if cfg.actorder else torch.arange(in_f, device=w.device)
    w = w[:, perm]
    u, _ = inverse_hessian_cholesky(h, perm, diag, cfg.damp, cfg.max_damp_tries, overwrite_h)
    del h
    if u is None:
        warnings.warn("GPTQ: the Hessian stayed singular after raising damping; falling back to RTN for this layer")
        return rtn(w[:, torch.argsort(perm)], scheme, scale_dtype)
    if not fixed:
        scale = torch.empty(out_f, in_f // group, dtype=scale_dtype, device=w.device)
        zp = None if scheme.symmetric else torch.empty(out_f, in_f // group, dtype=torch.int8, device=w.device)
    q = torch.empty(out_f, in_f, dtype=torch.int8, device=w.device)
    block = max(group, cfg.block_size // group * group) if scheme.group_size else cfg.block_size
    sub = cfg.sub_block if fixed else math.gcd(cfg.sub_block, group)  # a group's qparams need it fully updated
    col_group = (perm // group).tolist()  # each visited column's group, in original order
    column = Scheme(scheme.bits, None, scheme.symmetric)
    qmin, qmax = float(scheme.qmin), float(scheme.qmax)
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        wt, u1 = w[:, i1:i2].t().contiguous(), u[i1:i2, i1:i2]  # wt [b, out]: a column is one contiguous row
        diag = u1.diagonal().tolist()
        qt, errt = torch.empty_like(wt), torch.empty_like(wt)
        for s1 in range(0, i2 - i1, sub):
            s2 = min(s1 + sub, i2 - i1)
            for i in range(s1, s2):  # the hot loop: a handful of vector ops per column, within [sub, out]
                col, g = i1 + i, col_group[i1 + i]
                if not fixed and col % group == 0:  # new group: qparams from the error-updated weights
                    s_new, z_new = minmax_qparams(wt[i : i + group].t(), column, scale_dtype)
                    scale[:, g] = s_new[:, 0]
                    if zp is not None:
                        zp[:, g] = z_new[:, 0]
                if i == 0 or col_group[col - 1] != g or (not fixed and col % group == 0):
                    s_col = scale[:, g].float()
                    z_col = zp[:, g].float() if zp is not None else 0.0
                wc = wt[i]
                qc = torch.clamp(torch.round(wc / s_col + z_col), qmin, qmax)
                e = (wc - (qc - z_col) * s_col) / diag[i]
                wt[i + 1 : s2].addr_(u1[i, i + 1 : s2], e, alpha=-1.0)
                qt[i], errt[i] = qc, e
            wt[s2:].addmm_(u1[s1:s2, s2:].t(), errt[s1:s2], alpha=-1.0)  # the rest of the block, as one GEMM
        q[:, i1:i2] = qt.t().to(torch.int8)
        w[:, i2:].addmm_(errt.t(), u[i1:i2, i2:], alpha=-1.0)
    return QuantizedWeight(q[:, torch.argsort(perm)].contiguous(), scale, zp, scheme)
