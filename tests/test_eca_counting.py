"""Operation counts: the instrumented run agrees with the analytic recursion, and the limits match."""

from fractions import Fraction

import pytest
import torch

from cppo.eca import analytic_count, lower_matmul, masked_matmul, naive_masked, record_ops, upper_matmul
from cppo.eca.counting import cse_terms
from cppo.eca.executor import make_plan
from cppo.eca.scheme import load_scheme


def _measured(form, n, inner, **kwargs):
    meta = dict(device="meta")
    with record_ops() as ops:
        if form == "masked":
            masked_matmul(torch.empty(2, n, inner, **meta), torch.empty(2, n, inner, **meta), **kwargs)
        else:
            run = lower_matmul if form == "lower" else upper_matmul
            run(torch.empty(2, n, n, **meta), torch.empty(2, n, inner, **meta), **kwargs)
    return ops


@pytest.mark.parametrize("scheme", ["eca", "ug444", "naive"])
@pytest.mark.parametrize("form", ["masked", "lower", "upper"])
@pytest.mark.parametrize("n, inner, cutoff", [(4096, 256, 1), (1024, 128, 16), (1000, 60, 4), (64, 64, 64)])
def test_measured_equals_analytic(scheme, form, n, inner, cutoff):
    measured = _measured(form, n, inner, scheme=scheme, cutoff=cutoff)
    assert measured == analytic_count(scheme, form, n, inner, cutoff=cutoff) * 2  # batch of 2


@pytest.mark.parametrize("general", ["strassen", "winograd"])
def test_measured_equals_analytic_with_fast_general_products(general):
    measured = _measured("masked", 4096, 1024, cutoff=64, general=general, general_cutoff=32)
    expected = analytic_count("eca", "masked", 4096, 1024, cutoff=64, general=general, general_cutoff=32) * 2
    assert measured == expected
    assert measured.multiplications < analytic_count("eca", "masked", 4096, 1024, cutoff=64).multiplications * 2


def test_measured_counts_real_run_too():
    a, b = torch.randn(1, 64, 16), torch.randn(1, 64, 16)
    with record_ops() as ops:
        masked_matmul(a, b, cutoff=4)
    assert ops == analytic_count("eca", "masked", 64, 16, cutoff=4)
    assert ops.multiplications < naive_masked(64, 16).multiplications


@pytest.mark.parametrize("scheme, general, recursive", [("eca", 24, 10), ("ug444", 22, 12), ("naive", 24, 16)])
def test_multiplications_have_the_closed_form(scheme, general, recursive):
    # M(n) = g (n/4)^3 + r M(n/4), M(1) = 1, n = d = 4^k  =>  M(n) = c n^3 + (1 - c) r^k, c = g / (64 - r)
    c = Fraction(general, 64 - recursive)
    for k in range(1, 7):
        n = 4**k
        assert analytic_count(scheme, "masked", n, n, cutoff=1).multiplications == c * n**3 + (1 - c) * recursive**k


@pytest.mark.parametrize("scheme, limit", [("eca", Fraction(8, 9)), ("ug444", Fraction(11, 13)), ("naive", Fraction(1))])
def test_multiplication_ratio_tends_to_the_spec_limit(scheme, limit):
    n = 4**9
    ratio = Fraction(analytic_count(scheme, "masked", n, n, cutoff=1).multiplications, naive_masked(n, n).multiplications)
    assert abs(ratio - limit) < Fraction(1, 500)


def test_one_eca_level_is_29_32():
    n = 4**8
    one_level = analytic_count("eca", "masked", n, n, cutoff=n // 4)
    assert abs(Fraction(one_level.multiplications, naive_masked(n, n).multiplications) - Fraction(29, 32)) < 1e-3


def test_eca_addition_structure_per_level():
    plan = make_plan(load_scheme("eca"), "masked")
    plain = lambda m: sum(max(int((row != 0).sum()) - 1, 0) for row in m)  # noqa: E731
    assert (plain(plan.left), plain(plan.right)) == (38, 39)
    # 56 in the spec + 3 + 3 that sum the four width-d/4 recursive products into S00 and S33
    assert plain(plan.out) == 62


def test_total_operations_at_16384_below_naive_and_cse_helps():
    for scheme in ("eca", "ug444"):
        plain = analytic_count(scheme, "masked", 16384, 128, cutoff=8)
        shared = analytic_count(scheme, "masked", 16384, 128, cutoff=8, cse=True)
        naive = naive_masked(16384, 128)
        assert shared.multiplications == plain.multiplications
        assert shared.additions < plain.additions
        assert shared.total / naive.total < plain.total / naive.total < 0.92


def test_cse_shares_pairs():
    added, plain, shared = cse_terms(((1, 1, 1, 0), (1, 1, 0, 1), (0, 1, 1, 1)))
    assert plain == 6 and shared >= 1 and added < plain
    assert cse_terms(((1, 0), (0, 1)))[0] == 0
