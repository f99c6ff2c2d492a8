"""Goodness-of-fit helpers for the statistical tests: do observed counts match exact probabilities?

Method: Pearson's chi-square test (``scipy.stats.power_divergence(lambda_="pearson")``; ``method="g"``
gives the G-test, ``lambda_="log-likelihood"``, instead). Outcomes whose expected count ``n * p`` is below
``min_expected`` (5, the usual rule for the chi-square approximation) are pooled into one bin; if that
bin is itself still below ``min_expected`` it is merged with the smallest unpooled outcome. An outcome
that is observed although its exact probability is 0 (or that is missing from the exact table) is
impossible under the null hypothesis: the p-value is 0.

Calibration (20,000 simulated multinomial samples of n = 30,000 over 512 skewed outcomes, ~170 of them
pooled, like the engine tests): chi-square rejected 0.100 % at ``p < 1e-3`` and 1.08 % at ``p < 1e-2``,
as it should; the G-test rejected 0.13 % and 1.5 % (it is slightly liberal when many bins hold 5-10
expected counts), hence chi-square by default.

False positives. Each :func:`assert_matches` call is one test at level ``alpha`` (default ``1e-3``, fixed
in advance, never tuned to the data): if the sampler were exactly right and the seeds random, it would
fail with probability ``alpha``. The suite's calls (update this list when adding some):

- ``tests/test_rejection_sampler.py``: 2 (first emitted token; joint of the first two).
- ``tests/test_spec_distribution.py``: 6 (n-gram and draft-model drafter × temperatures 0.7, 1.0, 1.5).
- ``tests/test_spec_processors_distribution.py``: 12 (n-gram and draft-model drafter × top-k, top-p,
  min-p, the three combined, penalties, min_tokens).
- ``tests/test_structured_distribution.py``: 6 (plain, n-gram and draft model × temperatures 0.8, 1.3,
  under a regex grammar).
- ``tests/test_tree_verification.py``: 2 (token tree with deterministic children; with sampled
  children).
- ``tests/test_quantized_self.py``: 6 (the int4 and int8 quantized self-drafters × temperatures 0.7, 1.0,
  1.5).
- ``tests/test_eagle3_distribution.py``: 6 (EAGLE-3 with a reduced draft vocabulary, chain and tree ×
  temperatures 0.7, 1.0, 1.5).

So these files' false-positive rate is at most ``40 × 1e-3 = 4 %`` per fresh draw of seeds. All seeds
are fixed, so the suite is deterministic anyway: it either passes or fails on every run on a given
platform (a different CPU or torch build may round differently and so amounts to a fresh draw).

Negative controls use :func:`assert_differs`: a deliberately broken sampler must give ``p < alpha``. Its
own failure rate is the test's lack of power, which the controls keep negligible by choosing biased
cases and enough samples (their observed p-values are many orders of magnitude below ``alpha``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats as _sps

#: Significance level of every goodness-of-fit assertion (see the module docstring).
ALPHA = 1e-3
#: Outcomes with a smaller expected count are pooled.
MIN_EXPECTED = 5.0


@dataclass
class GofResult:
    """Result of one goodness-of-fit test."""

    pvalue: float
    statistic: float
    dof: int
    n: int  # total count
    num_bins: int  # bins after pooling
    num_pooled: int  # outcomes pooled into the low-expectation bin
    impossible: list  # outcomes observed although their exact probability is 0
    worst: list  # up to 5 (outcome, observed, expected) with the largest |standardised residual|

    def describe(self) -> str:
        s = (
            f"p={self.pvalue:.3g} (stat={self.statistic:.1f}, dof={self.dof}, n={self.n}, "
            f"bins={self.num_bins}, pooled={self.num_pooled})"
        )
        if self.impossible:
            s += f"; observed impossible outcomes {self.impossible[:5]}"
        worst = ", ".join(f"{o}: obs {c} exp {e:.1f}" for o, c, e in self.worst)
        return s + (f"; largest deviations {worst}" if worst else "")


def _as_table(
    expected_probs: Mapping[Hashable, float] | Sequence[float] | np.ndarray,
    counts: Mapping[Hashable, int] | Sequence[int] | np.ndarray,
) -> tuple[list[Any], np.ndarray, np.ndarray]:
    """Aligned (outcomes, probs, counts); arrays are flattened, outcomes are then index tuples."""
    if isinstance(expected_probs, Mapping) or isinstance(counts, Mapping):
        if not (isinstance(expected_probs, Mapping) and isinstance(counts, Mapping)):
            raise TypeError("give expected_probs and counts both as dicts or both as arrays")
        outcomes = list(expected_probs)
        extra = [o for o in counts if o not in expected_probs]
        outcomes += extra
        probs = np.array([float(expected_probs.get(o, 0.0)) for o in outcomes], dtype=np.float64)
        obs = np.array([int(counts.get(o, 0)) for o in outcomes], dtype=np.float64)
        return outcomes, probs, obs
    p = np.asarray(expected_probs, dtype=np.float64)
    c = np.asarray(counts, dtype=np.float64)
    if p.shape != c.shape:
        raise ValueError(f"expected_probs has shape {p.shape} but counts has shape {c.shape}")
    outcomes = [tuple(int(i) for i in ix) if p.ndim > 1 else int(ix[0]) for ix in np.ndindex(p.shape)]
    return outcomes, p.reshape(-1), c.reshape(-1)


def goodness_of_fit(
    expected_probs: Mapping[Hashable, float] | Sequence[float] | np.ndarray,
    counts: Mapping[Hashable, int] | Sequence[int] | np.ndarray,
    min_expected: float = MIN_EXPECTED,
    method: str = "chi2",
) -> GofResult:
    """Test whether ``counts`` are a multinomial sample of ``expected_probs``.

    Args:
        expected_probs: exact probability of each outcome, as a dict ``{outcome: p}`` or an array of any
            shape (e.g. ``[V, V, V]`` for the joint of three tokens). Must sum to 1 (up to 1e-4; it is
            renormalised to absorb float rounding).
        counts: observed counts, a dict (missing outcomes count 0) or an array of the same shape.
        min_expected: outcomes with expected count below this are pooled into one bin.
        method: ``"chi2"`` (Pearson chi-square) or ``"g"`` (G-test).

    Returns:
        A :class:`GofResult`; ``pvalue`` is 0 when an impossible outcome was observed.
    """
    if method not in ("g", "chi2"):
        raise ValueError(f"method must be 'g' or 'chi2', got {method!r}")
    outcomes, probs, obs = _as_table(expected_probs, counts)
    if (probs < 0).any() or not np.isfinite(probs).all():
        raise ValueError("expected probabilities must be finite and >= 0")
    total_p = probs.sum()
    if abs(total_p - 1.0) > 1e-4:
        raise ValueError(f"expected probabilities sum to {total_p}, not 1")
    probs = probs / total_p
    n = int(obs.sum())
    if n == 0:
        raise ValueError("no observations")
    impossible = [outcomes[i] for i in np.flatnonzero((probs == 0) & (obs > 0))]
    exp = n * probs
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(exp > 0, (obs - exp) / np.sqrt(exp), np.inf * (obs > 0))
    order = np.argsort(-np.abs(np.nan_to_num(z, nan=0.0)), kind="stable")[:5]
    worst = [(outcomes[i], int(obs[i]), float(exp[i])) for i in order if obs[i] or exp[i]]
    if impossible:
        return GofResult(0.0, float("inf"), 0, n, 0, 0, impossible, worst)

    big = exp >= min_expected
    f_obs, f_exp = list(obs[big]), list(exp[big])
    num_pooled = int((~big & (probs > 0)).sum())
    if num_pooled:
        pooled_obs, pooled_exp = float(obs[~big].sum()), float(exp[~big].sum())
        if pooled_exp < min_expected and f_exp:
            j = int(np.argmin(f_exp))  # too small on its own: merge into the smallest unpooled bin
            f_obs[j] += pooled_obs
            f_exp[j] += pooled_exp
        else:
            f_obs.append(pooled_obs)
            f_exp.append(pooled_exp)
    if len(f_exp) < 2:
        return GofResult(1.0, 0.0, 0, n, len(f_exp), num_pooled, [], worst)  # nothing to test
    lam = "log-likelihood" if method == "g" else "pearson"
    stat, p = _sps.power_divergence(np.array(f_obs), np.array(f_exp), lambda_=lam)
    return GofResult(float(p), float(stat), len(f_exp) - 1, n, len(f_exp), num_pooled, [], worst)


def gof_pvalue(
    expected_probs: Mapping[Hashable, float] | Sequence[float] | np.ndarray,
    counts: Mapping[Hashable, int] | Sequence[int] | np.ndarray,
    min_expected: float = MIN_EXPECTED,
    method: str = "chi2",
) -> float:
    """The p-value of :func:`goodness_of_fit`."""
    return goodness_of_fit(expected_probs, counts, min_expected, method).pvalue


def assert_matches(
    expected_probs: Mapping[Hashable, float] | Sequence[float] | np.ndarray,
    counts: Mapping[Hashable, int] | Sequence[int] | np.ndarray,
    alpha: float = ALPHA,
    label: str = "",
    method: str = "chi2",
) -> GofResult:
    """Fail unless the counts are consistent with ``expected_probs`` at level ``alpha`` (``p >= alpha``)."""
    res = goodness_of_fit(expected_probs, counts, method=method)
    print(f"[gof] {label}: {res.describe()}")  # shown with pytest -s / -rA: the observed p-values
    assert res.pvalue >= alpha, f"{label}: counts do not match the exact distribution: {res.describe()}"
    return res


def assert_differs(
    expected_probs: Mapping[Hashable, float] | Sequence[float] | np.ndarray,
    counts: Mapping[Hashable, int] | Sequence[int] | np.ndarray,
    alpha: float = ALPHA,
    label: str = "",
    method: str = "chi2",
) -> GofResult:
    """Negative control: fail unless the same test *rejects* the counts (``p < alpha``)."""
    res = goodness_of_fit(expected_probs, counts, method=method)
    print(f"[gof control] {label}: {res.describe()}")
    assert res.pvalue < alpha, f"{label}: a biased sampler passed the test (no power): {res.describe()}"
    return res


def counts_of(samples: Sequence[Hashable] | np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Counts array of ``shape`` from samples (ints for 1-d, index tuples / ``[n, d]`` rows otherwise)."""
    arr = np.asarray(samples, dtype=np.int64)
    if len(shape) == 1:
        arr = arr.reshape(-1, 1)
    flat = np.ravel_multi_index(tuple(arr.T), shape)
    return np.bincount(flat, minlength=int(np.prod(shape))).reshape(shape)
