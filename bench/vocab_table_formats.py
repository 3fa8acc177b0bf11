"""What a vocabulary table's format costs alone: mean KL(dense || dense with only the embedding quantized) on the
budget's held-out rows, per format, with the table's bytes. A tied head reads the same table, so its error counts
twice (lookup and logits).

    python bench/vocab_table_formats.py [--model smollm2-135m] [--formats w8,w8g64,w8g32,w6g32,w4g32] [--rows 16]

Float32 HF transformers with round-to-nearest symmetric weights (scales rounded to bf16, as a checkpoint stores
them); formats beyond quantkit's (w6) are here only to show where the bytes-vs-KL curve bends.
"""

from __future__ import annotations

import argparse
import json
import re

import torch


class TableSwap:
    """Logits of `model` with its input-embedding weight replaced by `table` for the call (the dense one restored)."""

    def __init__(self, model, dense: torch.Tensor, table: torch.Tensor | None):
        self.model, self.dense, self.table = model, dense, table  # dense: a copy of the weight, kept once
        self.weight = model.get_input_embeddings().weight

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:  # ids [b, seq] -> [b, seq, vocab]
        if self.table is None:
            return self.model(ids).logits.float()
        self.weight.data.copy_(self.table)
        try:
            return self.model(ids).logits.float()
        finally:
            self.weight.data.copy_(self.dense)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="any MODEL quantkit resolves")
    ap.add_argument("--formats", default="w8,w8g64,w8g32,w6g32,w4g32", help="w<BITS>[g<GROUP>], per row without g")
    ap.add_argument("--rows", type=int, default=16, help="held-out rows of 512 tokens (the budget's proof uses 16)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from quantkit.budget.plan import Choice, table_units, unit_bytes
    from quantkit.budget.run import HELDOUT_SEQLEN
    from quantkit.calib.data import eval_rows
    from quantkit.config import Scheme
    from quantkit.eval.kl import distribution
    from quantkit.models import load_tokenizer, resolve
    from quantkit.quant.rtn import rtn

    path = resolve(args.model).path
    rows = eval_rows(load_tokenizer(path), HELDOUT_SEQLEN, args.rows)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    dense = model.get_input_embeddings().weight.data.clone()
    vocab, hidden = dense.shape
    units = table_units(model)  # one unit when the head is tied to the embedding
    tied = len(units) == 1
    print(f"{args.model}: table {vocab} x {hidden}, {'tied to the head' if tied else 'untied (the head stays dense)'}, "
          f"{rows.numel()} held-out tokens", flush=True)
    baseline = TableSwap(model, dense, None)
    for label in args.formats.split(","):
        m = re.fullmatch(r"w(\d)(?:g(\d+))?", label.strip())
        if not m:
            raise SystemExit(f"unknown format {label!r}: use w<BITS>[g<GROUP>]")
        bits, group = int(m.group(1)), int(m.group(2)) if m.group(2) else None
        scheme = Scheme(bits=bits, group_size=group, symmetric=True)
        q = rtn(dense, scheme, torch.bfloat16)
        d = distribution(baseline, TableSwap(model, dense, q.dequantize(torch.float32)), rows)
        nbytes = unit_bytes(units[0], Choice(label, scheme))
        print(json.dumps({"format": label, "table_mb": round(nbytes / 1e6, 2), "kl_mean": d.kl_mean,
                          "top1_agreement": d.top1_agreement}), flush=True)


if __name__ == "__main__":
    main()
