"""Suffix-array search kernels, compiled with numba: exact-match ranges and continuation gathering.

``tokens`` is the corpus (documents joined, each followed by a separator); ``sa`` its suffix array. Every function
is pure and works on memory-mapped arrays without copying them.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _compare(tokens, start, pattern):
    """-1, 0 or 1 as the suffix at ``start`` sorts before, starts with, or sorts after ``pattern``."""
    n = tokens.shape[0]
    for j in range(pattern.shape[0]):
        pos = start + j
        if pos >= n:
            return -1  # a suffix that ends early sorts first
        t = np.int64(tokens[pos])
        if t < pattern[j]:
            return -1
        if t > pattern[j]:
            return 1
    return 0


@njit(cache=True, nogil=True)
def sa_range(tokens, sa, pattern):
    """``(lo, hi)``: the suffix-array rows whose suffixes start with ``pattern`` (``lo == hi`` when none)."""
    lo, hi = 0, sa.shape[0]
    while lo < hi:  # first row whose suffix is >= pattern
        mid = (lo + hi) // 2
        if _compare(tokens, np.int64(sa[mid]), pattern) < 0:
            lo = mid + 1
        else:
            hi = mid
    first = lo
    hi = sa.shape[0]
    while lo < hi:  # first row whose suffix sorts after every string starting with pattern
        mid = (lo + hi) // 2
        if _compare(tokens, np.int64(sa[mid]), pattern) <= 0:
            lo = mid + 1
        else:
            hi = mid
    return first, lo


@njit(cache=True, nogil=True)
def gather_continuations(tokens, sa, lo, hi, skip, k, m, separator):
    """Up to ``k`` continuations of ``m`` tokens after the matches in rows ``[lo, hi)``.

    ``skip`` is the match length (the continuation starts ``skip`` tokens after each suffix start). When the range
    holds more than ``k`` rows, ``k`` rows evenly spaced across it are taken, so the sample follows the frequencies
    of the whole range deterministically. Positions after a separator or the corpus end are ``-1``.
    """
    count = hi - lo
    take = count if count < k else k
    out = np.full((take, m), -1, dtype=np.int64)
    n = tokens.shape[0]
    for r in range(take):
        row = lo + (r * count) // take
        start = np.int64(sa[row]) + skip
        for j in range(m):
            pos = start + j
            if pos >= n:
                break
            t = np.int64(tokens[pos])
            if t == separator:
                break
            out[r, j] = t
    return out


def as_pattern(tokens: np.ndarray) -> np.ndarray:
    """A contiguous int64 copy of query tokens, the layout the kernels expect."""
    return np.ascontiguousarray(tokens, dtype=np.int64)
