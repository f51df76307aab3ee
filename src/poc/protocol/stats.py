"""The binomial fraud test both protocols use (spec-v1 §3.4, spec-v2 §d)."""

from scipy.stats import binomtest


def binomial_p_value(n_bad: int, n_total: int, p_bad: float) -> float:
    """P[X >= n_bad] for X ~ Bin(n_total, p_bad); 1.0 for an empty sample."""
    if n_total <= 0:
        return 1.0
    return float(binomtest(k=int(n_bad), n=int(n_total), p=float(p_bad), alternative="greater").pvalue)


def fraud_test(n_bad: int, n_total: int, p_bad: float, fraud_threshold: float) -> tuple[float, bool]:
    """(p_value, fraud_detected): fraud when the p-value falls under the threshold."""
    p = binomial_p_value(n_bad, n_total, p_bad)
    return p, (n_total > 0 and p < fraud_threshold)
