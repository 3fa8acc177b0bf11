"""Linear layers over dense or compressed-tensors weights, repacked once at load for the chosen kernel.

Kernels: "reference" dequantizes on every call (the oracle), "dense" dequantizes once at load (fast for
large batches, no memory saving), "packed" keeps int4/int8 weights packed: with the fused CPU ops, quantkit's
own panel GEMM (kernels/csrc/panel_gemm.h) for bf16 activations on AVX-512 BF16 and for float32 activations on
every CPU (AVX2 + FMA or portable C++), else PyTorch's CPU integer matmuls where the shape allows, the reference
otherwise; "triton" (GPU) keeps the checkpoint's int32 packing and dequantizes inside a Triton GEMM, switching
to a dense copy above `TRITON_DENSE_ROWS` rows where the INT kernel loses to cuBLAS.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import Tensor, bfloat16, nn

from quantkit.formats.pack import int4_panels_from_words, pack_int8_panels, pack_int32, unpack_int32
from quantkit.kernels import cpu, reference
from quantkit.kernels import fused as fused_kernels
from quantkit.quant.qparams import dequantize
from quantkit.runtime.layers.panel_cache import PanelCache

KERNELS = ("packed", "dense", "reference", "triton")
TRITON_DENSE_ROWS = 64  # above this many rows a per-call dequantised weight and cuBLAS beat the INT GEMM
PACKED_MAX_ROWS = 32  # CPU: PyTorch's int4 kernel costs grow with rows; above this, dequantise per call and use a dense GEMM
INT8_PACKED_MAX_ROWS = 128  # likewise for its int8 op: parity at ~128 rows, 3.9x slower than dequantise + GEMM at 2048
Q8_GROUP = 64  # int8 activations: inputs per activation scale at most (longer weight groups split, scales repeated)
KERNEL_GROUP = 128  # the longest group the panel GEMM sums in one accumulator (see Linear)
F32_PANEL_MAX_ROWS = 32  # float32 panels: above this, the weight dequantised from its panels and oneDNN's sgemm
# bf16 panels on a CPU with AMX: above this, the weight dequantised to bf16 and oneDNN's AMX GEMM (one 1.5B layer at
# 512 rows: 714 ms on the panels, 103 in the AMX GEMM, plus the dequantisation). Without AMX the panels stay (the
# dense path is unmeasured there).
AMX_PANEL_MAX_ROWS = 64
EXACT_SLICE_ROWS = 8192  # rows of a dense bf16 weight cast to float32 at a time (50 MB at 1,536 wide)
# bf16 activations on a CPU without native bf16 dot products (AVX2): above this many rows a dense GEMM runs in float32
# on slices of the weight and is rounded back (a 1.5B gate/up at 512 rows, Zen 3: 1,562 ms emulated, 358 in float32;
# parity at 64 rows, the cast's cost dominating below)
EMULATED_BF16_MAX_ROWS = 64


@dataclass(slots=True)
class QuantWeight:
    """A quantized weight as the checkpoint holds it: compressed-tensors int32 words, unpacked to int8 values only
    when a kernel asks for them (the panel GEMM and Triton read the words directly, so loading a model never
    spends seconds on int8 copies they would not use)."""

    parts: tuple[Tensor, ...]  # int32 words [out_i, in * bits / 32] packed along the input dim (formats/pack.py), one per fused module
    in_features: int
    scale: Tensor  # [out, groups]
    zero_point: Tensor | None  # int8 [out, groups]
    bits: int
    group_size: int | None
    unpacked: Tensor | None = None  # int8 [out, in], once asked for

    @classmethod
    def of(cls, q: Tensor, scale: Tensor, zero_point: Tensor | None, bits: int, group_size: int | None) -> QuantWeight:
        """From signed int8 values [out, in]."""
        return cls((pack_int32(q, bits, dim=1),), q.shape[1], scale, zero_point, bits, group_size, q)

    @property
    def words(self) -> Tensor:  # int32 [out, in * bits / 32]: fused parts concatenated when first asked for (a start
        if len(self.parts) > 1:  # whose panels come from the panel cache never reads them)
            self.parts = (torch.cat(self.parts),)
        return self.parts[0]

    @property
    def q(self) -> Tensor:  # int8 [out, in], signed
        if self.unpacked is None:
            self.unpacked = unpack_int32(self.words, self.bits, self.in_features)
        return self.unpacked

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.in_features

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        return dequantize(self.q, self.scale, self.zero_point).to(dtype).contiguous()


class QuantRows(nn.Module):
    """An int8 embedding table, one scale per row or per group of a row: rows are dequantized as they are looked up,
    as compressed-tensors dequantizes them (q * scale in float32, rounded once to the compute dtype). Only the
    looked-up rows are unpacked from the checkpoint's words (mapped from the file): an int8 copy of the table would
    sit in memory beside the tied head's panels (233 MB on a 1.5B model's 151,936 x 1,536)."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype):
        super().__init__()
        self.words, self.scale, self.dtype = weight.words, weight.scale, dtype  # int32 [vocab, hidden / 4], [vocab, groups]
        self.bits, self.hidden = weight.bits, weight.in_features

    def __getitem__(self, ids: Tensor) -> Tensor:  # ids [T] -> [T, hidden]
        return dequantize(unpack_int32(self.words[ids], self.bits, self.hidden), self.scale[ids], None).to(self.dtype)


def fuse(weights: list[Tensor | QuantWeight]) -> Tensor | QuantWeight:
    """Concatenate along the output dimension (q/k/v, gate/up) so one matmul serves them all."""
    if len(weights) == 1:  # (already fused in the checkpoint: Phi-3)
        return weights[0]
    if all(isinstance(w, Tensor) for w in weights):
        return torch.cat(weights, dim=0)
    if not all(isinstance(w, QuantWeight) for w in weights) or len({(w.bits, w.group_size) for w in weights}) != 1:
        dense = [w.dequantize(torch.float32) if isinstance(w, QuantWeight) else w.float() for w in weights]
        return torch.cat(dense, dim=0)
    zps = [w.zero_point for w in weights]
    return QuantWeight(tuple(p for w in weights for p in w.parts), weights[0].in_features, torch.cat([w.scale for w in weights]),
                       None if any(z is None for z in zps) else torch.cat(zps), weights[0].bits, weights[0].group_size)


class Linear(nn.Module):
    """y = x W^T (+ b). Holds the weight in the layout its kernel reads."""

    def __init__(self, weight: Tensor | QuantWeight, bias: Tensor | None, dtype: torch.dtype, kernel: str = "packed",
                 fused: bool = False, head: bool = False, cache: PanelCache | None = None, name: str = "",
                 int8_activations: bool = False):
        """`head`: the lm_head, whose rows are few (prefill computes only the last positions' logits), so a dense bf16
        or int8 weight goes into the panel GEMM's layout too (fused CPU ops on AVX-512 BF16): 1.75x PyTorch's int8 op
        at one row. Not for other layers: on prefill-sized inputs oneDNN on a dense copy wins (int8 panels at 2,048
        rows of a 1.5B gate/up: 633 ms against 326 dequantised per call). `cache` and `name`: panels kept from an
        earlier start of this checkpoint (layers/panel_cache.py). `int8_activations`: int4 panels with float32
        activations multiply them quantised to int8 per group at up to F32_PANEL_MAX_ROWS rows (panel_q8.h)."""
        super().__init__()
        cache = cache or PanelCache(None)
        self.dtype, self.head = dtype, head
        self.bias = None if bias is None else bias.to(dtype)
        self.mode, self.int8_activations = "dense", False
        if (isinstance(weight, Tensor) and head and fused and bfloat16 in (dtype, weight.dtype)
                and _panels_fit(weight.shape, weight.shape[1], dtype)):
            # (float32 activations read the bf16 weight exactly; a float32 checkpoint's head would be rounded: not here)
            n, k = weight.shape
            self.mode = "bf16_panels"
            self.panels = cache.get(f"{name}.panels", lambda: _bf16_panels(weight))  # [n / 16, k / 2, 16, 2]
            self.params = torch.ones(1, n // 16, 1, 16)  # scale 1, no zero plane (zero 0)
            return
        if isinstance(weight, Tensor):
            self.weight = weight.to(dtype).contiguous()
            return
        out_features, in_features = weight.shape
        if kernel == "reference":
            self.mode, self.qw = "reference", weight
        elif kernel == "triton":
            self.mode, self.qw = "triton", weight
            self.words = weight.words  # [out, in * bits / 32]
            self.scale_t = weight.scale.to(dtype).contiguous()
        elif (kernel == "packed" and fused and (weight.bits == 4 or (weight.bits == 8 and (head or dtype == torch.float32)))
              and _panels_fit(weight.shape, weight.group_size or in_features, dtype)):
            self.mode, self.group = f"int{weight.bits}_panels", weight.group_size or in_features
            four = weight.bits == 4
            self.packed = cache.get(f"{name}.packed", lambda: _int4_panels(weight.words) if four  # [out / 16, in / 8, 64 or 128]
                                    else pack_int8_panels(weight.q))
            split = self.group > KERNEL_GROUP and self.group % KERNEL_GROUP == 0
            self.params = cache.get(f"{name}.params", lambda: _panel_params(weight, four, self.group // KERNEL_GROUP if split else 1))
            if split:
                # the kernels sum x * (bias + u) per group: longer groups (per-channel scales) split into groups of
                # KERNEL_GROUP with the scale repeated, so the sums stay short and the cancellation small
                self.group = KERNEL_GROUP
            self.int8_activations = int8_activations and four and dtype == torch.float32
            if self.int8_activations and self.group > Q8_GROUP:  # one activation scale per Q8_GROUP inputs or fewer:
                # the weight's scales repeated (a group is a multiple of 8, so some power of two divides it)
                part = next(p for p in (Q8_GROUP, 32, 16, 8) if self.group % p == 0)
                self.params = self.params.repeat_interleave(self.group // part, dim=2)
                self.group = part
        elif (kernel == "packed" and weight.bits == 4 and dtype != torch.float32
              and cpu.int4_supported(out_features, in_features, weight.group_size)):
            # (float32 engines dequantise once instead: PyTorch's int4 op with float32 activations costs 30x its
            # bfloat16 time at one row and grows linearly with rows -- 50 ms for a 32-row gate/up)
            self.mode = "int4"
            self.packed, self.scales_zeros, self.group = cpu.repack_int4(weight.q, weight.scale, weight.zero_point,
                                                                         weight.group_size, dtype)
            # for prefill-sized batches (see PACKED_MAX_ROWS): the checkpoint's own 4-bit packing, unpacked per call
            self.words, self.scale_t, self.zero_point = weight.words, weight.scale.to(dtype), weight.zero_point
        elif kernel == "packed" and weight.bits == 8 and cpu.int8_supported(weight.group_size, weight.zero_point is None):
            self.mode, self.q8, self.scale8 = "int8", weight.q.contiguous(), weight.scale[:, 0].to(dtype).contiguous()
        else:  # (int8 with groups or zero points in bf16, e.g. a budget's w6g64: a dense copy; int8 panels were measured
            # slower on AMX, prefill 0.64-0.83x and 16-row decode 0.79-0.88x on SmolLM2 W8 g64)
            self.weight = weight.dequantize(dtype)

    def forward(self, x: Tensor) -> Tensor:  # x [t, in] -> [t, out]
        if self.mode in ("int4_panels", "int8_panels") and x.shape[0] > panel_max_rows(x.dtype):
            # (a head is dequantised into a fresh tensor: kept, a 152k-row vocabulary would hold 0.5-0.9 GB for good)
            shape = (x.shape[1], self.packed.shape[0] * 16)  # [in, out]
            wt = torch.empty(shape, dtype=x.dtype) if self.head else _scratch(*shape, x.dtype)
            y = x @ fused_kernels.ops().panel_dequant_t(self.packed, self.params, self.group, out=wt)
        elif self.int8_activations:
            y = fused_kernels.ops().panel_gemm_q8(x, self.packed, self.params, self.group)
        elif self.mode in ("int4_panels", "int8_panels"):
            y = fused_kernels.ops().panel_gemm(x, self.packed, self.params, self.group)
        elif self.mode == "bf16_panels":
            y = fused_kernels.ops().panel_gemm(x, self.panels, self.params, x.shape[1])
        elif self.mode == "int4" and x.shape[0] > PACKED_MAX_ROWS:
            y = _dense_product(x, cpu.dequant_int4(self.words, self.scale_t, self.zero_point, x.shape[1], x.dtype))
        elif self.mode == "int4":
            y = cpu.int4_linear(x, self.packed, self.scales_zeros, self.group)
        elif self.mode == "int8" and x.shape[0] > INT8_PACKED_MAX_ROWS:
            y = _dense_product(x, cpu.dequant_int8(self.q8, self.scale8))
        elif self.mode == "int8":
            y = cpu.int8_linear(x, self.q8, self.scale8)
        elif self.mode == "triton" and x.shape[0] > TRITON_DENSE_ROWS:
            y = x @ self.qw.dequantize(x.dtype).T
        elif self.mode == "triton":
            from quantkit.kernels.triton.gemm import wqa16_linear

            y = wqa16_linear(x, self.words, self.scale_t, self.qw.zero_point, self.qw.bits, self.qw.shape[1])
        elif self.mode == "reference":
            y = reference.dequant_linear(x, self.qw.q, self.qw.scale, self.qw.zero_point)
        else:
            y = _dense_product(x, self.weight)
        return y if self.bias is None else y + self.bias

    def exact(self, x: Tensor) -> Tensor:  # x [t, in] -> float32 [t, out]
        """The product not rounded to the compute dtype, for scoring passes (perplexity, KL). bf16 logits are off
        by up to 1/256 of their size (0.06 at a logit of 16), which on SmolLM2 adds ~0.001 nats to every KL
        between two bf16 models, a fifth of W8's whole KL. The panel kernels read float32 activations against
        the same bf16 or int panels and sum in float32 (about the bf16 kernel's time at 512 rows); a dense
        weight is cast a slice of rows at a time, so a 152k-row head never has a float32 copy."""
        if self.mode in ("bf16_panels", "int4_panels", "int8_panels"):
            return self(x.float()).float()
        if self.mode != "dense":
            return self(x).float()  # (the int4/int8 PyTorch ops, Triton and the reference: their own rounding)
        y = _float32_product(x, self.weight)
        return y if self.bias is None else y + self.bias.float()

    def rows(self, ids: Tensor) -> Tensor:
        """Rows of a dense weight (a tied lm_head serving as the embedding): ids [T] -> [T, in]."""
        if self.mode == "bf16_panels":
            return self.panels[ids // 16, :, ids % 16, :].reshape(len(ids), -1).to(self.dtype)
        return self.weight[ids]


def _dense_product(x: Tensor, w: Tensor) -> Tensor:  # x [t, in], w [out, in] -> [t, out] in x's dtype
    """x W^T. Where bf16 GEMMs are emulated (a CPU without AVX512_BF16 or AMX: `quantkit eval`'s bf16 default there)
    and the rows are many, the product in float32 rounded to bf16: what the emulation computes (it too sums in
    float32; the two differ in ~0.02% of outputs by one rounding step), at 4.4x its speed on a prefill."""
    if (x.dtype == bfloat16 and x.shape[0] > EMULATED_BF16_MAX_ROWS and x.device.type == "cpu"
            and not fused_kernels.native_bf16()):
        return _float32_product(x, w).to(bfloat16)
    return x @ w.T


def _float32_product(x: Tensor, w: Tensor) -> Tensor:  # x [t, in], w [out, in] -> float32 [t, out]
    """x W^T summed in float32, the weight cast a slice of rows at a time: a 152k-row head never has a float32 copy."""
    x, step = x.float(), EXACT_SLICE_ROWS
    return torch.cat([x @ w[i : i + step].float().T for i in range(0, w.shape[0], step)], dim=1)


def panel_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which int4/int8 panels run the panel GEMM; above, the weight is dequantised for oneDNN's GEMM."""
    if dtype == torch.float32:
        return F32_PANEL_MAX_ROWS
    return AMX_PANEL_MAX_ROWS if dtype == torch.bfloat16 and fused_kernels.amx() else 1 << 30


_SCRATCH: dict[tuple[int, int, torch.dtype, int], Tensor] = {}


def _scratch(k: int, n: int, dtype: torch.dtype) -> Tensor:
    """One dequantisation buffer per shape (and thread), reused by every layer in turn (each GEMM finishes before
    the next dequantises): no fresh 80 MB tensor, and its page faults, per call. Buffers of finished threads stay."""
    key = (k, n, dtype, threading.get_ident())
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty(k, n, dtype=dtype)
    return _SCRATCH[key]


def _int4_panels(words: Tensor) -> Tensor:
    """The int4 panels of checkpoint words: in one C++ pass when the kernels are loaded (or only need loading),
    else (a first-ever build still compiling) through PyTorch ops, ~10x slower: the same bytes."""
    ops = fused_kernels.loaded()
    return ops.panel_pack_int4(words) if ops is not None else int4_panels_from_words(words)


def _panel_params(weight: QuantWeight, four: bool, repeat: int) -> Tensor:
    """Scales (and, for asymmetric weights, 136 or 2304 + zero point) per group, panel-major: [planes, out / 16,
    groups * repeat, 16]. Symmetric weights carry the scales alone (every zero is the kernel's constant, and not
    read); see panel_gemm.h."""
    scale = weight.scale.float()  # [out, groups]
    planes = [scale] if weight.zero_point is None else [scale, (136.0 if four else 2304.0) + weight.zero_point.float()]
    params = torch.stack(planes).repeat_interleave(repeat, dim=2)  # [1 or 2, out, groups * repeat]
    return params.view(len(planes), weight.shape[0] // 16, 16, -1).transpose(2, 3).contiguous()


def _bf16_panels(weight: Tensor) -> Tensor:
    """[n, k] -> bf16 panels [n / 16, k / 2, 16, 2]: moved as int32 pairs, 2.4x faster than the same transpose of
    bf16 pairs (0.13 against 0.32 s for the 1.5B's 0.47 GB tied head, most of its repack at load)."""
    n, k = weight.shape
    pairs = weight.to(bfloat16).contiguous().view(torch.int32).view(n // 16, 16, k // 2)
    return pairs.transpose(1, 2).contiguous().view(bfloat16).view(n // 16, k // 2, 16, 2)


def _panels_fit(shape: tuple[int, int], group: int, dtype: torch.dtype) -> bool:
    """Activations the built kernels take (float32 anywhere, bf16 on AVX-512 BF16), 16-channel panels, groups of a
    multiple of 8 dividing the row (the kernel reads four pairs of inputs a load)."""
    out_features, in_features = shape
    return (out_features % 16 == 0 and group % 8 == 0 and in_features % group == 0
            and str(dtype).removeprefix("torch.") in fused_kernels.panel_dtypes())


def to_device(module: nn.Module, device: str) -> None:
    """Move the plain tensor attributes (and quantized weights) of every submodule to `device`."""
    for m in module.modules():
        for name, value in list(vars(m).items()):
            if isinstance(value, Tensor):
                setattr(m, name, value.to(device))
            elif isinstance(value, QuantWeight):
                zp = None if value.zero_point is None else value.zero_point.to(device)
                setattr(m, name, QuantWeight((value.words.to(device),), value.in_features, value.scale.to(device), zp, value.bits,
                                             value.group_size))
