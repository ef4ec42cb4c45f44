"""The evaluation's metrics: pass@k against its closed form and brute-force enumeration, and the summary of a
source's samples against numbers worked by hand."""

import itertools
import math

import pytest

from streamrl.learner.evaluation.metrics import Scored, pass_at_k, summarize


def _enumerated(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (the first c passing) that hold a passing one: counted, not derived."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_equals_enumeration_and_closed_form(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            got = pass_at_k(n, c, k)
            assert got == pytest.approx(_enumerated(n, c, k), abs=1e-12), (n, c, k)
            # Codex's numerically stable product form of the same estimator
            product = 1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
            assert got == pytest.approx(product, abs=1e-12), (n, c, k)


def test_pass_at_k_by_hand():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == 0.5
    # n=5, c=2, k=1: the pass rate 2/5; k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10 = 0.9
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(3, 0, 3) == 0.0 and pass_at_k(3, 3, 1) == 1.0
    with pytest.raises(ValueError, match="k=4"):
        pass_at_k(3, 1, 4)


def _sample(prompt, reward, tokens=10, truncated=False):
    return Scored(prompt=prompt, reward=reward, tokens=tokens, truncated=truncated)


def test_summary_by_hand():
    samples = [
        _sample(0, 1.0, 4), _sample(0, 0.0, 8, True),  # prompt 0: one of two passes
        _sample(1, 0.5, 6), _sample(1, None, 2),  # prompt 1: 0.5 < threshold 0.6, None fails
    ]  # fmt: skip
    got = summarize(samples, n=2, asked=2, threshold=0.6)
    assert got["complete"] == 1.0 and got["prompts_done"] == 2.0 and got["reward_errors"] == 1.0
    assert got["reward_mean"] == pytest.approx(0.5)  # (1 + 0 + 0.5) / 3: the None left out
    # prompt 0: pass@1 = 1/2, pass@2 = 1; prompt 1: 0 and 0  -> 0.25 and 0.5
    assert got["pass@1"] == pytest.approx(0.25) and got["pass@2"] == pytest.approx(0.5)
    assert got["mean@2"] == pytest.approx((0.5 + 0.5) / 2)  # prompt 0: (1+0)/2; prompt 1: 0.5 alone
    assert got["best@2"] == pytest.approx((1.0 + 0.5) / 2)
    assert got["completion_tokens"] == pytest.approx(5.0)  # (4+8+6+2)/4
    assert got["truncated_share"] == pytest.approx(0.25)


def test_incomplete_reports_coverage_and_no_mean():
    samples = [_sample(0, 1.0), _sample(0, 1.0), _sample(1, 1.0)]  # prompt 1 has 1 of its 2 samples
    got = summarize(samples, n=2, asked=3, threshold=1.0)
    assert got == {"prompts_done": 1.0, "prompts_asked": 3.0, "samples": 3.0, "complete": 0.0}
    complete = summarize([*samples, _sample(1, 0.0), _sample(2, 1.0), _sample(2, 1.0)], n=2, asked=3, threshold=1.0)
    assert complete["complete"] == 1.0 and "pass@1" in complete  # the positive control
