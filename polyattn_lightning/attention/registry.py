"""The activation registry: every task takes its attention activation from here.

An attention activation replaces softmax with an elementwise map of the scores
``S = q @ k^T * t``::

    phi(S) = c(n) * f(S + b(n))

where ``n`` is the number of keys a query may attend to (after masking), ``f``
is an elementwise function with derivative ``f'``, ``c(n)`` is a length scale
(``1/sqrt(n)`` for the polynomial paper, ``1/n`` for ReLU attention) and
``b(n)`` a length-dependent shift (``-log n`` for sigmoid attention). Writing
every activation in this one form lets the blocked and Triton kernels treat
them all alike: they only need ``f``, ``f'`` and two numbers per query row.

Activations are made by factories registered under a name. A factory takes the
activation's options (``scale=...`` and so on) as keyword arguments, so a YAML
config can say ``{name: poly3, scale: 0.0714}``. Families with an integer
parameter register a name pattern: ``poly{p}`` makes ``poly1``, ``poly3``, ...
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Union

import torch
from torch import Tensor

from ..errors import ConfigError, UnknownNameError
from .dtypes import compute_dtype
from .forms import FusedForm, form_of

ElementwiseFn = Callable[[Tensor], Tensor]

#: The length scales ``c(n)`` known by name; a float is a fixed scale.
LENGTH_SCALES = ("inv_sqrt_n", "inv_n", "none")


@dataclass(frozen=True)
class Activation:
    """A resolved attention activation ``phi(S) = c(n) * f(S + b(n))``.

    ``softmax`` is the one non-elementwise activation (``fn`` is None); it is
    dispatched to PyTorch's fused ``scaled_dot_product_attention``.
    ``kernel`` names the fused-kernel form (``("poly", 3)``, ``("relu",)``...)
    for activations the fused kernels (C++ on CPU, Triton on CUDA) know; custom
    activations leave it empty and run on the blocked PyTorch kernel.
    """

    name: str
    fn: ElementwiseFn | None = None
    grad: ElementwiseFn | None = None
    scale: float | str = "none"
    shift: str | None = None
    kernel: tuple = field(default=())
    associative: bool = False

    def __post_init__(self):
        if self.fn is not None and self.grad is None:
            raise ValueError(f"activation {self.name!r}: an elementwise activation needs its derivative `grad`")
        if isinstance(self.scale, str) and self.scale not in LENGTH_SCALES:
            raise ConfigError(
                f"activation {self.name!r}: unknown scale {self.scale!r}; expected a float or one of {LENGTH_SCALES}"
            )
        if isinstance(self.scale, bool) or not isinstance(self.scale, (numbers.Real, str)):
            raise ConfigError(f"activation {self.name!r}: scale must be a float or a name, got {self.scale!r}")
        if isinstance(self.scale, numbers.Real) and not self.scale > 0:
            raise ConfigError(f"activation {self.name!r}: scale must be positive, got {self.scale!r}")
        if self.shift not in (None, "neg_log_n"):
            raise ConfigError(f"activation {self.name!r}: unknown shift {self.shift!r}; expected None or 'neg_log_n'")

    @property
    def is_softmax(self) -> bool:
        return self.fn is None

    def row_scale(self, n: Tensor) -> Tensor:
        """``c(n)`` for a tensor of per-row key counts (fp32)."""
        if self.scale == "inv_sqrt_n":
            return n.clamp_min(1).rsqrt()
        if self.scale == "inv_n":
            return n.clamp_min(1).reciprocal()
        value = 1.0 if self.scale == "none" else float(self.scale)
        return torch.full_like(n, value)

    def row_shift(self, n: Tensor) -> Tensor:
        """``b(n)`` for a tensor of per-row key counts (fp32)."""
        if self.shift == "neg_log_n":
            return -torch.log(n.clamp_min(1))
        return torch.zeros_like(n)

    def row_constants(self, n: int) -> tuple[float, float]:
        """``(c(n), b(n))`` for one key count, as floats: a decoding step, where every row attends all ``n``
        keys (:meth:`row_scale` / :meth:`row_shift` in double precision, without a tensor op)."""
        n = max(n, 1)
        if self.scale == "inv_sqrt_n":
            scale = n**-0.5
        elif self.scale == "inv_n":
            scale = 1.0 / n
        else:
            scale = 1.0 if self.scale == "none" else float(self.scale)
        return scale, -math.log(n) if self.shift == "neg_log_n" else 0.0

    @property
    def fused_form(self) -> tuple[FusedForm, int] | None:
        """``(form, power)`` as the fused kernels take it (:mod:`~polyattn_lightning.attention.forms`), or None
        for a form they do not know (a custom activation: it runs on the blocked kernel)."""
        return form_of(self.kernel)

    def per_row(
        self, n: Tensor, shape4: tuple[int, int, int, int], dtype: torch.dtype, shift: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """``(c(n), b(n))`` as contiguous ``(B*H, Nq)`` tensors, the fused kernels' layout; ``b(n)`` is None
        when ``shift`` is False (a kernel that takes no shift for an activation without one)."""
        batch, heads, nq, _ = shape4
        n = n.to(dtype)
        rows = (self.row_scale(n), self.row_shift(n) if shift else None)
        return tuple(
            None if x is None else x.expand(batch, heads, nq, 1).reshape(batch * heads, nq).contiguous() for x in rows
        )

    def __call__(self, scores: Tensor, n: Tensor | float) -> Tensor:
        """``phi(S)`` on materialised scores; ``n`` broadcasts against ``scores``."""
        if self.is_softmax:
            return scores.softmax(dim=-1)
        n = _counts_like(n, scores)
        return self.row_scale(n) * self.fn(scores + self.row_shift(n))

    def derivative(self, scores: Tensor, n: Tensor | float) -> Tensor:
        """``phi'(S)``, elementwise, for the backward kernels and the Jacobian norm."""
        if self.is_softmax:
            raise ValueError("softmax is not elementwise; its Jacobian is not phi'(S)")
        n = _counts_like(n, scores)
        return self.row_scale(n) * self.grad(scores + self.row_shift(n))


def _counts_like(n: Tensor | float, scores: Tensor) -> Tensor:
    """Key counts as a tensor in the scores' compute dtype (so gradcheck sees no fp32 rounding)."""
    return torch.as_tensor(n, dtype=compute_dtype(scores), device=scores.device)


Factory = Callable[..., Activation]
_REGISTRY: dict[str, Factory] = {}
_FAMILIES: dict[str, tuple[re.Pattern, Factory]] = {}
#: Resolved specs, ``(name, sorted options) -> Activation``: models pass their spec on every
#: call, and resolving one checks the factory's signature each time. Emptied by each registration.
_RESOLVED: dict[tuple, Activation] = {}


def register_activation(name: str, factory: Factory | None = None):
    """Register an activation factory under ``name``; usable as a decorator.

    A name with ``{p}`` in it is a family with an integer parameter: the
    factory is called with that integer as its first positional argument, then
    the options as keywords. A name may not clash with a family's members
    (``poly3`` with ``poly{p}``), in either order of registration.

    Example:
        ReLU cubed, scaled by 1/sqrt(N) as ``poly3`` is; without a fused form it runs on the blocked kernel:

        >>> import torch
        >>> from polyattn_lightning import kernel_choice, register_activation
        >>> from polyattn_lightning.attention import Activation, attention
        >>> @register_activation("relu_cubed")
        ... def relu_cubed(scale="inv_sqrt_n"):
        ...     cube, grad = (lambda s: torch.relu(s) ** 3), (lambda s: 3 * torch.relu(s) ** 2)
        ...     return Activation("relu_cubed", cube, grad, scale=scale)
        >>> q, k, v = torch.randn(3, 1, 2, 8, 16).unbind(0)
        >>> attention(q, k, v, "relu_cubed").shape
        torch.Size([1, 2, 8, 16])
        >>> kernel_choice(q, k, v, {"name": "relu_cubed", "scale": 0.1}).kernel
        'blocked'
    """

    def add(fn: Factory) -> Factory:
        if name in _REGISTRY or name in _FAMILIES:
            raise ValueError(f"activation {name!r} is already registered")
        if "{p}" in name:
            pattern = re.compile(re.escape(name).replace(re.escape("{p}"), r"(\d+)") + r"\Z")
            clash = [known for known in _REGISTRY if pattern.match(known)]
        else:
            pattern, clash = None, [family for family, (known, _) in _FAMILIES.items() if known.match(name)]
        if clash:  # a name and a family member would shadow each other
            raise ValueError(f"activation {name!r} clashes with the registered {', '.join(clash)}")
        if pattern is not None:
            _FAMILIES[name] = (pattern, fn)
        else:
            _REGISTRY[name] = fn
        _RESOLVED.clear()
        return fn

    return add(factory) if factory is not None else add


def registered_activations() -> list[str]:
    """Every registered name and family pattern, sorted."""
    return sorted([*_REGISTRY, *_FAMILIES])


#: What names an activation: a registered name (``"poly3"``), a mapping of a name and its options
#: (``{"name": "poly3", "scale": 1/14}``) or an :class:`Activation`.
ActivationSpec = Union[str, Mapping[str, Any], Activation]


def get_activation(spec: ActivationSpec, **overrides) -> Activation:
    """Resolve ``"poly3"``, ``{"name": "poly3", "scale": 1/14}`` or an Activation.

    Keyword ``overrides`` (e.g. ``scale=0.07``) are merged into the options; a
    value of None is ignored so callers can pass optional overrides straight on.
    """
    if isinstance(spec, str) and not overrides:  # a module's spec on every call: one lookup (else some 1 us)
        activation = _RESOLVED.get((spec, ()))
        if activation is not None:
            return activation
    if isinstance(spec, Activation):
        if any(v is not None for v in overrides.values()):
            raise ValueError(f"options {sorted(overrides)} cannot be applied to an already built Activation")
        return spec
    if isinstance(spec, Mapping):
        options = dict(spec)
        if "name" not in options:
            raise ConfigError(f"an activation spec needs a 'name' key, got {dict(spec)!r}")
        name = options.pop("name")
    elif isinstance(spec, str):
        name, options = spec, {}
    else:
        raise TypeError(
            f"activation must be a name, a mapping with 'name', or an Activation; got {type(spec).__name__}"
        )
    options.update({k: v for k, v in overrides.items() if v is not None})
    key = (name, tuple((option, type(value), value) for option, value in sorted(options.items())))
    try:
        activation = _RESOLVED.get(key)
    except TypeError:  # an unhashable option value: resolve without the cache
        return _resolve(name, options)
    if activation is None:
        activation = _RESOLVED[key] = _resolve(name, options)
    return activation


def _resolve(name: str, options: dict) -> Activation:
    """Build the activation registered under ``name`` with ``options``."""
    if name in _REGISTRY:
        factory, args = _REGISTRY[name], ()
    else:
        for pattern, family_factory in _FAMILIES.values():
            match = pattern.match(name)
            if match:
                factory, args = family_factory, (int(match.group(1)),)
                break
        else:
            raise UnknownNameError(
                f"unknown attention activation {name!r}; registered: {', '.join(registered_activations())}"
            )
    try:  # check the options against the factory's signature, not errors raised inside it
        inspect.signature(factory).bind(*args, **options)
    except TypeError as err:
        raise ConfigError(f"bad options {options!r} for attention activation {name!r}: {err}") from None
    return factory(*args, **options)


# --------------------------------------------------------------------------- built-ins


@register_activation("softmax")
def softmax() -> Activation:
    """Standard attention; runs on PyTorch's fused SDPA."""
    return Activation("softmax")


#: The powers ``poly{p}`` accepts: a higher one is far more likely a typo (``poly33`` for ``poly3``) than meant.
POLY_POWERS = range(1, 9)


@register_activation("poly{p}")
def poly(p: int, scale: float | str = "inv_sqrt_n") -> Activation:
    """``S^p * c``: the polynomial-attention paper (x^3 and x, scale 1/sqrt(N)); powers 1-8."""
    if p not in POLY_POWERS:
        raise ConfigError(
            f"poly{p}: the power must be an integer from {POLY_POWERS.start} to {POLY_POWERS.stop - 1}, got {p}"
        )
    fn, grad = partial(_power, p=p), partial(_power_grad, p=p)
    return Activation(f"poly{p}", fn, grad, scale=scale, kernel=("poly", p), associative=(p == 1))


@register_activation("relu")
def relu(scale: float | str = "inv_n") -> Activation:
    """``relu(S) / N`` (Wortsman et al. 2023); a cubic spline per the spline paper."""
    return Activation("relu", torch.relu, _step, scale=scale, kernel=("relu",))


@register_activation("softplus")
def softplus(scale: float | str = "inv_n") -> Activation:
    """``softplus(S) / N``: the smooth form of ReLU attention the spline paper recommends."""
    return Activation("softplus", torch.nn.functional.softplus, torch.sigmoid, scale=scale, kernel=("softplus",))


@register_activation("sigmoid")
def sigmoid(scale: float | str = "none") -> Activation:
    """``sigmoid(S - log N)`` (Ramapuram et al. 2024)."""
    return Activation("sigmoid", torch.sigmoid, _sigmoid_grad, scale=scale, shift="neg_log_n", kernel=("sigmoid",))


# Module-level derivatives (not lambdas) so activations, and models holding them, pickle.
def _power(s: Tensor, p: int) -> Tensor:
    return s if p == 1 else s.pow(p)


def _power_grad(s: Tensor, p: int) -> Tensor:
    return torch.ones_like(s) if p == 1 else p * s.pow(p - 1)


def _step(s: Tensor) -> Tensor:
    return (s > 0).to(s.dtype)


def _sigmoid_grad(s: Tensor) -> Tensor:
    sig = torch.sigmoid(s)
    return sig * (1 - sig)


def describe(activation: Activation) -> str:
    """A short human-readable form, e.g. ``poly3[scale=0.0714]``, for logs."""
    if activation.is_softmax:
        return "softmax"
    scale = activation.scale if isinstance(activation.scale, str) else f"{activation.scale:.4g}"
    return f"{activation.name}[scale={scale}]"


__all__ = [
    "Activation",
    "ActivationSpec",
    "LENGTH_SCALES",
    "describe",
    "get_activation",
    "register_activation",
    "registered_activations",
]
