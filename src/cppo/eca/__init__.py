"""ECA: exact causal attention with fewer multiplications (4x4 triangular block schemes).

Public API:
    masked_matmul(a, b)        tril(a @ b^T)           (..., n, m), (..., n, m) -> (..., n, n)
    lower_matmul(l, x)         tril(l) @ x             (..., n, n), (..., n, d) -> (..., n, d)
    upper_matmul(u, x)         triu(u) @ x             (..., n, n), (..., n, d) -> (..., n, d)
    eca_attention(q, k, v)     causal attention, autograd; (batch, heads, L, d)
    register_eca_attention()   attn_implementation="eca" in transformers
    load_scheme / verify_scheme / analytic_count / record_ops   schemes and operation counts
"""

from cppo.errors import SchemeError

from .attention import ATTENTION_CUTOFF, eca_attention
from .counting import OpCount, analytic_count, naive_masked, naive_triangular, record_ops
from .executor import DEFAULT_CUTOFF, lower_matmul, masked_matmul, upper_matmul
from .hf import register_eca_attention
from .scheme import Scheme, builtin_scheme_names, load_scheme, parse_scheme, verify_scheme
from .workspace import release_workspace

__all__ = [
    "ATTENTION_CUTOFF",
    "DEFAULT_CUTOFF",
    "OpCount",
    "Scheme",
    "SchemeError",
    "analytic_count",
    "builtin_scheme_names",
    "eca_attention",
    "load_scheme",
    "lower_matmul",
    "masked_matmul",
    "naive_masked",
    "naive_triangular",
    "parse_scheme",
    "record_ops",
    "register_eca_attention",
    "release_workspace",
    "upper_matmul",
    "verify_scheme",
]
