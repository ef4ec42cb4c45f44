"""`loss.rejection`: which tokens or sequences the policy loss leaves out, judged by how far the behavior
policy mu is from pi_prox (learner/rejection.py; the peers' names beside each setting in docs/ALGORITHMS.md)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from streamrl.engine.config.base import _doc, _Section


class RejectionConfig(_Section):
    """Off by default (`level = "none"`). A per-token statistic of log r = log(pi_prox / mu) (`metric`), at
    `level` token or sequence (the sequence's tokens aggregated by `aggregation`), is kept inside
    [`lower`, `upper`]; outside it the token or sequence is rejected (`action = "mask"`: no policy loss) or
    its importance weight is clamped into the band (`action = "clamp"`, metric `ratio` only); an infinite
    bound is no bound. `advantage` limits rejection to samples whose advantage has that sign (DeepSeek-V3.2's
    off-policy sequence mask rejects only negative ones)."""

    level: Annotated[
        Literal["none", "token", "sequence"],
        _doc(
            "none: no rejection; token: each token judged alone; sequence: all of a sequence's tokens share one fate."
        ),
    ] = "none"
    metric: Annotated[
        Literal["ratio", "k1", "k2", "k3"],
        _doc(
            "The per-token statistic, with r = pi_prox / mu: ratio = r; k1 = -log r = log(mu / pi_prox) (verl's "
            "sign; its mean over mu's tokens estimates KL(mu || pi_prox)); k2 = (log r)^2 / 2; k3 = r - 1 - log r."
        ),
    ] = "k1"
    aggregation: Annotated[
        Literal["sum", "mean", "max"],
        _doc(
            "level = sequence: how the sequence's loss tokens combine. For ratio in log space (sum: "
            "exp(sum log r), the sequence's weight; mean: exp(mean log r), its geometric mean); for k1/k2/k3 "
            "arithmetically; max: the largest token's."
        ),
    ] = "mean"
    lower: Annotated[float, _doc("Keep only where the statistic is >= lower; -inf: no lower bound.")] = -math.inf
    upper: Annotated[float, _doc("Keep only where the statistic is <= upper; inf: no upper bound.")] = math.inf
    action: Annotated[
        Literal["mask", "clamp"],
        _doc(
            "mask: a rejected token gets no policy loss (it stays in the normaliser, as masked importance "
            "does); clamp (metric ratio): its importance weight is clamped into [lower, upper] instead."
        ),
    ] = "mask"
    advantage: Annotated[
        Literal["any", "negative", "positive"],
        _doc("Reject only tokens whose advantage is < 0 (negative) or > 0 (positive); any: regardless of it."),
    ] = "any"

    def __post_init__(self) -> None:
        if self.level == "none":
            return
        if math.isinf(self.lower) and math.isinf(self.upper):
            raise ValueError(
                f"loss.rejection.level = {self.level!r} with neither loss.rejection.lower nor loss.rejection.upper "
                "set would reject nothing; set a bound (verl seq_mean_k1 '0.999_1.001': lower = -0.0010005, "
                "upper = 0.0009995), or level = 'none'"
            )
        if self.lower >= self.upper:
            raise ValueError(
                f"loss.rejection.lower = {self.lower} must be below loss.rejection.upper = {self.upper}: "
                "the band [lower, upper] is what is kept"
            )
        if self.metric == "ratio" and (-math.inf < self.lower < 0 or self.upper <= 0):
            raise ValueError(
                f"loss.rejection bounds (lower = {self.lower}, upper = {self.upper}) must be positive with "
                "metric = 'ratio' (a ratio of probabilities is; lower = 0 or -inf is no lower bound)"
            )
        if self.action == "clamp" and self.metric != "ratio":
            raise ValueError(
                f"loss.rejection.action = 'clamp' with metric = {self.metric!r}: clamping moves the importance "
                "weight into [lower, upper], which is a band of ratios; use metric = 'ratio' or action = 'mask'"
            )
