"""What each supported model family's decoder differs in: one table, read by the layer walk (calib), AWQ's
mappings, the runtime's model and the GGUF converter alike. Adding a family is an entry here plus tests.

Everything else a family varies comes from its config.json and is read generically: q/k norms (present in the
checkpoint or not), grouped-query heads, head size, attention scaling (`query_pre_attn_scalar`), sliding-window
layers (`layer_types`, `sliding_window`), rope per layer kind (`rope_parameters`), tied or separate head.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantkit import QuantkitError


@dataclass(frozen=True, slots=True)
class Mapping:
    """AWQ: scales fold into `prev` (a norm's weight, or a Linear's output rows) and into `balance`'s columns."""

    prev: str
    balance: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class MoE:
    """A sparse MLP block: where its parts are in the checkpoint and how the router weighs the experts it picks.

    HF transformers (5.x) holds the experts fused, `mlp.experts.gate_up_proj` [experts, 2 * inter, hidden] (gate rows
    first) and `mlp.experts.down_proj` [experts, hidden, inter], under `mlp` for every family; checkpoints, vLLM's
    loaders and quantkit's files name each expert's Linears, under `block` (`experts.{e}.{proj}`)."""

    block: str  # the block's name in the checkpoint: its router is `{block}.gate`, its experts `{block}.experts.{e}`
    proj: tuple[str, str, str]  # an expert's gate, up and down Linears as the checkpoint names them
    inter_key: str  # config.json key of an expert's intermediate width
    norm_topk: bool | None = None  # the chosen experts' probabilities renormalised to sum to 1; None: config `norm_topk_prob`

    def layers(self, config: dict) -> list[bool]:
        """Which decoder layers are sparse (Qwen: every `decoder_sparse_step`-th outside `mlp_only_layers`)."""
        n, step = config["num_hidden_layers"], config.get("decoder_sparse_step") or 1
        dense = set(config.get("mlp_only_layers") or ())
        return [bool(self.experts(config)) and i not in dense and (i + 1) % step == 0 for i in range(n)]

    @staticmethod
    def experts(config: dict) -> int:
        """The expert count (Qwen's hub configs say `num_experts`; transformers 5 saves `num_local_experts`, as Mixtral's)."""
        return config.get("num_experts") or config.get("num_local_experts") or 0

    def expert(self, e: int, which: int) -> str:
        """Checkpoint name (within the layer) of expert `e`'s gate (0), up (1) or down (2) Linear."""
        return f"{self.block}.experts.{e}.{self.proj[which]}"

    def normalises(self, config: dict) -> bool:
        return self.norm_topk if self.norm_topk is not None else bool(config.get("norm_topk_prob", False))


SHARED = "mlp.shared_expert"  # Qwen2-MoE: an always-on MLP beside the experts, weighed by sigmoid(mlp.shared_expert_gate)


@dataclass(frozen=True, slots=True)
class Arch:
    name: str
    model_types: tuple[str, ...]  # config.json `model_type`
    classes: tuple[str, ...]  # config.json `architectures` (the runtime checks these)
    gguf: tuple[str, ...]  # GGUF `general.architecture` names the converter reads
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma's (1 + w), computed in float32
    mlp_norm: str = "post_attention_layernorm"  # the norm before the MLP
    attn_out_norm: str | None = None  # a norm on the attention's output before the residual add (Gemma)
    mlp_out_norm: str | None = None  # and on the MLP's
    activation: str = "silu"  # the gate's: "silu" or "gelu_tanh" (GeGLU)
    embed_scale: bool = False  # embeddings times sqrt(hidden), rounded to the compute dtype as HF does
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # as the checkpoint names
    # them; the runtime fuses them into one Linear (Phi-3's checkpoint holds them fused already, v last)
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")  # likewise (Phi-3: gate_up_proj, the gate first)
    moe: MoE | None = None  # sparse MLP layers (which ones: `MoE.layers`); a router and its gates stay dense

    @property
    def llama_layer(self) -> bool:
        """The layer computes exactly Llama's (the runtime's C++ decode loop runs it)."""
        return (not self.norm_offset and not self.attn_out_norm and not self.mlp_out_norm and self.activation == "silu"
                and self.moe is None)

    @property
    def awq(self) -> tuple[Mapping, ...]:
        """prev -> balance pairs, in layer order. A producing Linear wider than its consumer's input (a fused qkv or
        gate_up) scales its last rows: v, and up. v->o applies only when v's width equals o's input (no
        grouped-query attention), as in other AWQ implementations; a norm on a branch's output (Gemma's
        post-attention norm) has no Linear after it to fold into."""
        return (
            Mapping("input_layernorm", self.qkv),
            Mapping(self.qkv[-1], ("self_attn.o_proj",)),
            Mapping(self.mlp_norm, self.gate_up),
            Mapping(self.gate_up[-1], ("mlp.down_proj",)),
        )


LLAMA = Arch("llama", ("llama", "mistral", "qwen2", "qwen3"),
             ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"), ("llama", "qwen2", "qwen3"))
GEMMA3 = Arch("gemma3", ("gemma3_text",), ("Gemma3ForCausalLM",), ("gemma3",), norm_offset=1.0,
              mlp_norm="pre_feedforward_layernorm", attn_out_norm="post_attention_layernorm",
              mlp_out_norm="post_feedforward_layernorm", activation="gelu_tanh", embed_scale=True)
PHI3 = Arch("phi3", ("phi3",), ("Phi3ForCausalLM",), (), qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",))
QWEN_MOE = Arch("qwen_moe", ("qwen3_moe", "qwen2_moe"), ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"), (),
                moe=MoE("mlp", ("gate_proj", "up_proj", "down_proj"), "moe_intermediate_size"))
MIXTRAL = Arch("mixtral", ("mixtral",), ("MixtralForCausalLM",), (),
               moe=MoE("block_sparse_moe", ("w1", "w3", "w2"), "intermediate_size", norm_topk=True))
ARCHS = (LLAMA, GEMMA3, PHI3, QWEN_MOE, MIXTRAL)


def arch_of(config: dict, where: Path | str = "") -> Arch:
    """The family of a config.json; an unsupported one is one line naming what is supported."""
    model_type = config.get("model_type")
    for a in ARCHS:
        if model_type in a.model_types:
            return a
    supported = ", ".join(t for a in ARCHS for t in a.model_types)
    raise QuantkitError(f"unsupported architecture {model_type!r}{f' in {where}' if where else ''}: quantkit supports {supported}")


def gguf_names() -> tuple[str, ...]:
    return tuple(n for a in ARCHS for n in a.gguf)
