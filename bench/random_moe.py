"""Write a random-weight Qwen3-MoE checkpoint with a deployed model's layer shapes, for timing the sparse layer.

No mixture-of-experts weights ship on PyPI, so the runtime's routed layer is timed on random weights with the per-layer
shapes of Qwen3-30B-A3B (hidden 2048, 128 experts of 768, 8 per token, 32 / 4 heads of 128) and fewer layers. Routers
are scaled so that tokens spread unevenly over experts, as trained routers send them; the tokenizer (and so the
vocabulary) is a built-in model's, so that prompts are real text. Usage:

    python bench/random_moe.py OUT --layers 2
    quantkit quantize OUT --bits 4 -o OUT-W4
    quantkit bench --offline OUT --batch-sizes 1,16 --input-len 128 --output-len 32   # and OUT-W4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokenizer", default="smollm2-135m", help="a MODEL whose tokenizer the checkpoint gets")
    args = ap.parse_args()

    from quantkit.models import open_tokenizer, resolve

    tokenizer = open_tokenizer(resolve(args.tokenizer).path)

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                            max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device("cpu"):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {n / 1e9:.2f} B parameters, {args.layers} layers of {args.experts} experts ({args.top_k} per token)")


if __name__ == "__main__":
    main()
