import numpy as np
import pytest
import torch

from hierspec.accept import accept_greedy, accept_sampled, speculative_sample, warp_probs
from hierspec.config import SamplingConfig
from hierspec.tree import build_tree


def _logits(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_warp_temperature_one_is_softmax():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    probs = warp_probs(logits, SamplingConfig(temperature=1.0))
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))


def test_warp_temperature_sharpens():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64))
    probs = warp_probs(logits, SamplingConfig(temperature=0.5))
    # p^2 normalised: [0.25, 0.0625, 0.0625] / 0.375
    torch.testing.assert_close(probs, torch.tensor([2 / 3, 1 / 6, 1 / 6], dtype=torch.float64))


def test_warp_top_k_keeps_k_largest():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64))
    probs = warp_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7], dtype=torch.float64))


def test_warp_top_p_keeps_the_token_that_crosses_the_threshold():
    logits = torch.log(torch.tensor([0.1, 0.5, 0.15, 0.25], dtype=torch.float64))
    # sorted: 0.5, 0.25 (mass 0.75 < 0.8), 0.15 crosses 0.8 and is kept, 0.1 dropped
    probs = warp_probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.15, 0.25], dtype=torch.float64) / 0.9)
    # top_p smaller than the largest probability keeps only the argmax
    probs = warp_probs(logits, SamplingConfig(temperature=1.0, top_p=0.3))
    torch.testing.assert_close(probs, torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64))


def test_greedy_accepts_longest_matching_branch():
    tree = build_tree(9, [[1, 2], [3, 4]])  # tokens [9, 1, 3, 2, 4]
    # argmax after root = 3, after node 2 (token 3) = 4, after node 4 (token 4) = 0
    logits = torch.full((5, 5), -1.0, dtype=torch.float64)
    for row, best in enumerate([3, 2, 4, 0, 0]):
        logits[row, best] = 1.0
    verdict = accept_greedy(tree, logits)
    assert verdict.path == (2, 4)
    assert verdict.bonus == 0
    assert verdict.accepted_tokens == [3, 4, 0]
    assert verdict.target_argmax.tolist() == [3, 2, 4, 0, 0]


def test_greedy_rejects_everything_and_returns_target_token():
    tree = build_tree(9, [[1, 2]])
    logits = torch.zeros((3, 5), dtype=torch.float64)
    logits[0, 4] = 1.0
    verdict = accept_greedy(tree, logits)
    assert verdict.path == () and verdict.accepted_tokens == [4]


def test_sampled_acceptance_with_point_mass_follows_the_draft():
    tree = build_tree(9, [[1, 2]])
    logits = torch.full((3, 4), -1e9, dtype=torch.float64)
    logits[0, 1] = 0.0  # target is certain of 1, then 2, then 3
    logits[1, 2] = 0.0
    logits[2, 3] = 0.0
    gen = torch.Generator().manual_seed(0)
    verdict = accept_sampled(tree, logits, SamplingConfig(temperature=1.0), gen)
    assert verdict.accepted_tokens == [1, 2, 3]


def test_speculative_sample_accepts_when_p_dominates_q():
    p = torch.tensor([0.6, 0.4], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    # p(0)/q(0) > 1: always accepted
    assert all(speculative_sample(p, q, 0, gen) == (True, 0) for _ in range(200))


def test_speculative_sample_residual_is_the_only_replacement():
    p = torch.tensor([0.6, 0.4, 0.0], dtype=torch.float64)
    q = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    # draft token 2 has p = 0: always rejected; residual max(p - q, 0) = [0.6, 0, 0] -> always token 0
    assert all(speculative_sample(p, q, 2, gen) == (False, 0) for _ in range(200))


def test_speculative_sample_acceptance_rate_is_p_over_q():
    p = torch.tensor([0.2, 0.8], dtype=torch.float64)
    q = torch.tensor([0.8, 0.2], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    accepted = sum(speculative_sample(p, q, 0, gen)[0] for _ in range(20000))
    assert accepted / 20000 == pytest.approx(0.25, abs=0.015)


def test_row_predictions_match_numpy_argmax_and_a_stable_sort_with_ties_and_nans_on_the_compiled_extension():
    from hierspec.runtime import int4_kernel

    module, reason = int4_kernel.compiled_kernel()
    if module is None:
        pytest.skip(reason)
    assert int4_kernel.loaded_kernel() is module
    gen = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    cases = [(n, k, t) for n, k in [(49152, 8), (49152, 1), (20000, 3), (100, 1), (37, 37), (20, 5)] for t in (1, 2)]
    try:
        for n, k, t in cases:  # on two threads each long row is read in two stretches whose best are merged
            _check_row_predictions_on(n, k, t, gen)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="k must be"):
        module.row_topk(torch.zeros(2, 4), 5)


def _check_row_predictions_on(n: int, k: int, threads: int, gen: torch.Generator) -> None:
    from hierspec.accept import row_argmax, row_predictions

    torch.set_num_threads(threads)
    logits = torch.randint(-40, 40, (6, n), generator=gen).float() / 4  # many ties
    logits[0, 3] = float("nan")
    logits[1, : min(n, 50)] = 99.0  # the row's largest all equal: index order
    logits[2, n - 1] = float("nan")  # a NaN in the tail after the last whole vector
    logits[3, n // 2 :] = float("nan")
    logits[4] = float("-inf")
    argmax, got = row_predictions(logits, k)
    for row, indices in zip(logits.numpy(), got):
        expected = np.argsort(-np.where(np.isnan(row), -np.inf, row), kind="stable")[:k]
        assert indices.tolist() == expected.tolist()
    assert argmax.tolist() == np.argmax(logits.numpy(), axis=1).tolist() == row_argmax(logits).tolist()
    # other dtypes take NumPy's argmax and PyTorch's topk: the same values (tie order may differ)
    wide_argmax, wide = row_predictions(logits.double().nan_to_num(-1e9), k)
    assert wide_argmax.tolist() == np.argmax(logits.nan_to_num(-1e9).numpy(), axis=1).tolist()
    assert np.array_equal(np.take_along_axis(logits.nan_to_num(-1e9).numpy(), wide, 1),
                          np.take_along_axis(logits.nan_to_num(-1e9).numpy(), got, 1))
    one_argmax, one = row_predictions(logits[5:], k)  # a row alone: the same as among others
    assert one_argmax.tolist() == argmax[5:].tolist() and one.tolist() == got[5:].tolist()
