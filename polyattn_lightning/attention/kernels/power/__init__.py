"""``power``: the exact linear-time form of ``poly{p}`` attention for p = 2..4 (p = 1 is ``associative``).

``(q . k)^p = <m(q), w m(k)>`` over the ``D = C(d+p-1, p)`` monomials of degree p (``base/state.py``), so ``x^p``
attention is ``c(n) t^p m(Q) (w m(K))^T V``: O(N D dv) instead of O(N^2 d). Because the scale is ``c(n)``
(``1/sqrt(N)``; no row-sum denominator, unlike softmax or linear attention) the identity holds for odd p as well: a
padded key drops out when its features are zeroed and ``n`` counts the rest. Score bias and attention dropout do not
factor and stay on the quadratic kernels; RoPE (applied to q and k before) does factor. D grows fast: 528 (d = 32,
p = 2), 2,080 (d = 64, p = 2), 5,984 (d = 32, p = 3), 45,760 (d = 64, p = 3), 52,360 (d = 32, p = 4).

Shaped as fla shapes an op: ``parallel.py`` (every row at once: C++ on CPU, Triton on CUDA), ``recurrent.py`` (the
next tokens from a recurrent state, which a causal model may keep instead of its keys: C++ on CPU, PyTorch
elsewhere), ``naive.py`` (both written from the formula: the references), ``backend.py`` (what the backend takes
and which form runs). ``kernel="auto"`` compares the parallel form's cost with the quadratic kernels': the two meet
at the crossover length measured on the machine (``crossover.json``; ``base.costs.crossover_length``).
"""

from .... import deprecated
from .backend import BACKEND, CUDA_MAX_HEAD_DIM, POWERS, Power
from .parallel import chunk_size, power_attention


def __getattr__(name: str):
    """Names that moved to ``base/state.py``, ``parallel.py`` and ``recurrent.py``, or went (``deprecated.py``)."""
    return deprecated.attribute(__name__, name)


__all__ = ["BACKEND", "CUDA_MAX_HEAD_DIM", "POWERS", "Power", "chunk_size", "power_attention"]
