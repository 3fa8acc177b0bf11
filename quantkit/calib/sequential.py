"""Layer-by-layer quantization: one decoder layer in memory at a time, fed by the layer before it.

The walk captures the inputs of the first decoder layer once, then for each layer: collect what the
algorithm needs from those inputs (Hessians for GPTQ, activations for AWQ), quantize the layer's Linears
with the pure functions in `quant/`, and run the *quantized* layer to produce the next layer's inputs,
so each layer is calibrated on the errors the earlier ones really make. Keys and values are observed
after RoPE in that same pass, for the FP8 KV-cache scales.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from quantkit.arch import LLAMA, SHARED, Arch, MoE
from quantkit.config import Recipe, Scheme
from quantkit.kernels import fused as fused_kernels
from quantkit.memory import reuse_freed_memory, trim_heap
from quantkit.quant import awq
from quantkit.quant.apply import Target
from quantkit.quant.gptq import GPTQConfig, fill_lower, gptq
from quantkit.quant.kv_fp8 import absmax
from quantkit.quant.qparams import QuantizedWeight
from quantkit.quant.rtn import rtn

AWQ_ROWS = 4096  # calibration tokens kept per input for AWQ's searches
CLIP_ROWS = 512


@dataclass(slots=True)
class Batch:
    """The inputs of one decoder layer for a slice of the calibration rows."""

    hidden: Tensor  # [batch, seq, hidden]
    kwargs: dict  # position embeddings, mask, ...: exactly what the model passes to the layer being run
    by_kind: dict[str, dict] = field(default_factory=dict)  # those kwargs per kind of layer (Gemma's sliding-window
    # and full-attention layers get different masks and rope)

    def to_layer(self, layer: nn.Module) -> None:
        self.kwargs = self.by_kind.get(layer_kind(layer), self.kwargs)


def layer_kind(layer: nn.Module) -> str:
    """Which of the model's kinds of layer (Gemma's "sliding_attention" / "full_attention"), "all" where one kind.
    Older transformers name it on the decoder layer (`attention_type`), 5.x on its attention (`layer_type`)."""
    attn = getattr(layer, "self_attn", None)
    return getattr(layer, "attention_type", None) or getattr(attn, "layer_type", None) or "all"


@dataclass(slots=True)
class LayerResult:
    qweights: dict[str, QuantizedWeight]  # full module name -> quantized weight
    kv_absmax: dict[str, Tensor] = field(default_factory=dict)  # "k" / "v" -> [1] or [kv_heads]
    expert_tokens: list[int] | None = None  # a sparse layer's calibration tokens routed to each expert


class _Stop(Exception):
    pass


@torch.no_grad()
def first_layer_inputs(model: nn.Module, layers: nn.ModuleList, ids: Tensor, batch_size: int, device: str) -> list[Batch]:
    """Run the model's embedding (and mask/RoPE setup) on the calibration rows, up to the first layer of each
    kind: every layer is replaced by a stand-in that records its inputs and passes the hidden states on, and the
    run stops once each kind of layer has been seen."""
    kinds = {layer_kind(layer) for layer in layers}
    captured: list[Batch] = []

    class Grab(nn.Module):
        def __init__(self, kind: str):
            super().__init__()
            self.kind = kind

        def forward(self, hidden=None, *args, **kwargs):
            hidden = hidden if hidden is not None else kwargs.pop("hidden_states")
            kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "use_cache", "cache")}
            if not captured[-1].by_kind:
                captured[-1].hidden, captured[-1].kwargs = hidden, kwargs
            captured[-1].by_kind.setdefault(self.kind, kwargs)
            if len(captured[-1].by_kind) == len(kinds):
                raise _Stop
            return hidden

    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = Grab(layer_kind(layer))
    try:
        for chunk in ids.split(batch_size):
            captured.append(Batch(None, {}))
            try:
                model(input_ids=chunk.to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
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
        self.stats[name] = self.reduce(x.reshape(-1, x.shape[-1]), self.stats.get(name))

    def next_batch(self) -> None:
        self._seen.clear()

    def groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, owner in self.owner.items():
            out.setdefault(owner, []).append(name)
        return out


MID_ROWS = 2  # calibration rows per MLP intermediate: 5.8x the hidden size, three alive at once while it is made
HESSIAN_CHUNK = 1024  # tokens per float32 copy of a 16-bit input: 37 MB at the 1.5B's 8,960-wide down projection
HESSIAN_BLOCK = 1024  # features per block of the upper triangle: x^T x is symmetric, so ~40% of it is skipped


def _blocks(n: int) -> list[tuple[int, int]]:
    k = max(1, round(n / HESSIAN_BLOCK))
    step = -(-n // k)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _hessian(x: Tensor, acc: Tensor | None, bf16_products: bool | None = None) -> Tensor:
    """acc + x^T x [in, in] in float32, upper block triangle only (`fill_lower` completes it once, at the end).

    Products are summed in float32 throughout, as llm-compressor's are. A bf16 GEMM would be ~1.8x faster here,
    but PyTorch's rounds its output, each partial sum, to 8 bits of mantissa: on Qwen2.5-Coder-1.5B that left the
    down projections' Hessians indefinite at the usual damping, so they were solved with 10x more (a weaker
    correction). `bf16_products` (default: bf16 inputs on a CPU with AMX) has oneDNN multiply the float32 copies as
    bf16 with float32 sums and output: exact here, as every input already is a bf16 value, so only the order of
    the sums differs; 1.5-2x faster on AMX."""
    n = x.shape[-1]
    acc = torch.zeros(n, n, dtype=torch.float32, device=x.device) if acc is None else acc
    if bf16_products is None:
        bf16_products = x.dtype == torch.bfloat16 and x.device.type == "cpu" and fused_kernels.amx()
    blocks = _blocks(n)
    with _onednn_fp32_as_bf16(bf16_products):
        for chunk in x.split(HESSIAN_CHUNK):
            chunk = chunk.float()
            for i0, i1 in blocks:
                acc[i0:i1, i0:].addmm_(chunk[:, i0:i1].t(), chunk[:, i0:])  # rows i0:i1, diagonal to the right
    return acc


@contextmanager
def _onednn_fp32_as_bf16(on: bool) -> Iterator[None]:
    """oneDNN's float32 matmuls take their inputs as bf16 (sums and output stay float32) inside, if `on`."""
    if not on:
        yield
        return
    before = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before


def _rows(x: Tensor, acc: Tensor | None) -> Tensor:
    """Keep up to AWQ_ROWS calibration rows [n, in] (float32)."""
    x = x.float()
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


@torch.no_grad()
def quantize_awq(layer, local: dict, batches, schemes: dict[str, Scheme], dtype, arch: Arch) -> tuple[dict[str, QuantizedWeight], list[int] | None]:
    """Scale search and folding per mapping, then a clipping search per Linear, then RTN; a sparse block's experts
    by `_awq_experts`. Returns the quantized weights and a sparse layer's tokens per expert."""
    linears = {n: m for n, m in local.items() if isinstance(m, nn.Module)}
    rows = collect(layer, linears, batches, _rows)
    x_of = {n: rows.stats[rows.owner[n]] for n in linears}
    for m in arch.awq:
        balance = [linears.get(b) for b in m.balance]
        if any(b is None for b in balance):
            continue  # ignored modules, or a sparse layer's MLP (no dense gate/up/down)
        prev = layer.get_submodule(m.prev)
        feeding = _feeding_rows(prev, m.prev, balance[0].in_features) if isinstance(prev, nn.Linear) else None
        if isinstance(prev, nn.Linear) and feeding is None:
            continue  # v->o under grouped-query attention: v is narrower than o's input
        s, _ = awq.search_scale(x_of[m.balance[0]], [b.weight for b in balance], schemes[m.balance[0]], dtype)
        for b in balance:
            b.weight.mul_(s.to(b.weight.dtype))
        if isinstance(prev, nn.Linear):  # the output rows that feed the balance Linears, bias included (Qwen's v_proj)
            prev.weight[feeding].div_(s.to(prev.weight.dtype).unsqueeze(1))
            if prev.bias is not None:
                prev.bias[feeding].div_(s.to(prev.bias.dtype))
        else:  # a norm scaling by (offset + w): the folded scale is (offset + w) / s
            w = prev.weight.float()
            prev.weight.copy_((arch.norm_offset + w) / s.float() - arch.norm_offset)
    rows = collect(layer, linears, batches, _rows)  # inputs as the scaled layer now sees them
    out = {name: _clipped(name, module, rows.stats[rows.owner[name]], schemes[name], dtype) for name, module in linears.items()}
    tokens = _awq_experts(layer, local, batches, schemes, dtype, arch.moe, out) if is_sparse(layer) else None
    return out, tokens


def _clipped(name: str, module, x: Tensor, scheme: Scheme, dtype) -> QuantizedWeight:
    if name.endswith(awq.NO_CLIP):
        ratio = torch.ones(module.out_features, module.in_features // (scheme.group_size or module.in_features))
    else:
        ratio = awq.search_clip(module.weight, x[:CLIP_ROWS], scheme, dtype)
    return awq.rtn_clipped(module.weight, ratio.to(module.weight.device), scheme, dtype)


@torch.no_grad()
def _awq_experts(layer, local: dict, batches, schemes: dict[str, Scheme], dtype, moe: MoE, out: dict) -> list[int]:
    """Each expert on the tokens routed to it: its up -> down scales, then clipping. The norm before the block feeds
    every expert and the router, so no scale is folded into it (one scale would have to suit them all)."""
    mlp = layer.mlp
    r = routed(mlp, (_input_of(mlp, lambda b=b: layer(b.hidden, **b.kwargs)) for b in batches))
    n = mlp.experts.gate_up_proj.shape[0]
    for e in range(n):
        names = [moe.expert(e, j) for j in range(3)]
        x = r.inputs(e)[:AWQ_ROWS].float()
        mid = torch.cat(list(expert_mid(mlp.experts, e, x.to(mlp.experts.gate_up_proj.dtype)))).float()
        if all(name in local for name in names):
            up, down = local[names[1]], local[names[2]]
            s, _ = awq.search_scale(mid, [down.weight], schemes[names[2]], dtype)
            down.weight.mul_(s.to(down.weight.dtype))
            up.weight.div_(s.to(up.weight.dtype).unsqueeze(1))
            mid = mid / s
        for name, xin in zip(names, (x, x, mid)):
            if name in local:
                out[name] = _clipped(name, local[name], xin, schemes[name], dtype)
    return r.counts(n)


def _feeding_rows(prev: nn.Linear, name: str, width: int) -> slice | None:
    """The rows of a producing Linear that are its consumer's `width` inputs: all of them, the up half of a fused
    gate_up (gate first), or v of a fused qkv without grouped-query heads (v last); None when none are."""
    out = prev.out_features
    if out == width:
        return slice(None)
    if (name.endswith("gate_up_proj") and out == 2 * width) or (name.endswith("qkv_proj") and out == 3 * width):
        return slice(out - width, None)
    return None


def _rotary(layer: nn.Module):
    """The model family's own apply_rotary_pos_emb, from the module that defines the layer."""
    return sys.modules[type(layer).__module__].apply_rotary_pos_emb


class KVObserver:
    """Running absmax of one layer's keys (after k_norm and RoPE) and values, from k_proj/v_proj outputs.

    `batch` must hold the kwargs of the batch being run, for its position embeddings."""

    def __init__(self, layer: nn.Module, strategy: str | None):
        self.layer, self.strategy = layer, strategy
        self.amax: dict[str, Tensor] = {}
        self.batch: dict = {}
        self.handles = []

    def __enter__(self) -> KVObserver:
        if self.strategy:
            attn = self.layer.self_attn
            if hasattr(attn, "qkv_proj"):  # Phi-3: one Linear, q then k then v
                kv = attn.config.num_key_value_heads * attn.head_dim
                q = attn.qkv_proj.out_features - 2 * kv

                def split(m, a, o):
                    self.observe("k", o[..., q : q + kv])
                    self.observe("v", o[..., q + kv :])

                self.handles = [attn.qkv_proj.register_forward_hook(split)]
            else:
                self.handles = [attn.k_proj.register_forward_hook(lambda m, a, o: self.observe("k", o)),
                                attn.v_proj.register_forward_hook(lambda m, a, o: self.observe("v", o))]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def observe(self, kind: str, out: Tensor) -> None:
        attn = self.layer.self_attn
        b, s, _ = out.shape
        x = out.view(b, s, -1, attn.head_dim)
        if kind == "k" and hasattr(attn, "k_norm"):
            x = attn.k_norm(x)
        x = x.transpose(1, 2)  # [batch, kv_heads, seq, head_dim]
        if kind == "k":
            cos, sin = self.batch["position_embeddings"]
            x = _rotary(self.layer)(x, x, cos, sin)[1]
        a = absmax(x, self.strategy)
        self.amax[kind] = a if kind not in self.amax else torch.maximum(self.amax[kind], a)


@torch.no_grad()
def propagate(layer: nn.Module, batches: list[Batch], kv_strategy: str | None) -> tuple[list[Batch], dict[str, Tensor]]:
    """Run the (quantized) layer; returns the next layer's inputs and, if asked, post-RoPE K/V absmax."""
    outputs = []
    with KVObserver(layer, kv_strategy) as kv:
        for b in batches:
            kv.batch = b.kwargs
            outputs.append(Batch(_output(layer(b.hidden, **b.kwargs)), b.kwargs, b.by_kind))
    return outputs, kv.amax


@torch.no_grad()
def gptq_sequential(layer: nn.Module, local: dict[str, nn.Module], batches: list[Batch], recipe: Recipe,
                    schemes: dict[str, Scheme], dtype: torch.dtype, kv_strategy: str | None, arch: Arch):
    """GPTQ over one Llama-family layer. True sequential (the default): q/k/v, then o, gate/up and down, each
    from the outputs of the sublayers quantized before it. Otherwise (`recipe.true_sequential` False, as
    llm-compressor does) every Hessian comes from one pass of the dense layer and all are solved after it.

    Follows the decoder layer exactly: h = x + o(attn(ln1(x))); out = h + down(act(gate(ln2(h))) * up(ln2(h))), with
    the family's norm on each branch's output where it has one (Gemma: h = x + norm(o(...)), likewise the MLP's).
    Memory is what bounds a layer walk, so the batches are rewritten in place (x becomes h, then out) and the
    MLP's intermediate, 5.8x the hidden size, is never kept: it is computed a few rows at a time for the down projection's
    Hessian and again, from the quantized gate/up, for the outputs (one more gate/up GEMM a layer; a 1.5B model
    kept 1.2 GB of it in float32). Each Hessian is factored in its own buffer (no copy beside it).
    A sparse MLP block is quantized by `_gptq_sparse`.
    Returns (quantized weights, the next layer's inputs, K/V absmax, a sparse layer's tokens per expert)."""
    attn, mlp, sparse = layer.self_attn, layer.mlp, is_sparse(layer)
    mlp_norm = layer.get_submodule(arch.mlp_norm)
    attn_out, mlp_out = (layer.get_submodule(n) if n else nn.Identity() for n in (arch.attn_out_norm, arch.mlp_out_norm))
    cfg = GPTQConfig(block_size=recipe.block_size, damp=recipe.damp, actorder=recipe.actorder == "static")
    qweights: dict[str, QuantizedWeight] = {}
    qkv, o, gate_up, down = list(arch.qkv), ["self_attn.o_proj"], list(arch.gate_up), ["mlp.down_proj"]

    def hessian(xs: Iterable[Tensor], h: Tensor | None = None) -> Tensor:
        for x in xs:
            h = _hessian(x.reshape(-1, x.shape[-1]), h)
        return h

    def solve(names: list[str], h: Tensor) -> None:
        names = [n for n in names if n in local]
        if not names:
            return
        weights = [local[n].weight for n in names]
        trim_heap()  # the forwards' freed temporaries, before the solve's own peak
        stacked = gptq(torch.cat(weights), fill_lower(h), schemes[names[0]], dtype, cfg, overwrite_h=True)  # (one scheme a
        # solve: q/k/v and gate/up are budgeted as units, as the engines that fuse them need)
        for n, qw in zip(names, split_rows(stacked, [w.shape[0] for w in weights])):
            local[n].weight.copy_(qw.dequantize(local[n].weight.dtype))
            qweights[n] = qw

    def mid(x: Tensor) -> Iterator[Tensor]:  # the down projection's input, a few calibration rows at a time
        for piece in x.split(MID_ROWS):
            yield _input_of(mlp.down_proj, lambda: mlp(mlp_norm(piece)))

    def o_input(b: Batch) -> Tensor:  # o_proj's input for one batch, from the current q/k/v
        return _input_of(attn.o_proj, lambda: attn(hidden_states=layer.input_layernorm(b.hidden), **b.kwargs))

    if not recipe.true_sequential:  # every Hessian from the dense layer, one batch at a time
        hs: dict[str, Tensor | None] = dict.fromkeys(("qkv", "o", "gate_up", "down"))
        for b in batches:
            hs["qkv"] = hessian([layer.input_layernorm(b.hidden)], hs["qkv"])
            o_in = o_input(b)
            hs["o"] = hessian([o_in], hs["o"])
            if not sparse:
                h = b.hidden + attn_out(attn.o_proj(o_in))
                hs["gate_up"] = hessian([mlp_norm(h)], hs["gate_up"])
                hs["down"] = hessian(mid(h), hs["down"])
        for names, key in ((qkv, "qkv"), (o, "o"), (gate_up, "gate_up"), (down, "down")):
            if hs[key] is not None:
                solve(names, hs.pop(key))
    else:
        solve(qkv, hessian(layer.input_layernorm(b.hidden) for b in batches))
    with KVObserver(layer, kv_strategy) as kv:  # q/k/v are quantized by now
        o_in = []
        for b in batches:
            kv.batch = b.kwargs
            o_in.append(o_input(b))
    if recipe.true_sequential:
        solve(o, hessian(o_in))
    for b in batches:  # x -> h, in place: new hidden states would land on the heap reused inside this block and pin
        b.hidden.add_(attn_out(attn.o_proj(o_in.pop(0))))  # it across layers; each attention output freed as used
    if sparse:
        expert_tokens = _gptq_sparse(mlp, (mlp_norm(b.hidden) for b in batches), solve, hessian, arch.moe)
        for b in batches:  # h -> the layer's output
            b.hidden.add_(mlp_out(mlp(mlp_norm(b.hidden))))
        return qweights, batches, kv.amax, expert_tokens
    if recipe.true_sequential:
        solve(gate_up, hessian(mlp_norm(b.hidden) for b in batches))
        solve(down, hessian(m for b in batches for m in mid(b.hidden)))
    for b in batches:  # h -> the layer's output
        b.hidden.add_(mlp_out(torch.cat([mlp.down_proj(m) for m in mid(b.hidden)])))
    return qweights, batches, kv.amax, None


def _gptq_sparse(mlp: nn.Module, inputs: Iterable[Tensor], solve, hessian, moe: MoE) -> list[int]:
    """A sparse block, always sequentially: each expert's gate/up from the tokens the router sends it (see
    `Routed.inputs` for an expert sent too few), then its down from what its quantized gate/up make of them; the
    shared expert likewise from every token. The routers stay dense. Returns the tokens routed to each expert."""
    r = routed(mlp, inputs)
    experts = mlp.experts
    n = experts.gate_up_proj.shape[0]
    for e in range(n):
        x = r.inputs(e)
        solve([moe.expert(e, 0), moe.expert(e, 1)], hessian([x]))
        solve([moe.expert(e, 2)], hessian(expert_mid(experts, e, x)))
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        solve([f"{SHARED}.gate_proj", f"{SHARED}.up_proj"], hessian([r.x]))
        solve([f"{SHARED}.down_proj"], hessian(_input_of(shared.down_proj, lambda x=x: shared(x)) for x in r.x.split(EXPERT_CHUNK)))
    return r.counts(n)


def _input_of(module: nn.Module, run: Callable[[], object]) -> Tensor:
    """What `module` receives when `run()` reaches it; the run stops there (the caller applies `module` itself)."""
    got: list[Tensor] = []

    def grab(mod, args):
        got.append(args[0])
        raise _Stop

    handle = module.register_forward_pre_hook(grab)
    try:
        run()
    except _Stop:
        pass
    finally:
        handle.remove()
    return got[0]


MIN_EXPERT_TOKENS = 16  # an expert routed fewer calibration tokens is calibrated on all of its layer's tokens
EXPERT_CHUNK = 1024  # tokens per expert-intermediate computed at once


@dataclass(slots=True)
class Routed:
    """What a sparse block's experts received over every calibration row: the block's input and the router's picks."""

    x: Tensor  # [tokens, hidden]
    chosen: Tensor  # [tokens, top_k] expert ids

    def counts(self, experts: int) -> list[int]:
        return torch.bincount(self.chosen.reshape(-1), minlength=experts)[:experts].tolist()

    def inputs(self, e: int) -> Tensor:
        """Expert e's calibration inputs [n, hidden]: the tokens routed to it, or, when fewer than MIN_EXPERT_TOKENS
        were (a Hessian of rank < 16 says little about the weight), every token of the layer, as if all were."""
        rows = (self.chosen == e).any(-1)
        return self.x[rows] if int(rows.sum()) >= MIN_EXPERT_TOKENS else self.x


def routed(mlp: nn.Module, block_inputs: Iterable[Tensor]) -> Routed:
    """Run the router on each batch of the block's inputs [.., hidden] and record where it sends each token (the
    family's own routing: the experts' forward receives the picks; it is not run)."""
    xs, chosen = [], []

    def grab(module, args, kwargs):
        x, top = (list(args) + [kwargs.get("hidden_states"), kwargs.get("top_k_index")])[:2]
        xs.append(x.reshape(-1, x.shape[-1]))
        chosen.append(top)
        raise _Stop

    handle = mlp.experts.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for x in block_inputs:
            try:
                mlp(x)
            except _Stop:
                pass
    finally:
        handle.remove()
    return Routed(torch.cat(xs), torch.cat(chosen))


def expert_mid(experts: nn.Module, e: int, x: Tensor) -> Iterator[Tensor]:
    """Expert e's down-projection inputs act(gate(x)) * up(x), from its current (quantized) weights, by chunks."""
    for piece in x.split(EXPERT_CHUNK):
        gate, up = nn.functional.linear(piece, experts.gate_up_proj[e]).chunk(2, dim=-1)
        yield experts.act_fn(gate) * up


def is_sparse(layer: nn.Module) -> bool:
    return hasattr(layer.mlp, "experts")


@torch.no_grad()
def quantize_layer(layer: nn.Module, prefix: str, targets: list[Target], batches: list[Batch] | None,
                   recipe: Recipe, scale_dtype: torch.dtype, arch: Arch = LLAMA) -> tuple[LayerResult, list[Batch] | None]:
    """Quantize one decoder layer in place (weights become their fake-quantized values, in the precision
    a consumer dequantizes to) and return the quantized weights plus the next layer's inputs."""
    for b in batches or ():
        b.to_layer(layer)
    kv_strategy = recipe.kv_strategy if recipe.kv_cache else None
    local = {t.name.removeprefix(prefix + "."): t.module for t in targets}
    schemes = {t.name.removeprefix(prefix + "."): t.scheme or recipe.scheme() for t in targets}  # (a budget's mix, or one)
    if local and recipe.method == "gptq":
        with reuse_freed_memory():
            qweights, batches, kv, tokens = gptq_sequential(layer, local, batches, recipe, schemes, scale_dtype, kv_strategy, arch)
        return LayerResult({f"{prefix}.{n}": qw for n, qw in qweights.items()}, kv, tokens), batches
    tokens = None
    if not local:
        qweights = {}
    elif recipe.method == "awq":
        with reuse_freed_memory():
            qweights, tokens = quantize_awq(layer, local, batches, schemes, scale_dtype, arch)
    else:
        qweights = {n: rtn(m.weight, schemes[n], scale_dtype) for n, m in local.items()}
    for name, qw in qweights.items():
        local[name].weight.copy_(qw.dequantize(local[name].weight.dtype))
    result = LayerResult({f"{prefix}.{n}": qw for n, qw in qweights.items()}, expert_tokens=tokens)
    if batches is None:
        return result, None
    with reuse_freed_memory():
        batches, result.kv_absmax = propagate(layer, batches, kv_strategy)
    return result, batches
