"""What the opt-in int8 lm_head costs in accuracy: KL(checkpoint head || int8 head) of the runtime's
next-token distributions on held-out text.

    python bench/runtime_lm_head.py CKPT [--rows 8 --seqlen 512]
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    args = ap.parse_args()

    from quantkit.calib.data import eval_rows
    from quantkit.runtime import EngineConfig, LLMEngine

    engines = {h: LLMEngine(args.ckpt, EngineConfig(dtype="bf16", kv_cache_memory=64 << 20, lm_head=h)) for h in ("auto", "int8")}
    rows = eval_rows(engines["auto"].tokenizer, args.seqlen, args.rows)
    lp = {h: torch.cat([e.model(e.single(r, all_logits=True), e.cache).log_softmax(-1) for r in rows])
          for h, e in engines.items()}
    kl = (lp["auto"].exp() * (lp["auto"] - lp["int8"])).sum(-1)
    agree = (lp["auto"].argmax(-1) == lp["int8"].argmax(-1)).float().mean().item()
    print(json.dumps({"tokens": kl.numel(), "kl_mean": kl.mean().item(), "kl_p99": torch.quantile(kl.double(), 0.99).item(),
                      "top1_agreement": agree}, indent=2))


if __name__ == "__main__":
    main()
