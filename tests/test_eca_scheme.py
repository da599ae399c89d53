"""Scheme files: parsing, the symbolic exactness proof, and errors that name what is wrong."""

from importlib import resources

import pytest

from cppo.eca import builtin_scheme_names, load_scheme, parse_scheme, verify_scheme
from cppo.errors import SchemeError


def _text(name: str) -> str:
    return (resources.files("cppo.eca") / "schemes" / f"{name}.txt").read_text()


@pytest.mark.parametrize("name, general, recursive", [("eca", 24, 10), ("ug444", 22, 12), ("naive", 24, 16)])
def test_builtin_schemes_load_verified_with_expected_shape(name, general, recursive):
    scheme = load_scheme(name)
    assert (scheme.num_general, scheme.num_recursive) == (general, recursive)
    assert all(not p.is_recursive for p in scheme.products[:general])  # general products come first
    verify_scheme(scheme.reversed().reversed())


def test_builtin_names():
    assert set(builtin_scheme_names()) >= {"eca", "ug444", "naive"}


def test_wrong_output_coefficient_is_rejected_naming_the_block():
    # p1 of ECA feeds O13 and O22; moving its second output to O23 breaks O22 and O23.
    text = _text("eca").replace("->  +O13 +O22", "->  +O13 +O23", 1)
    with pytest.raises(SchemeError, match=r"output block\(s\) O22, O23 do not match"):
        verify_scheme(parse_scheme(text))


def test_wrong_coefficient_in_a_scheme_file_fails_to_load(tmp_path):
    path = tmp_path / "broken.txt"
    path.write_text(_text("ug444").replace("(+L21) * (+V00 +V10)", "(+L21) * (+V00 -V10)", 1))
    with pytest.raises(SchemeError, match="O20"):
        load_scheme(path)
    assert load_scheme(path, verify=False).name == "ug444"


def test_dropping_a_product_is_rejected():
    lines = [line for line in _text("naive").splitlines() if not line.startswith("p40 ")]
    with pytest.raises(SchemeError, match="O33"):
        verify_scheme(parse_scheme("\n".join(lines)))


@pytest.mark.parametrize(
    "line, message",
    [
        ("p1 = (+L01) * (+V10) -> +O01", "above the diagonal"),
        ("p1 = (+V00) * (+V00) -> +O00", "should be a L block"),
        ("p1 = (+L00) * (+V00) -> +O00 junk", "cannot read"),
        ("p1 = (+L00) * (+V00)", "expected 'pN ="),
    ],
)
def test_parse_errors_name_the_line(line, message):
    with pytest.raises(SchemeError, match=message):
        parse_scheme(line)


def test_unknown_scheme_name():
    with pytest.raises(SchemeError, match="unknown scheme 'nope'"):
        load_scheme("nope")


def test_coefficients_other_than_one_are_parsed():
    scheme = load_scheme("ug444")
    assert any(c == -2 for p in scheme.products for _, c in p.general)
