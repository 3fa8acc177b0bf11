"""Paired statistics for baseline-vs-quantized comparisons on the same items, and the verdict they support.

Every item is answered by both models, so the comparison is paired: the difference in accuracy has
Agresti and Min's adjusted-Wald interval for matched proportions (half an item added to each cell of the 2x2
table), and McNemar's exact test looks only at the items whose correctness flipped. The adjustment matters
when few items flip: a bootstrap (or a plain Wald interval) of 21 items with no flip is [0, 0], which would
call two models equivalent on evidence that cannot rule out a 7-point difference. Graded scores (not 0/1)
fall back to a paired bootstrap. A task is "equivalent" when the whole CI lies within +-margin, "degraded" when the CI lies
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


def matched_pairs_ci(lost: int, gained: int, n: int, level: float = 0.90) -> tuple[float, float]:
    """CI of the accuracy difference (gained - lost) / n for paired 0/1 outcomes, by Agresti and Min (2005):
    add 0.5 to each of the four cells, then a Wald interval on the adjusted table. Never zero-width."""
    z = _z(level)
    b, c, m = lost + 0.5, gained + 0.5, n + 2.0
    diff = (c - b) / m
    se = math.sqrt(max(b + c - (c - b) ** 2 / m, 0.0)) / m
    return max(-1.0, diff - z * se), min(1.0, diff + z * se)


def _z(level: float) -> float:
    return torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(0.5 + level / 2, dtype=torch.float64)).item()


def mcnemar_exact(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p-value: a binomial test of the flips against p = 1/2."""
    n = lost + gained
    if n == 0:
        return 1.0
    k = min(lost, gained)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def items_needed(base: torch.Tensor, quant: torch.Tensor, margin: float, level: float = 0.90) -> int:
    """Items for the CI half-width to fit inside the margin, at the flip rates (0/1 items) or the per-item
    variance (graded scores) observed so far."""
    n, z = base.numel(), _z(level)
    b, q = base.double(), quant.double()
    if ((b == 0) | (b == 1)).all() and ((q == 0) | (q == 1)).all():
        lost, gained = int(((b == 1) & (q == 0)).sum()), int(((b == 0) & (q == 1)).sum())

        def half(m: int) -> float:  # half-width at m items with the same flip rates
            lo, hi = matched_pairs_ci(round(lost * m / n), round(gained * m / n), m, level)
            return (hi - lo) / 2

        m = n
        while half(m) > margin and m < 10**7:
            m *= 2
        lo_m = max(n, m // 2)
        while lo_m < m:  # smallest m with half(m) <= margin
            mid = (lo_m + m) // 2
            lo_m, m = (mid + 1, m) if half(mid) > margin else (lo_m, mid)
        return m
    sd = max((q - b).std().item() if n > 1 else 0.5, 0.05)
    return math.ceil((z * sd / margin) ** 2)


def compare(base: torch.Tensor, quant: torch.Tensor, margin: float = 0.02, floor: float = 0.0, level: float = 0.90) -> Paired:
    """base/quant: per-item correctness (0/1) or scores in [0, 1], same items in the same order."""
    if base.shape != quant.shape or base.numel() == 0:
        raise ValueError("paired comparison needs the same non-empty items for both models")
    b, q = base.double(), quant.double()
    lost = int(((b >= 0.5) & (q < 0.5)).sum())
    gained = int(((b < 0.5) & (q >= 0.5)).sum())
    binary = bool(((b == 0) | (b == 1)).all() and ((q == 0) | (q == 1)).all())
    lo, hi = matched_pairs_ci(lost, gained, b.numel(), level) if binary else paired_bootstrap_ci(base, quant, level)
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
