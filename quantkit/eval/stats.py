"""Paired statistics for baseline-vs-quantized comparisons on the same items, and the verdict they support.

Every item is answered by both models, so the comparison is paired: the difference in accuracy has a
paired bootstrap confidence interval, and McNemar's exact test looks only at the items whose correctness
flipped. A task is "equivalent" when the whole CI lies within +-margin, "degraded" when the CI lies
below zero, and "inconclusive" otherwise, with the number of items a decision would need.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

EQUIVALENT, DEGRADED, IMPROVED, INCONCLUSIVE, UNINFORMATIVE = "equivalent", "degraded", "improved", "inconclusive", "uninformative"


@dataclass(slots=True)
class Paired:
    n: int
    baseline: float  # accuracy in [0, 1]
    quantized: float
    diff: float  # quantized - baseline
    ci_low: float
    ci_high: float
    p_mcnemar: float
    flips_lost: int  # correct for the baseline, wrong when quantized
    flips_gained: int
    verdict: str
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def paired_bootstrap_ci(base: torch.Tensor, quant: torch.Tensor, level: float = 0.90, resamples: int = 10_000,
                        seed: int = 0) -> tuple[float, float]:
    """CI of mean(quant) - mean(base) by resampling items with replacement (scores per item, paired)."""
    n = base.numel()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (resamples, n), generator=g)
    d = (quant.double() - base.double())[idx].mean(dim=1)
    lo, hi = torch.quantile(d, torch.tensor([(1 - level) / 2, 1 - (1 - level) / 2], dtype=torch.float64)).tolist()
    return lo, hi


def mcnemar_exact(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p-value: a binomial test of the flips against p = 1/2."""
    n = lost + gained
    if n == 0:
        return 1.0
    k = min(lost, gained)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def items_needed(base: torch.Tensor, quant: torch.Tensor, margin: float, level: float = 0.90) -> int:
    """Items for the CI half-width to fit inside the margin, from the observed per-item variance."""
    d = quant.double() - base.double()
    sd = max(d.std().item() if d.numel() > 1 else 0.5, 0.05)
    z = {0.90: 1.645, 0.95: 1.96}.get(level, 1.645)
    return math.ceil((z * sd / margin) ** 2)


def compare(base: torch.Tensor, quant: torch.Tensor, margin: float = 0.02, floor: float = 0.0, level: float = 0.90) -> Paired:
    """base/quant: per-item correctness (0/1) or scores in [0, 1], same items in the same order."""
    if base.shape != quant.shape or base.numel() == 0:
        raise ValueError("paired comparison needs the same non-empty items for both models")
    lo, hi = paired_bootstrap_ci(base, quant, level)
    b, q = base.double(), quant.double()
    lost = int(((b >= 0.5) & (q < 0.5)).sum())
    gained = int(((b < 0.5) & (q >= 0.5)).sum())
    acc_b, acc_q = b.mean().item(), q.mean().item()
    note = ""
    if acc_b < floor:
        verdict = UNINFORMATIVE
        note = f"baseline accuracy {acc_b:.0%} is under the {floor:.0%} floor: the task cannot tell the models apart"
    elif -margin <= lo and hi <= margin:
        verdict = EQUIVALENT
    elif hi < 0:
        verdict = DEGRADED
    elif lo > 0:
        verdict = IMPROVED
    else:
        verdict = INCONCLUSIVE
        need = items_needed(base, quant, margin, level)
        note = f"CI wider than +-{margin * 100:.0f} points; about {need} items would be needed"
    return Paired(base.numel(), acc_b, acc_q, acc_q - acc_b, lo, hi, mcnemar_exact(lost, gained), lost, gained, verdict, note)
