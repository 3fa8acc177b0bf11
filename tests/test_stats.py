"""Paired statistics against values computed by hand."""

import math

import pytest
import torch

from quantkit.eval.stats import (
    DEGRADED,
    EQUIVALENT,
    INCONCLUSIVE,
    UNINFORMATIVE,
    compare,
    matched_pairs_ci,
    mcnemar_exact,
    paired_bootstrap_ci,
)


def test_mcnemar_exact_on_a_hand_made_table():
    # 10 items lost, 2 gained: p = 2 * P(X <= 2), X ~ Binomial(12, 1/2) = 2 * (1 + 12 + 66) / 4096
    assert mcnemar_exact(10, 2) == pytest.approx(158 / 4096)
    assert mcnemar_exact(2, 10) == mcnemar_exact(10, 2)
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(3, 3) == 1.0


def test_bootstrap_ci_width_matches_the_normal_approximation():
    n = 400
    base = torch.ones(n)
    quant = torch.ones(n)
    quant[:40] = 0  # differences: 10% are -1, so sd = sqrt(0.1 * 0.9) = 0.3
    lo, hi = paired_bootstrap_ci(base, quant, level=0.90)
    expected = 2 * 1.6449 * 0.3 / math.sqrt(n)
    assert hi - lo == pytest.approx(expected, rel=0.1)
    assert lo < -0.1 < hi


def test_verdicts():
    same = torch.tensor([1.0] * 180 + [0.0] * 20)
    assert compare(same, same.clone()).verdict == EQUIVALENT
    broken = same.clone()
    broken[:60] = 0
    r = compare(same, broken)
    assert r.verdict == DEGRADED and r.flips_lost == 60 and r.flips_gained == 0 and r.p_mcnemar < 1e-6
    few = compare(torch.tensor([1.0, 0, 1, 1]), torch.tensor([1.0, 1, 0, 1]))
    assert few.verdict == INCONCLUSIVE and "items would be needed" in few.note
    weak = compare(torch.zeros(50), torch.zeros(50), floor=0.2)
    assert weak.verdict == UNINFORMATIVE and "floor" in weak.note


def test_matched_pairs_ci_by_hand():
    # 7 lost, 2 gained of 100: adjusted cells b = 7.5, c = 2.5, n = 102; diff = -5/102,
    # se = sqrt(10 - 25/102) / 102
    lo, hi = matched_pairs_ci(7, 2, 100, level=0.90)
    se = math.sqrt(10 - 25 / 102) / 102
    assert lo == pytest.approx(-5 / 102 - 1.6449 * se, abs=1e-4)
    assert hi == pytest.approx(-5 / 102 + 1.6449 * se, abs=1e-4)


def test_no_flips_on_few_items_is_not_equivalence():
    # 21 identical answers: a bootstrap says [0, 0]; 21 items cannot rule out a 7-point difference
    few = torch.tensor([1.0] * 15 + [0.0] * 6)
    r = compare(few, few.clone())
    assert r.verdict == INCONCLUSIVE and r.ci_low < -0.05 and r.ci_high > 0.05
    lo, hi = paired_bootstrap_ci(few, few.clone())
    assert lo == hi == 0.0  # the degenerate interval the adjustment replaces
    many = torch.tensor([1.0] * 300 + [0.0] * 100)
    assert compare(many, many.clone()).verdict == EQUIVALENT


def test_graded_scores_use_the_bootstrap():
    base = torch.tensor([1.0, 0.5, 0.25, 1.0] * 50)
    quant = torch.tensor([1.0, 0.5, 0.0, 1.0] * 50)
    r = compare(base, quant)
    assert (r.ci_low, r.ci_high) == pytest.approx(paired_bootstrap_ci(base, quant))
