"""GPTQ (Frantar et al., 2022): quantize columns one at a time, pushing each column's rounding error onto
the columns not yet quantized through the inverse Hessian of the layer's inputs, H = sum(x x^T).

Pure functions over tensors. Output is the same QuantizedWeight as RTN, so the exporter packs it the
same way. `actorder` ("static") visits columns by decreasing H diagonal with every group's qparams fixed
up front from the original weights, so groups stay contiguous and no g_idx is needed on disk.
"""

from __future__ import annotations

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
    damp: float = 0.01  # fraction of the mean Hessian diagonal added to it
    actorder: bool = False
    max_damp_tries: int = 6  # damping x10 each failed Cholesky, then RTN as the last resort


def inverse_hessian_cholesky(h: Tensor, perm: Tensor, diag: Tensor, damp: float, tries: int) -> tuple[Tensor | None, float]:
    """Upper Cholesky factor of (P H P^T)^-1, inputs permuted by `perm`, with `diag` as H's diagonal (dead inputs'
    set to 1) and damping raised until it is positive definite; None if never.

    One [in, in] buffer beside h does all the work (the permuted copy, its factor, the inverse, the new factor in
    place): for a 1.5B model's down projection each copy is 321 MB, and a copy per step made GPTQ's peak."""
    mean_diag = diag.mean().item()
    info = torch.empty((), dtype=torch.int32, device=h.device)
    for _ in range(tries):
        work = _permuted(h, perm)
        work.diagonal().copy_(diag[perm] + damp * mean_diag)
        torch.linalg.cholesky_ex(work, out=(work, info))
        if info.item() == 0:
            torch.cholesky_inverse(work, out=work)
            torch.linalg.cholesky_ex(work, upper=True, out=(work, info))
            if info.item() == 0:
                return work, damp
        damp *= 10
    return None, damp


def _permuted(h: Tensor, perm: Tensor, rows: int = 1024) -> Tensor:
    """P H P^T as one new tensor: rows gathered, then each block of rows' columns (no [n, n] index tensors)."""
    out = h.index_select(0, perm)
    for i in range(0, out.shape[0], rows):
        out[i : i + rows] = out[i : i + rows].index_select(1, perm)
    return out


def gptq(w: Tensor, h: Tensor, scheme: Scheme, scale_dtype: torch.dtype, cfg: GPTQConfig = GPTQConfig(),
         release_h: bool = False) -> QuantizedWeight:
    """w [out, in], h [in, in] float32 (sum of x x^T over calibration tokens) -> QuantizedWeight.

    h is left unchanged, or with `release_h` its storage is freed once factored (every view of it then empty):
    a layer walk does not need it again, and the factor beside it would otherwise double its memory."""
    w = w.float().clone()
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
    u, _ = inverse_hessian_cholesky(h, perm, diag, cfg.damp, cfg.max_damp_tries)
    if release_h:
        h.untyped_storage().resize_(0)
        del h
    if u is None:
        warnings.warn("GPTQ: the Hessian stayed singular after raising damping; falling back to RTN for this layer")
        return rtn(w[:, torch.argsort(perm)], scheme, scale_dtype)
    if not fixed:
        scale = torch.empty(out_f, in_f // group, dtype=scale_dtype, device=w.device)
        zp = None if scheme.symmetric else torch.empty(out_f, in_f // group, dtype=torch.int8, device=w.device)
    q = torch.empty(out_f, in_f, dtype=torch.int8, device=w.device)
    block = max(group, cfg.block_size // group * group) if scheme.group_size else cfg.block_size
    col_group = (perm // group).tolist()  # each visited column's group, in original order
    column = Scheme(scheme.bits, None, scheme.symmetric)
    qmin, qmax = float(scheme.qmin), float(scheme.qmax)
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        w1, u1 = w[:, i1:i2].clone(), u[i1:i2, i1:i2]
        diag = u1.diagonal().tolist()
        q1, err = torch.empty_like(w1), torch.empty_like(w1)
        for i in range(i2 - i1):  # the hot loop: a handful of vector ops per column
            col, g = i1 + i, col_group[i1 + i]
            if not fixed and col % group == 0:  # new group: qparams from the error-updated weights
                s_new, z_new = minmax_qparams(w1[:, i : i + group], column, scale_dtype)
                scale[:, g] = s_new[:, 0]
                if zp is not None:
                    zp[:, g] = z_new[:, 0]
            if i == 0 or col_group[col - 1] != g or (not fixed and col % group == 0):
                s_col = scale[:, g].float()
                z_col = zp[:, g].float() if zp is not None else 0.0
            wc = w1[:, i]
            qc = torch.clamp(torch.round(wc / s_col + z_col), qmin, qmax)
            e = (wc - (qc - z_col) * s_col) / diag[i]
            w1[:, i:].addr_(e, u1[i, i:], alpha=-1.0)
            q1[:, i], err[:, i] = qc, e
        q[:, i1:i2] = q1.to(torch.int8)
        w[:, i2:].addmm_(err, u[i1:i2, i2:], alpha=-1.0)
    return QuantizedWeight(q[:, torch.argsort(perm)].contiguous(), scale, zp, scheme)
