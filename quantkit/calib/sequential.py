"""Layer-by-layer quantization: one decoder layer in memory at a time, fed by the layer before it.

The walk captures the inputs of the first decoder layer once, then for each layer: collect what the
algorithm needs from those inputs (Hessians for GPTQ, activations for AWQ), quantize the layer's Linears
with the pure functions in `quant/`, and run the *quantized* layer to produce the next layer's inputs,
so each layer is calibrated on the errors the earlier ones really make. Keys and values are observed
after RoPE in that same pass, for the FP8 KV-cache scales.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from quantkit.config import Recipe, Scheme
from quantkit.quant import awq
from quantkit.quant.apply import Target
from quantkit.quant.gptq import GPTQConfig, gptq
from quantkit.quant.kv_fp8 import absmax
from quantkit.quant.qparams import QuantizedWeight
from quantkit.quant.rtn import rtn

AWQ_ROWS = 4096  # calibration tokens kept per input for AWQ's searches
CLIP_ROWS = 512


@dataclass(slots=True)
class Batch:
    """The inputs of one decoder layer for a slice of the calibration rows."""

    hidden: Tensor  # [batch, seq, hidden]
    kwargs: dict  # position embeddings, mask, ...: exactly what the model passes to its layers


@dataclass(slots=True)
class LayerResult:
    qweights: dict[str, QuantizedWeight]  # full module name -> quantized weight
    kv_absmax: dict[str, Tensor] = field(default_factory=dict)  # "k" / "v" -> [1] or [kv_heads]


class _Stop(Exception):
    pass


@torch.no_grad()
def first_layer_inputs(model: nn.Module, layers: nn.ModuleList, ids: Tensor, batch_size: int, device: str) -> list[Batch]:
    """Run the model's embedding (and mask/RoPE setup) on the calibration rows; stop at layer 0."""
    captured: list[Batch] = []

    def grab(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "use_cache")}
        captured.append(Batch(hidden, kwargs))
        raise _Stop

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for chunk in ids.split(batch_size):
            try:
                model(input_ids=chunk.to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return captured


def _output(out) -> Tensor:
    return out[0] if isinstance(out, tuple) else out


@contextmanager
def input_hooks(modules: dict[str, nn.Module], fn: Callable[[str, Tensor], None]) -> Iterator[None]:
    handles = [m.register_forward_hook(lambda mod, args, out, n=n: fn(n, args[0])) for n, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class SharedInputs:
    """Collects per-module statistics once per distinct input tensor: q/k/v (and gate/up) read the same
    activations, so they share one Hessian, and GPTQ can solve them together as one stacked weight."""

    def __init__(self, reduce: Callable[[Tensor, Tensor | None], Tensor]):
        self.reduce = reduce
        self.stats: dict[str, Tensor] = {}
        self.owner: dict[str, str] = {}  # module -> the module whose stats it shares
        # Inputs seen in this batch, kept alive so a freed tensor's address is never mistaken for another's.
        self._seen: dict[int, tuple[str, Tensor]] = {}

    def add(self, name: str, x: Tensor) -> None:
        key = x.data_ptr()
        if key in self._seen:
            self.owner[name] = self._seen[key][0]
            return
        self._seen[key] = (name, x)
        self.owner[name] = name
        self.stats[name] = self.reduce(x.reshape(-1, x.shape[-1]).float(), self.stats.get(name))

    def next_batch(self) -> None:
        self._seen.clear()

    def groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, owner in self.owner.items():
            out.setdefault(owner, []).append(name)
        return out


def _hessian(x: Tensor, acc: Tensor | None) -> Tensor:
    h = x.t() @ x  # [in, in]
    return h if acc is None else acc + h


def _rows(x: Tensor, acc: Tensor | None) -> Tensor:
    """Keep up to AWQ_ROWS calibration rows [n, in]."""
    acc = x if acc is None else torch.cat([acc, x[: max(0, AWQ_ROWS - acc.shape[0])]])
    return acc[:AWQ_ROWS]


@torch.no_grad()
def collect(layer: nn.Module, modules: dict[str, nn.Module], batches: list[Batch], reduce) -> SharedInputs:
    stats = SharedInputs(reduce)
    with input_hooks(modules, stats.add):
        for b in batches:
            layer(b.hidden, **b.kwargs)
            stats.next_batch()
    return stats


def split_rows(qw: QuantizedWeight, sizes: list[int]) -> list[QuantizedWeight]:
    """Undo the stacking of Linears that were quantized together (rows are independent)."""
    zps = qw.zero_point.split(sizes) if qw.zero_point is not None else [None] * len(sizes)
    return [QuantizedWeight(q, s, z, qw.scheme) for q, s, z in zip(qw.q.split(sizes), qw.scale.split(sizes), zps)]


def quantize_gptq(layer, local: dict[str, nn.Module], batches, recipe: Recipe, scheme: Scheme, dtype) -> dict[str, QuantizedWeight]:
    stats = collect(layer, local, batches, _hessian)
    cfg = GPTQConfig(block_size=recipe.block_size, damp=recipe.damp, actorder=recipe.actorder == "static")
    out = {}
    for owner, names in stats.groups().items():
        weights = [local[n].weight for n in names]
        stacked = gptq(torch.cat(weights), stats.stats[owner], scheme, dtype, cfg)
        out.update(zip(names, split_rows(stacked, [w.shape[0] for w in weights])))
    return out


@torch.no_grad()
def quantize_awq(layer, local: dict[str, nn.Module], batches, scheme: Scheme, dtype) -> dict[str, QuantizedWeight]:
    """Scale search and folding per mapping, then a clipping search per Linear, then RTN."""
    rows = collect(layer, local, batches, _rows)
    x_of = {n: rows.stats[rows.owner[n]] for n in local}
    for m in awq.LLAMA_MAPPINGS:
        prev = layer.get_submodule(m.prev)
        balance = [local.get(b) for b in m.balance]
        if any(b is None for b in balance) or (isinstance(prev, nn.Linear) and prev.out_features != balance[0].in_features):
            continue  # ignored modules, or v->o under grouped-query attention
        s, _ = awq.search_scale(x_of[m.balance[0]], [b.weight for b in balance], scheme, dtype)
        for b in balance:
            b.weight.mul_(s.to(b.weight.dtype))
        if isinstance(prev, nn.Linear):
            prev.weight.div_(s.to(prev.weight.dtype).unsqueeze(1))
        else:
            prev.weight.div_(s.to(prev.weight.dtype))
    rows = collect(layer, local, batches, _rows)  # inputs as the scaled layer now sees them
    out = {}
    for name, module in local.items():
        x = rows.stats[rows.owner[name]][:CLIP_ROWS]
        if name.endswith(awq.NO_CLIP):
            ratio = torch.ones(module.out_features, module.in_features // (scheme.group_size or module.in_features))
        else:
            ratio = awq.search_clip(module.weight, x, scheme, dtype)
        out[name] = awq.rtn_clipped(module.weight, ratio.to(module.weight.device), scheme, dtype)
    return out


def _rotary(layer: nn.Module):
    """The model family's own apply_rotary_pos_emb, from the module that defines the layer."""
    return sys.modules[type(layer).__module__].apply_rotary_pos_emb


@torch.no_grad()
def propagate(layer: nn.Module, batches: list[Batch], kv_strategy: str | None) -> tuple[list[Batch], dict[str, Tensor]]:
    """Run the (quantized) layer; returns the next layer's inputs and, if asked, post-RoPE K/V absmax."""
    attn = layer.self_attn
    amax: dict[str, Tensor] = {}
    current: dict = {}

    def observe(kind: str, out: Tensor) -> None:
        b, s, _ = out.shape
        x = out.view(b, s, -1, attn.head_dim)
        if kind == "k" and hasattr(attn, "k_norm"):
            x = attn.k_norm(x)
        x = x.transpose(1, 2)  # [batch, kv_heads, seq, head_dim]
        if kind == "k":
            cos, sin = current["position_embeddings"]
            x = _rotary(layer)(x, x, cos, sin)[1]
        a = absmax(x, kv_strategy)
        amax[kind] = a if kind not in amax else torch.maximum(amax[kind], a)

    handles = []
    if kv_strategy:
        handles = [attn.k_proj.register_forward_hook(lambda m, a, o: observe("k", o)),
                   attn.v_proj.register_forward_hook(lambda m, a, o: observe("v", o))]
    try:
        outputs = []
        for b in batches:
            current.clear()
            current.update(b.kwargs)
            outputs.append(Batch(_output(layer(b.hidden, **b.kwargs)), b.kwargs))
    finally:
        for h in handles:
            h.remove()
    return outputs, amax


@torch.no_grad()
def quantize_layer(layer: nn.Module, prefix: str, targets: list[Target], batches: list[Batch] | None,
                   recipe: Recipe, scale_dtype: torch.dtype) -> tuple[LayerResult, list[Batch] | None]:
    """Quantize one decoder layer in place (weights become their fake-quantized values, in the precision
    a consumer dequantizes to) and return the quantized weights plus the next layer's inputs."""
    scheme = recipe.scheme()
    local = {t.name.removeprefix(prefix + "."): t.module for t in targets}
    if scheme is None:
        qweights = {}
    elif recipe.method == "gptq":
        qweights = quantize_gptq(layer, local, batches, recipe, scheme, scale_dtype)
    elif recipe.method == "awq":
        qweights = quantize_awq(layer, local, batches, scheme, scale_dtype)
    else:
        qweights = {n: rtn(m.weight, scheme, scale_dtype) for n, m in local.items()}
    for name, qw in qweights.items():
        local[name].weight.copy_(qw.dequantize(local[name].weight.dtype))
    result = LayerResult({f"{prefix}.{n}": qw for n, qw in qweights.items()})
    if batches is None:
        return result, None
    batches, result.kv_absmax = propagate(layer, batches, recipe.kv_strategy if recipe.kv_cache else None)
    return result, batches
