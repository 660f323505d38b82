"""Speculative sampling through chained drafters (HSDDW's draft → middle model → target, retrieval → model →
target) is lossless: the chained cases of ``test_sampling_draft_models.py``, in their own file so that the suite's
two workers share the sampling time."""

import pytest

from test_sampling_draft_models import CASES, OWN_CASES, check_case, target, weak  # noqa: F401 (fixtures)


@pytest.mark.parametrize("case", [case for case in CASES if case not in OWN_CASES])
def test_chained_draft_sampling_matches_exact_distribution(target, weak, case):  # noqa: F811
    check_case(target, weak, case)
