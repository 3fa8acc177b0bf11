"""Round-to-nearest: min-max qparams per group, then round. The baseline every calibrated method must beat."""

from __future__ import annotations

import torch
from torch import Tensor

from quantkit.config import Scheme
from quantkit.quant.qparams import QuantizedWeight, minmax_qparams, quantize


def rtn(w: Tensor, scheme: Scheme, scale_dtype: torch.dtype) -> QuantizedWeight:
    """w [out, in] (any float dtype) -> QuantizedWeight with scales in `scale_dtype`."""
    scale, zp = minmax_qparams(w, scheme, scale_dtype)
    return QuantizedWeight(quantize(w, scale, zp, scheme), scale, zp, scheme)
