"""Goodness of fit for the sampling tests."""

from __future__ import annotations

import torch


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` [n] against the distribution `expected_probs` [n]."""
    expected = expected_probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
