"""The int4 path's compiled RMS norm: transformers' formula to float32 rounding, and each row's result independent
of the rows beside it."""

import torch

from hierspec.runtime.decoder import _rms_norm
from hierspec.runtime.norm_kernel import rms_norm


def test_compiled_norm_matches_the_pytorch_formula_and_is_row_invariant():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 576, generator=gen) * 3
    weight = torch.rand(576, generator=gen) + 0.5
    together = rms_norm(hidden, weight, 1e-5)
    torch.testing.assert_close(together, _rms_norm(hidden, weight, 1e-5), rtol=1e-6, atol=1e-6)
    for row in range(37):
        assert torch.equal(rms_norm(hidden[row : row + 1], weight, 1e-5)[0], together[row])


def test_compiled_norm_reads_a_strided_selection_of_rows():
    hidden = torch.randn(8, 64)
    weight = torch.rand(64)
    picked = hidden[[1, 5, 6]]
    assert torch.equal(rms_norm(hidden[1::4], weight, 1e-6), rms_norm(hidden[[1, 5]].clone(), weight, 1e-6))
    torch.testing.assert_close(rms_norm(picked, weight, 1e-6), _rms_norm(picked, weight, 1e-6), rtol=1e-6, atol=1e-6)
