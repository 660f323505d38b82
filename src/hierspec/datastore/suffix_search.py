"""Suffix-array search kernels, compiled with numba: exact-match ranges and continuation gathering.

``tokens`` is the corpus (documents joined, each followed by a separator); ``sa`` its suffix array. Every function
is pure and works on memory-mapped arrays without copying them. Numba does not check bounds, so every position read
from ``sa`` is checked here before it is used: a corrupt store gives wrong answers, never a read outside an array.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _compare(tokens, start, pattern):
    """-1, 0 or 1 as the suffix at ``start`` sorts before, starts with, or sorts after ``pattern`` (a position
    outside the corpus counts as an empty suffix)."""
    n = tokens.shape[0]
    if start < 0 or start >= n:
        return -1
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
def sa_range_within(tokens, sa, pattern, lo, hi):
    """``(lo, hi)``: the suffix-array rows whose suffixes start with ``pattern`` (``lo == hi`` when none), searched
    only among rows ``[lo, hi)`` (which must hold them all: e.g. the range of ``pattern``'s first token)."""
    lo, hi = max(np.int64(lo), np.int64(0)), min(np.int64(hi), np.int64(sa.shape[0]))
    end = hi
    while lo < hi:  # first row whose suffix is >= pattern
        mid = (lo + hi) // 2
        if _compare(tokens, np.int64(sa[mid]), pattern) < 0:
            lo = mid + 1
        else:
            hi = mid
    first = lo
    hi = end
    while lo < hi:  # first row whose suffix sorts after every string starting with pattern
        mid = (lo + hi) // 2
        if _compare(tokens, np.int64(sa[mid]), pattern) <= 0:
            lo = mid + 1
        else:
            hi = mid
    return first, lo


@njit(cache=True, nogil=True)
def sa_range(tokens, sa, pattern):
    """``(lo, hi)``: the suffix-array rows whose suffixes start with ``pattern`` (``lo == hi`` when none)."""
    return sa_range_within(tokens, sa, pattern, 0, sa.shape[0])


@njit(cache=True, nogil=True)
def gather_continuations(tokens, sa, lo, hi, skip, k, m, separator, vocab_size):
    """Up to ``k`` continuations of ``m`` tokens after the matches in rows ``[lo, hi)``.

    ``skip`` is the match length (the continuation starts ``skip`` tokens after each suffix start). When the range
    holds more than ``k`` rows, ``k`` rows evenly spaced across it are taken, so the sample follows the frequencies
    of the whole range deterministically. Positions after a separator, a token id outside ``[0, vocab_size)`` or the
    corpus end are ``-1``.
    """
    lo = max(lo, 0)
    hi = min(hi, sa.shape[0])
    count = hi - lo
    take = max(0, count if count < k else k)
    out = np.full((take, m), -1, dtype=np.int64)
    n = tokens.shape[0]
    for r in range(take):
        row = lo + (r * count) // take
        start = np.int64(sa[row])
        if start < 0 or start >= n:
            continue
        start += skip
        for j in range(m):
            pos = start + j
            if pos >= n:
                break
            t = np.int64(tokens[pos])
            if t == separator or t >= vocab_size:
                break
            out[r, j] = t
    return out


@njit(cache=True, nogil=True)
def first_bad_token(tokens, vocab_size, separator):
    """Position of the first token id that is neither in ``[0, vocab_size)`` nor the separator, else -1."""
    for i in range(tokens.shape[0]):
        t = np.int64(tokens[i])
        if t != separator and (t < 0 or t >= vocab_size):
            return i
    return -1


@njit(cache=True, nogil=True)
def _suffix_array_fault_code(tokens, sa):
    """0 when ``sa`` is the sorted suffix array of ``tokens``; else 1 (out of range), 2 (a position twice) or 3
    (two neighbouring suffixes out of order), with the row where it was found."""
    n = tokens.shape[0]
    seen = np.zeros(n, dtype=np.bool_)
    for row in range(sa.shape[0]):
        pos = np.int64(sa[row])
        if pos < 0 or pos >= n:
            return 1, row
        if seen[pos]:
            return 2, row
        seen[pos] = True
    for row in range(1, sa.shape[0]):
        a = np.int64(sa[row - 1])
        b = np.int64(sa[row])
        while a < n and b < n and tokens[a] == tokens[b]:
            a += 1
            b += 1
        if b >= n or (a < n and tokens[a] > tokens[b]):  # the earlier suffix must sort first
            return 3, row
    return 0, -1


def suffix_array_fault(tokens: np.ndarray, sa: np.ndarray) -> str | None:
    """``None`` when ``sa`` is the sorted suffix array of ``tokens``, else what is wrong with it."""
    code, row = _suffix_array_fault_code(tokens, sa)
    return {0: None, 1: f"suffix array row {row} points outside the tokens",
            2: f"suffix array row {row} repeats a position", 3: f"suffix array rows {row - 1} and {row} are out of "
            "order"}[int(code)]


def as_pattern(tokens: np.ndarray) -> np.ndarray:
    """A contiguous int64 copy of query tokens, the layout the kernels expect."""
    return np.ascontiguousarray(tokens, dtype=np.int64)
