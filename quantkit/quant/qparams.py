"""Min-max quantization parameters, quantize and dequantize: the integer math every algorithm shares.

Conventions match compressed-tensors exactly: signed integers in [qmin, qmax] (4-bit: [-8, 7]);
symmetric scale = absmax / ((qmax - qmin) / 2), i.e. absmax / 7.5 at 4 bits; asymmetric
zero point = round(qmin - min / scale); zero is always representable; w = (q - zp) * scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quantkit.config import Scheme


@dataclass(slots=True)
class QuantizedWeight:
    """A quantized Linear weight in the generic layout: q int8 [out, in], scale/zero_point [out, groups]."""

    q: Tensor
    scale: Tensor
    zero_point: Tensor | None
    scheme: Scheme

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight a consumer reconstructs, rounded once to `dtype` (default: the scale's dtype)."""
        return dequantize(self.q, self.scale, self.zero_point).to(dtype or self.scale.dtype)


def grouped(w: Tensor, group_size: int | None) -> Tensor:
    """[out, in] -> [out, groups, group_size]; per-channel is one group spanning the whole row."""
    out_features, in_features = w.shape
    size = in_features if group_size is None else group_size
    if in_features % size:
        raise ValueError(f"group size {size} does not divide input width {in_features}")
    return w.reshape(out_features, in_features // size, size)


def minmax_qparams(w: Tensor, scheme: Scheme, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """Scale [out, groups] in `scale_dtype` and zero point int8 [out, groups] (None when symmetric)."""
    g = grouped(w.float(), scheme.group_size)
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)
    span = float(scheme.qmax - scheme.qmin)
    raw = torch.maximum(-lo, hi) / (span / 2) if scheme.symmetric else (hi - lo) / span
    scale = _nonzero(raw, scale_dtype).to(scale_dtype)
    if scheme.symmetric:
        return scale, None
    zp = torch.round(scheme.qmin - lo / scale.float()).clamp(scheme.qmin, scheme.qmax)
    return scale, zp.to(torch.int8)


def _nonzero(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """An all-zero group gets the dtype's eps as scale (as compressed-tensors does) so nothing divides by 0."""
    return torch.where(scale == 0, torch.full_like(scale, torch.finfo(dtype).eps), scale)


def quantize(w: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: Scheme) -> Tensor:
    """w [out, in] -> q int8 [out, in] against the given (already dtype-rounded) qparams."""
    g = grouped(w.float(), scheme.group_size)  # [out, groups, size]
    x = g / scale.float().unsqueeze(-1)
    if zero_point is not None:
        x = x + zero_point.float().unsqueeze(-1)
    q = torch.round(x).clamp(scheme.qmin, scheme.qmax)
    return q.to(torch.int8).reshape(w.shape)


def dequantize(q: Tensor, scale: Tensor, zero_point: Tensor | None) -> Tensor:
    """q int8 [out, in] -> float32 [out, in]; the group size follows from scale's shape.

    Computed in float32: (q - zp) * scale is exact there, so casting the result to the scale's dtype
    gives bit-for-bit what a consumer computing in that dtype gets.
    """
    out_features, in_features = q.shape
    groups = scale.shape[-1]
    g = q.float().reshape(out_features, groups, in_features // groups)
    if zero_point is not None:
        g = g - zero_point.float().unsqueeze(-1)
    return (g * scale.float().unsqueeze(-1)).reshape(out_features, in_features)
