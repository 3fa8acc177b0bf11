"""Decoder-only models on the runtime's layers: the Llama family (Llama 2/3, Mistral, Qwen2 with q/k/v bias, Qwen3
with q/k norms, SmolLM) and the families whose differences quantkit/arch.py describes (Gemma 3, Phi-3): one layer
class reads the description, none is copied per family.

Weights come from a dense HF checkpoint or a compressed-tensors one; q/k/v and gate/up are fused into one
Linear each at load (one matmul instead of three or two: at batch 1 on CPU each call costs ~55 µs of overhead).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from quantkit import QuantkitError
from quantkit.arch import ARCHS, SHARED, Arch, arch_of
from quantkit.config import KERNEL_BITS
from quantkit.formats.load import (
    PACKED,
    packed_module,
    quant_config_of,
    read_tensors,
    scheme_for,
    unpacked_module,
)
from quantkit.kernels import fused as fused_kernels
from quantkit.runtime.kv_cache import KVCache
from quantkit.runtime.layers.attention import Batch, paged_attention
from quantkit.runtime.layers.basic import RMSNorm, Rotary, gelu_tanh_mul, rotate_heads, silu_mul
from quantkit.runtime.layers.decoder import FusedDecoder
from quantkit.runtime.layers.linear import Linear, QuantRows, QuantWeight, fuse, to_device
from quantkit.runtime.layers.moe import Routing, SparseMLP
from quantkit.runtime.layers.panel_cache import PanelCache


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    intermediate_size: int
    kinds: list[str]  # per layer: "full_attention" or "sliding_attention" (its own rope and a window)
    windows: list[int]  # per layer: keys a query sees (0: all)
    query_scale: float  # queries times this before attention's 1 / sqrt(head_dim) (Gemma's query_pre_attn_scalar)
    final_softcap: float  # logits = cap * tanh(logits / cap) when set (0: none)
    sparse: list[bool]  # per layer: a routed mixture-of-experts MLP (arch.MoE)
    experts: int = 0
    expert_inter: int = 0  # an expert's intermediate width
    shared_inter: int = 0  # Qwen2-MoE's shared expert's (0: none)
    routing: Routing | None = None

    @classmethod
    def from_hf(cls, c: dict, arch: Arch) -> ModelConfig:
        heads, n = c["num_attention_heads"], c["num_hidden_layers"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        kinds = list(c.get("layer_types") or ["full_attention"] * n)
        window = c.get("sliding_window") or 0
        if not window or c.get("use_sliding_window") is False:
            windows = [0] * n
        elif c.get("layer_types"):
            windows = [window if k == "sliding_attention" else 0 for k in kinds]
        else:  # Mistral: one window for every layer
            windows = [window] * n
        scalar = c.get("query_pre_attn_scalar") or head_dim
        moe = arch.moe
        sparse = moe.layers(c) if moe else [False] * n
        return cls(c["vocab_size"], c["hidden_size"], n, heads, c.get("num_key_value_heads") or heads, head_dim,
                   c.get("rms_norm_eps", 1e-6), c.get("max_position_embeddings", 2048), bool(c.get("tie_word_embeddings", False)),
                   c["intermediate_size"], kinds, windows, (head_dim / scalar) ** 0.5, float(c.get("final_logit_softcapping") or 0.0),
                   sparse, *((moe.experts(c), c[moe.inter_key], c.get("shared_expert_intermediate_size") or 0,
                              Routing(c["num_experts_per_tok"], moe.normalises(c))) if any(sparse) else ()))


class Weights:
    """Checkpoint tensors by module name: dense tensors or `QuantWeight`s unpacked from compressed-tensors."""

    def __init__(self, path: Path):
        self.tensors = read_tensors(path)
        self.quant_config = quant_config_of(path) or {}

    def linear(self, module: str) -> Tensor | QuantWeight:
        if module + PACKED in self.tensors:
            scheme = scheme_for(module, self.quant_config)
            if scheme.bits not in KERNEL_BITS:  # 5/6 bits: the same values and scales, read as int8 weights
                return QuantWeight.of(*unpacked_module(self.tensors, module, scheme), 8, scheme.group_size)
            words, in_features, scale, zp = packed_module(self.tensors, module, scheme)
            return QuantWeight((words,), in_features, scale, zp, scheme.bits, scheme.group_size)
        return self.tensor(f"{module}.weight")

    def tensor(self, name: str) -> Tensor:
        if name not in self.tensors:
            raise QuantkitError(f"checkpoint has no tensor {name}")
        return self.tensors[name]

    def get(self, name: str) -> Tensor | None:
        return self.tensors.get(name)


def _checked(w: Weights, modules: list[str], shape: tuple[int, int]) -> Tensor | QuantWeight:
    """The Linear `modules` (fused along the output when several) as the checkpoint holds them; at odds with the
    config.json's shape: one line naming the tensors."""
    weight = fuse([w.linear(m) for m in modules])
    if tuple(weight.shape) != shape:
        raise QuantkitError(f"{' + '.join(modules)}: shape {list(weight.shape)} in the checkpoint; its config.json "
                            f"makes it {list(shape)}")
    return weight


class DecoderLayer(nn.Module):
    def __init__(self, w: Weights, i: int, cfg: ModelConfig, arch: Arch, dtype: torch.dtype, kernel: str, fused: bool,
                 cache: PanelCache, activations: str = "float"):
        super().__init__()
        p = f"model.layers.{i}"
        self.index, self.cfg, self.kernel, self.fused = i, cfg, kernel, fused
        self.kind, self.window = cfg.kinds[i], cfg.windows[i]
        h, d, heads, kv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        linear = lambda names, shape, tag, bias=None: Linear(_checked(w, [f"{p}.{n}" for n in names], shape), bias, dtype,
                                                              kernel, fused, cache=cache, name=f"{p}.{tag}",
                                                              int8_activations=activations == "int8")
        biases = [w.get(f"{p}.{m}.bias") for m in arch.qkv]
        self.qkv = linear(arch.qkv, ((heads + 2 * kv) * d, h), "qkv", torch.cat(biases) if all(b is not None for b in biases) else None)
        self.o = linear(["self_attn.o_proj"], (h, heads * d), "o", w.get(f"{p}.self_attn.o_proj.bias"))
        act = (lambda x: silu_mul(x, fused)) if arch.activation == "silu" else gelu_tanh_mul
        self.moe = None
        if cfg.sparse[i]:  # experts (gate and up fused), the router and Qwen2-MoE's shared expert, from the family's names
            moe, inter = arch.moe, cfg.expert_inter
            experts = [(linear([moe.expert(e, 0), moe.expert(e, 1)], (2 * inter, h), f"experts.{e}.gate_up"),
                        linear([moe.expert(e, 2)], (h, inter), f"experts.{e}.down")) for e in range(cfg.experts)]
            router = Linear(_checked(w, [f"{p}.{moe.block}.gate"], (cfg.experts, h)), None, dtype, "dense")
            shared = None
            if cfg.shared_inter:
                s = cfg.shared_inter
                shared = (linear([f"{SHARED}.gate_proj", f"{SHARED}.up_proj"], (2 * s, h), "shared.gate_up"),
                          linear([f"{SHARED}.down_proj"], (h, s), "shared.down"),
                          Linear(_checked(w, [f"{p}.{SHARED}_gate"], (1, h)), None, dtype, "dense"))
            self.moe = SparseMLP(router, experts, cfg.routing, act, shared)
        else:
            self.gate_up = linear(arch.gate_up, (2 * cfg.intermediate_size, h), "gate_up")
            self.down = linear(["mlp.down_proj"], (h, cfg.intermediate_size), "down")
        self.act = act
        norm = lambda name: RMSNorm(w.tensor(f"{p}.{name}.weight"), cfg.rms_norm_eps, dtype, fused, arch.norm_offset)
        self.input_norm, self.post_norm = norm("input_layernorm"), norm(arch.mlp_norm)  # post_norm: the MLP's input norm
        self.attn_out_norm = norm(arch.attn_out_norm) if arch.attn_out_norm else None
        self.mlp_out_norm = norm(arch.mlp_out_norm) if arch.mlp_out_norm else None
        qn, kn = w.get(f"{p}.self_attn.q_norm.weight"), w.get(f"{p}.self_attn.k_norm.weight")
        self.q_norm = None if qn is None else RMSNorm(qn, cfg.rms_norm_eps, dtype, fused, arch.norm_offset)
        self.k_norm = None if kn is None else RMSNorm(kn, cfg.rms_norm_eps, dtype, fused, arch.norm_offset)

    def forward(self, x: Tensor, rope: dict[str, tuple[Tensor, Tensor]], batch: Batch, cache: KVCache) -> Tensor:  # x [T, hidden]
        cfg, t = self.cfg, x.shape[0]
        h = self.input_norm(x)
        heads = cfg.num_heads + 2 * cfg.num_kv_heads
        qkv = self.qkv(h).view(t, heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k, v = qkv.split([cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], dim=1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=1)
        qk = rotate_heads(qkv, heads - cfg.num_kv_heads, *rope[self.kind], self.fused)  # queries and keys rotated in one pass
        q, k, v = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :], qkv[:, heads - cfg.num_kv_heads :]
        if cfg.query_scale != 1.0:
            q = q * cfg.query_scale
        placed = batch.windowed if self.window and batch.windowed is not None else batch  # (a ring, for a window)
        a = paged_attention(self.index, q, k, v, placed, cache, self.kernel, self.fused, self.window)
        o = self.o(a.reshape(t, -1))
        if self.attn_out_norm is None:
            x, h = self.post_norm.add(x, o)
        else:
            x = x + self.attn_out_norm(o)
            h = self.post_norm(x)
        m = self.moe(h) if self.moe is not None else self.down(self.act(self.gate_up(h)))
        return x + (m if self.mlp_out_norm is None else self.mlp_out_norm(m))


class LlamaModel(nn.Module):
    def __init__(self, path: Path, dtype: torch.dtype, kernel: str = "packed", device: str = "cpu", lm_head: str = "auto",
                 fused: bool = True, activations: str = "float"):
        super().__init__()
        hf = json.loads((path / "config.json").read_text())
        arch = arch_of(hf, path)
        if not set(hf.get("architectures") or []) & set(arch.classes):
            classes = ", ".join(c for a in ARCHS for c in a.classes)
            raise QuantkitError(f"the runtime runs {classes}; {path} is {hf.get('architectures')}")
        if hf.get("attn_logit_softcapping"):
            raise QuantkitError(f"{path}: attention logit soft-capping (Gemma 2) is not supported by the runtime")
        self.cfg = cfg = ModelConfig.from_hf(hf, arch)
        self.arch = arch
        self.dtype = dtype
        # the fused CPU ops serve the CPU kernels; "reference" stays pure PyTorch (the oracle), the GPU has Triton.
        # Expected, not waited for: a first-ever build compiles while the weights load (fused_kernels.prepare)
        self.fused = fused and kernel in ("packed", "dense") and device == "cpu" and fused_kernels.expected()
        predicted = fused_kernels.panel_dtypes() if self.fused else ()
        t1 = time.perf_counter()
        w = Weights(path)
        cache = (PanelCache.of(path, {"dtype": dtype, "kernel": kernel, "lm_head": lm_head, "panels": predicted})
                 if self.fused else PanelCache(None))
        t2 = time.perf_counter()
        embed = w.linear("model.embed_tokens")  # dense, or int8 rows (quantize --embeddings w8)
        if isinstance(embed, QuantWeight):
            self.embed = QuantRows(embed, dtype)
        else:  # float32 compute keeps a 16-bit embedding as stored (rows widen exactly on lookup): not a second, 2x copy
            self.embed = embed if dtype == torch.float32 and embed.element_size() == 2 else embed.to(dtype)
        self.layers = nn.ModuleList(DecoderLayer(w, i, cfg, arch, dtype, kernel, self.fused, cache, activations)
                                    for i in range(cfg.num_layers))
        self.int8_layers = sum(isinstance(m, Linear) and m.int8_activations for m in self.layers.modules())
        self.norm = RMSNorm(w.tensor("model.norm.weight"), cfg.rms_norm_eps, dtype, self.fused, arch.norm_offset)
        # (HF multiplies the looked-up rows by sqrt(hidden) rounded to the compute dtype)
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=dtype, device=device) if arch.embed_scale else None
        tied = cfg.tie_word_embeddings or not ({"lm_head.weight", "lm_head" + PACKED} & w.tensors.keys())
        head = w.linear("lm_head") if not tied else self.embed if isinstance(embed, Tensor) else embed  # (int8 rows: shared)
        self.lm_head = Linear(_int8_rows(head) if lm_head == "int8" and isinstance(head, Tensor) else head, None, dtype,
                              kernel, self.fused, head=True, cache=cache, name="lm_head")
        if tied and self.lm_head.mode == "bf16_panels":  # the embedding reads its rows from the head's panels: one copy
            self.embed = None
        self.rotary = {kind: Rotary(path, hf, dtype, device, kind) for kind in dict.fromkeys(cfg.kinds)}
        self.kv_scales = self._kv_scales(w)
        t3 = time.perf_counter()
        ops = fused_kernels.ops() if self.fused else None
        self.built = not self.fused or (ops is not None and tuple(ops.panel_dtypes()) == predicted)  # else see `load`
        t4 = time.perf_counter()
        if self.built:
            cache.save()
        self.panels_cached = cache.hit
        # the C++ layer loop runs the Llama layer as it is: full rotary, no windows
        plain = arch.llama_layer and not any(cfg.windows) and all(r.dim == cfg.head_dim for r in self.rotary.values())
        self.decoder = (FusedDecoder.build(self.layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
                        if self.fused and self.built and plain else None)
        if device != "cpu":
            to_device(self, device)
            self.kv_scales = None if self.kv_scales is None else [(k.to(device), v.to(device)) for k, v in self.kv_scales]
        # start-up split, seconds: waiting for the kernels, reading the checkpoint, laying weights out for the kernels
        self.timings = {"kernels": t4 - t3, "load": t2 - t1, "repack": time.perf_counter() - t2 - (t4 - t3)}

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype, kernel: str = "packed", device: str = "cpu", lm_head: str = "auto",
             fused: bool = True, activations: str = "float") -> LlamaModel:
        """The model, laid out for the fused kernels while they build; again, when the build failed (said once:
        then for the PyTorch ops) or took other activation dtypes than predicted (then for what it takes)."""
        model = cls(path, dtype, kernel, device, lm_head, fused, activations)
        return model if model.built else cls(path, dtype, kernel, device, lm_head, fused and fused_kernels.ops() is not None, activations)

    def _kv_scales(self, w: Weights) -> list[tuple[Tensor, Tensor]] | None:
        names = [(f"model.layers.{i}.self_attn.k_scale", f"model.layers.{i}.self_attn.v_scale") for i in range(self.cfg.num_layers)]
        if not all(k in w.tensors and v in w.tensors for k, v in names):
            return None
        return [(w.tensors[k].float(), w.tensors[v].float()) for k, v in names]

    @torch.no_grad()
    def forward(self, batch: Batch, cache: KVCache) -> Tensor:
        """-> float32 logits [S, vocab] at `batch.logits_index`."""
        x = self.embed[batch.tokens].to(self.dtype) if self.embed is not None else self.lm_head.rows(batch.tokens)  # [T, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = {kind: rotary(batch.positions) for kind, rotary in self.rotary.items()}
        if self.decoder is not None and self.decoder.runs(batch):
            x = self.decoder(x, *rope["full_attention"], batch, cache)
        else:
            for layer in self.layers:
                x = layer(x, rope, batch, cache)
        h = self.norm(x[batch.logits_index])  # [S, hidden]
        logits = self.lm_head.exact(h) if batch.scoring else self.lm_head(h).float()
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits


def _int8_rows(w: Tensor) -> QuantWeight:
    """The lm_head as int8 with one scale per vocabulary row (opt-in, `lm_head="int8"`): half the bytes the
    bf16 head reads for every token, which on CPU is the largest single cost of single-stream decode."""
    from quantkit.config import Scheme
    from quantkit.quant.rtn import rtn

    qw = rtn(w.float(), Scheme(bits=8, group_size=None, symmetric=True), torch.float32)
    return QuantWeight.of(qw.q, qw.scale, None, 8, None)
