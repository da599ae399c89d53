"""Bilinear 4x4 block schemes for triangular products: loading from text and proving them exact.

A scheme computes O = L V for L lower-triangular, cut into 4x4 blocks L{ij} (i >= j), V into 4x4
blocks V{jk}, O into O{ik}. Each product is p = (sum a L{ij}) (sum b V{jk}) and is added with
coefficients c into output blocks O{ik}. A product whose L-side is a single diagonal block is
itself lower x general: the executor recurses on it. File format: see schemes/eca.txt.
"""

from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from cppo.errors import SchemeError

BLOCKS = 4
Block = tuple[int, int]
Combination = tuple[tuple[Block, int], ...]  # ((block, coefficient), ...), sorted, no zeros

_TERM = re.compile(r"([+-])\s*(\d*)\s*([LVO])([0-3])([0-3])")
_LINE = re.compile(r"^\s*p(\d+)\s*=\s*\((.*)\)\s*\*\s*\((.*)\)\s*->\s*(.*)$")
LOWER_BLOCKS: tuple[Block, ...] = tuple((i, j) for i in range(BLOCKS) for j in range(i + 1))


@dataclass(frozen=True)
class Product:
    """One product p = (sum lower) * (sum general), added into the output blocks with `output`."""

    lower: Combination
    general: Combination
    output: Combination

    @property
    def is_recursive(self) -> bool:
        """True when the L-side is one diagonal block: the product is again lower x general."""
        return len(self.lower) == 1 and self.lower[0][0][0] == self.lower[0][0][1]


@dataclass(frozen=True)
class Scheme:
    """A named list of products; general (plain matrix) products first, then recursive ones."""

    name: str
    products: tuple[Product, ...]

    @property
    def num_general(self) -> int:
        return sum(not p.is_recursive for p in self.products)

    @property
    def num_recursive(self) -> int:
        return sum(p.is_recursive for p in self.products)

    def reversed(self) -> "Scheme":
        """The same scheme for an *upper*-triangular left operand: U X = J (J U J)(J X).

        Block (i, j) of L becomes block (3-i, 3-j) of U, V row j becomes X row 3-j and output
        row i becomes row 3-i. Diagonal blocks stay diagonal, so recursive products stay recursive.
        """
        last = BLOCKS - 1

        def flip(comb: Combination, rows: bool, cols: bool) -> Combination:
            return _normalise(
                ((last - r if rows else r, last - c if cols else c), x) for (r, c), x in comb
            )

        products = tuple(
            Product(flip(p.lower, True, True), flip(p.general, True, False), flip(p.output, True, False))
            for p in self.products
        )
        return Scheme(self.name + "-upper", products)


def _normalise(terms) -> Combination:
    merged: dict[Block, int] = {}
    for block, coefficient in terms:
        merged[block] = merged.get(block, 0) + coefficient
    return tuple(sorted((b, c) for b, c in merged.items() if c != 0))


def _parse_combination(text: str, letter: str, where: str) -> Combination:
    text = text.strip()
    terms, position = [], 0
    for match in _TERM.finditer(text):
        if text[position : match.start()].strip():
            raise SchemeError(f"{where}: cannot read {text[position:match.start()]!r} in {text!r}")
        sign, magnitude, found, row, col = match.groups()
        if found != letter:
            raise SchemeError(f"{where}: term {match.group(0)!r} should be a {letter} block")
        coefficient = int(magnitude or 1) * (-1 if sign == "-" else 1)
        terms.append(((int(row), int(col)), coefficient))
        position = match.end()
    if text[position:].strip() or not terms:
        raise SchemeError(f"{where}: cannot read {letter} combination {text!r}")
    return _normalise(terms)


def parse_scheme(text: str, default_name: str = "scheme") -> Scheme:
    """Parse the text format (one product per line, `name:` header, `#` comments) into a Scheme."""
    name, products, numbers = default_name, [], []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("name:"):
            name = line[5:].strip()
            continue
        match = _LINE.match(line)
        if match is None:
            raise SchemeError(f"line {number}: expected 'pN = (L terms) * (V terms) -> O terms', got {raw!r}")
        where = f"line {number} (p{match.group(1)})"
        lower = _parse_combination(match.group(2), "L", where)
        for (i, j), _ in lower:
            if j > i:
                raise SchemeError(f"{where}: L{i}{j} is above the diagonal of a lower-triangular L")
        products.append(
            Product(lower, _parse_combination(match.group(3), "V", where), _parse_combination(match.group(4), "O", where))
        )
        numbers.append(int(match.group(1)))
    if not products:
        raise SchemeError(f"scheme {name!r}: no products found")
    ordered = sorted(range(len(products)), key=lambda k: (products[k].is_recursive, numbers[k]))
    return Scheme(name, tuple(products[k] for k in ordered))


def verify_scheme(scheme: Scheme) -> None:
    """Prove `scheme` exact symbolically: every coefficient of L{ij} V{jk} in O{ik} must be 1.

    Expands sum_p c_p(O{ik}) a_p(L{ij}) b_p(V{j'k'}) for every output block in integers and compares
    with the block product. Raises SchemeError naming the first output block that does not match.
    """
    got: dict[tuple[Block, Block, Block], int] = {}
    for p in scheme.products:
        for (lb, a), (vb, b), (ob, c) in itertools.product(p.lower, p.general, p.output):
            got[(ob, lb, vb)] = got.get((ob, lb, vb), 0) + a * b * c
    mismatches: dict[str, list[str]] = {}
    for i, k in itertools.product(range(BLOCKS), repeat=2):
        for lb, vb in itertools.product(LOWER_BLOCKS, itertools.product(range(BLOCKS), repeat=2)):
            expected = int(lb[0] == i and vb == (lb[1], k))
            have = got.get(((i, k), lb, vb), 0)
            if have != expected:
                mismatches.setdefault(f"O{i}{k}", []).append(
                    f"L{lb[0]}{lb[1]}*V{vb[0]}{vb[1]} has coefficient {have}, expected {expected}"
                )
    if mismatches:
        first, details = next(iter(mismatches.items()))
        raise SchemeError(
            f"scheme {scheme.name!r} is not exact: output block(s) {', '.join(mismatches)} do not match "
            f"(in {first}: {'; '.join(details[:3])})"
        )


def load_scheme(source: str | Path = "eca", verify: bool = True) -> Scheme:
    """Load a built-in scheme by name ("eca", "ug444") or a scheme file by path; verified by default."""
    if isinstance(source, Scheme):
        return source
    if isinstance(source, str) and source in builtin_scheme_names():
        return _load_builtin(source)
    path = Path(source)
    if not path.is_file():
        raise SchemeError(f"unknown scheme {source!r}: expected one of {builtin_scheme_names()} or a scheme file path")
    scheme = parse_scheme(path.read_text(), default_name=path.stem)
    if verify:
        verify_scheme(scheme)
    return scheme


def builtin_scheme_names() -> tuple[str, ...]:
    """Names of the scheme files shipped in cppo/eca/schemes/."""
    folder = resources.files("cppo.eca") / "schemes"
    return tuple(sorted(f.name[:-4] for f in folder.iterdir() if f.name.endswith(".txt")))


@functools.lru_cache(maxsize=None)
def _load_builtin(name: str) -> Scheme:
    text = (resources.files("cppo.eca") / "schemes" / f"{name}.txt").read_text()
    scheme = parse_scheme(text, default_name=name)
    verify_scheme(scheme)
    return scheme
