"""Where a conversion's per-head factors and low-rank deltas live in an attention module, and how they fold in.

A conversion changes only weights the model already has, so the converted model has no new parameter and the
same state-dict keys: while it trains, each edited parameter carries a ``torch.nn.utils.parametrize``
parametrization (:class:`Edit`) that computes the edited weight from the original one; :func:`fold` removes
them with ``leave_parametrized=True``, which writes that very weight into the original parameter (same object,
same key). The folded model therefore computes exactly what the student computed: nothing is re-derived.

What goes where (:func:`find_projections` reads it from the module's own attributes):

* **query and key rows** (the low-rank or full deltas a transfer trains; a temperature): the rows of an
  ``nn.Linear`` weight (``q_proj``, ``query``, ``q_lin``...), the rows of a fused one (timm's ``qkv``, ``qkv_proj``:
  ``[q; k; v]``), or the columns of a GPT-2 ``Conv1D`` (``c_attn``, whose weight is ``(in, out)``); the bias entries
  of those rows, or a separate ``q_bias`` (timm's EVA and BEiT, whose fused ``qkv`` has no bias);
* **a per-head output gain**: the input columns of that head in the output projection (``o_proj``, ``out_proj``,
  timm's ``proj``, GPT-2's ``c_proj``), or, where the attention module returns the heads unprojected (BERT, HF ViT),
  the sibling ``output.dense`` that projects them. For x^p, relu and poly1 ``phi(t S) = t^p phi(S)``: a temperature
  only scales a head's output, so the gain is the one factor those activations need, and it folds for q-normed
  models (Qwen3, OLMo-2) and clamped queries (``clip_qkv``) alike;
* **a per-head temperature** (softplus, sigmoid: activations whose pattern it changes): the head's query rows,
  or its slice of a q-norm weight that normalises all heads at once (OLMo-2's ``(heads * head_dim,)``). It cannot
  fold where the q-norm weight is one ``(head_dim,)`` vector shared by all heads (Qwen3, timm's ``qk_norm``) or
  where q is clamped after the projection (OLMo's ``clip_qkv``): :attr:`Projections.temperature_refusal` says so.
* **attention over channels** (``map_layout = "channels"``: XCiT's ``XCA``, EdgeNeXt's ``CrossCovarianceAttn``):
  the "tokens" attended are a head's ``d`` channels, so a head's rows in ``qkv`` and its columns in ``proj`` are
  its ``d = C / heads`` channels (:func:`attention_layers` passes that as ``head_dim``, not the image's token
  count); q and k are L2-normalised over the tokens after the projection, so a scale on the query rows would be
  normalised away: the per-head temperature is the module's own learnable ``temperature`` ``(heads, 1, 1)``, which
  multiplies the normalised q (:attr:`Projections.query_scale`). The low-rank q/k deltas still change the
  pattern: they turn each channel's direction.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..errors import ConfigError

#: Attribute names of separate query / key / value projections (Llama, BERT, DistilBERT, GPT-J...).
QUERY = ("q_proj", "query", "q_lin", "q")
KEY = ("k_proj", "key", "k_lin", "k")
VALUE = ("v_proj", "value", "v_lin", "v")
#: Fused ``[q; k; v]`` projections: timm's ``qkv`` and Phi-3's ``qkv_proj`` (rows), GPT-2's ``c_attn`` (columns).
FUSED = ("qkv", "qkv_proj", "c_attn")
#: Output projections inside the attention module.
OUTPUT = ("o_proj", "out_proj", "proj", "c_proj", "out_lin", "o")
#: Normalisations of q after its projection.
QUERY_NORMS = ("q_norm", "query_norm", "q_layernorm")


@dataclass(frozen=True)
class Block:
    """Entries ``[start, stop)`` along ``axis`` of the parameter ``owner.<name>``: a projection's output features
    (rows of an ``nn.Linear`` weight, columns of a ``Conv1D`` one, entries of a bias or a norm weight) or an output
    projection's input features (columns of an ``nn.Linear`` weight, rows of a ``Conv1D`` one)."""

    owner: nn.Module
    name: str
    axis: int
    start: int
    stop: int

    @property
    def parameter(self) -> Tensor:
        return getattr(self.owner, self.name)

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def inputs(self) -> int:
        """The features along the other axis of a 2-D weight (what a low-rank delta's ``A`` spans)."""
        return self.parameter.shape[1 - self.axis]


@dataclass
class Projections:
    """One attention module's projections, as a conversion edits them (see the module docstring)."""

    name: str  # the module's class, for messages
    heads: int
    kv_heads: int
    head_dim: int
    query: Block
    key: Block
    output: Block | None = None  # None: a per-head gain cannot be folded (output_refusal says why)
    output_refusal: str | None = None
    query_bias: Block | None = None
    key_bias: Block | None = None
    query_norm: list[Block] = field(default_factory=list)  # per-head-sliceable q-norm weight (and bias)
    #: the module that projects the heads when the attention module returns them unprojected (BERT's output.dense)
    outer_output: nn.Module | None = None
    #: why a per-head temperature cannot be folded (None: it can)
    temperature_refusal: str | None = None
    #: a per-head factor on the already normalised queries, one entry per head (XCA's ``temperature``)
    query_scale: Block | None = None
    #: the modules a LoRA adapter goes on for ``q``, ``k``, ``v``, ``o`` (a fused projection under several letters)
    lora_modules: dict[str, nn.Module] = field(default_factory=dict)


def base_layer(module: nn.Module) -> nn.Module:
    """The layer a peft adapter wraps (itself when it wraps none)."""
    getter = getattr(module, "get_base_layer", None)
    return getter() if callable(getter) else module


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a linear layer whose weight is ``(in, out)``; known without importing it."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _out_axis(module: nn.Module) -> int | None:
    """The axis of ``module.weight`` that indexes its output features; None for a module that is no linear layer."""
    if isinstance(module, nn.Linear):
        return 0
    return 1 if is_conv1d(module) else None


def _child(module: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module) and _out_axis(base_layer(child)) is not None:
            return name, child
    return None


def projection_modules(model: nn.Module, module: nn.Module) -> dict[str, nn.Module]:
    """The layers that compute ``module``'s ``q``, ``k``, ``v`` and ``o`` (a fused projection under each of q, k and
    v; ``o`` outside the module for BERT's ``output.dense``); the letters it has none for are left out."""
    found: dict[str, nn.Module] = {}
    separate = [_child(module, names) for names in (QUERY, KEY, VALUE)]
    fused = _child(module, FUSED)
    if separate[0] and separate[1]:
        found.update({letter: s[1] for letter, s in zip("qkv", separate) if s})
    elif fused is not None:
        found.update(dict.fromkeys("qkv", fused[1]))
    inner = _child(module, OUTPUT)
    if inner is not None:
        found["o"] = inner[1]
    else:  # BERT / HF ViT: XSelfAttention returns the heads; the parent's output.dense projects them
        parent = next((m for m in model.modules() if any(c is module for c in m.children())), None)
        dense = getattr(getattr(parent, "output", None), "dense", None)
        if isinstance(dense, nn.Module) and _out_axis(base_layer(dense)) is not None:
            found["o"] = dense
    return found


def library_class(module: nn.Module) -> str:
    """The name of the library class a switched (or parametrized) module was made from, for messages."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith(("polyattn_lightning", "torch.nn.utils.parametrize")):
            return cls.__name__
    return type(module).__name__


def find_projections(model: nn.Module, module: nn.Module, heads: int, head_dim: int) -> Projections:
    """The projections of ``module`` (an attention module of ``model`` attending ``heads`` query heads of
    ``head_dim``), or a :class:`ConfigError` naming its class and what it lacks."""
    name = library_class(module)
    roles = getattr(module, "qkv_roles", "qkv")
    if roles != "qkv":
        raise ConfigError(
            f"convert: {name} attends with its projections' [q; k; v] blocks in the roles {roles} (query, key, "
            "value), which no conversion edits"
        )
    width = heads * head_dim
    modules = projection_modules(model, module)
    if "q" not in modules or "k" not in modules:
        raise ConfigError(
            f"convert: {name} has no query and key projections it knows (separate {'/'.join(QUERY[:3])} and "
            f"{'/'.join(KEY[:3])}, or a fused {'/'.join(FUSED)})"
        )
    query, key = _query_key(modules, name, width)
    found = Projections(name, heads, key.rows // head_dim, head_dim, query, key, lora_modules=modules)
    found.output, found.output_refusal = _output(module, modules.get("o"), name, width)
    if found.output is not None and _child(module, OUTPUT) is None:
        found.outer_output = modules["o"]  # not the module's own: it projects the heads the module returns
    found.query_bias = _query_bias(module, query)
    found.key_bias = _bias_rows(key)  # EVA's and BEiT's k_bias is a fixed zero buffer: none
    found.query_norm, found.temperature_refusal = _query_norm(module, name, width)
    if getattr(module, "map_layout", "tokens") == "channels":
        found.query_scale, found.temperature_refusal = _channel_temperature(module, name, heads)
    clip = getattr(getattr(module, "config", None), "clip_qkv", None)
    if clip is not None and found.temperature_refusal is None:
        found.temperature_refusal = f"{name} clamps its queries after the projection (config.clip_qkv={clip})"
    return found


def _query_key(modules: dict[str, nn.Module], name: str, width: int) -> tuple[Block, Block]:
    q, k = base_layer(modules["q"]), base_layer(modules["k"])
    axis = _out_axis(q)
    if q is not k:
        query = Block(q, "weight", axis, 0, q.weight.shape[axis])
        key = Block(k, "weight", _out_axis(k), 0, k.weight.shape[_out_axis(k)])
        if query.rows != width:
            raise ConfigError(f"convert: {name}'s query projection has {query.rows} outputs, not {width}")
        return query, key
    total = q.weight.shape[axis]
    kv_width = (total - width) // 2
    if kv_width <= 0 or width + 2 * kv_width != total:
        raise ConfigError(f"convert: {name}'s fused projection has {total} outputs, not [q; k; v] for {width} queries")
    return Block(q, "weight", axis, 0, width), Block(q, "weight", axis, width, width + kv_width)


def _output(module: nn.Module, output: nn.Module | None, name: str, width: int) -> tuple[Block | None, str | None]:
    """The output projection's input columns, or why a per-head gain cannot be folded there."""
    if output is None:
        return None, f"{name} has no output projection it knows ({'/'.join(OUTPUT)}, or its parent's output.dense)"
    norm = getattr(module, "norm", None)  # timm's scale_norm: one norm over all heads before the projection
    if isinstance(norm, nn.Module) and not isinstance(norm, nn.Identity):
        return None, f"{name} normalises its heads' outputs together (norm) before projecting them"
    base = base_layer(output)
    axis = 1 - _out_axis(base)
    if base.weight.shape[axis] != width:
        return None, f"{name}'s output projection takes {base.weight.shape[axis]} inputs, not {width}"
    return Block(base, "weight", axis, 0, width), None


def _bias_rows(block: Block) -> Block | None:
    """The bias entries of a projection block's rows (None: its layer has no bias)."""
    bias = getattr(block.owner, "bias", None)
    return Block(block.owner, "bias", 0, block.start, block.stop) if isinstance(bias, Tensor) else None


def _query_bias(module: nn.Module, query: Block) -> Block | None:
    rows = _bias_rows(query)
    if rows is None and isinstance(getattr(module, "q_bias", None), Tensor):
        return Block(module, "q_bias", 0, 0, query.rows)  # timm's EVA / BEiT: qkv without bias, q_bias beside it
    return rows


def _query_norm(module: nn.Module, name: str, width: int) -> tuple[list[Block], str | None]:
    for attribute in QUERY_NORMS:
        norm = getattr(module, attribute, None)
        if norm is None or isinstance(norm, nn.Identity):
            continue
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, Tensor):
            return [], f"{name}'s {attribute} has no weight to scale"
        if weight.numel() != width:
            return [], f"{name}'s {attribute} weight {tuple(weight.shape)} is shared by all heads"
        blocks = [Block(norm, "weight", 0, 0, width)]
        if isinstance(getattr(norm, "bias", None), Tensor):
            blocks.append(Block(norm, "bias", 0, 0, width))
        return blocks, None
    return [], None


def _channel_temperature(module: nn.Module, name: str, heads: int) -> tuple[Block | None, str | None]:
    """Attention over channels: the module's per-head ``temperature`` on its L2-normalised queries (XCA), or, for
    one that does not normalise them (DaViT's ``ChannelAttentionV2``), None: its query rows take the scale."""
    temperature = getattr(module, "temperature", None)
    if isinstance(temperature, Tensor) and temperature.numel() == heads:
        return Block(module, "temperature", 0, 0, heads), None
    if isinstance(temperature, Tensor):
        return None, f"{name}'s temperature {tuple(temperature.shape)} is not one factor per head ({heads})"
    return None, None


# --------------------------------------------------------------------------- the edits


class Edit(nn.Module):
    """A parametrization ``W -> W'`` that edits blocks of ``W`` along one axis: ``(W_b + delta_b) * scale_b``.

    ``delta_b`` is a module giving ``B @ A`` (:class:`LowRank`, ``B`` starting at zero as in LoRA) or a full
    matrix starting at zero (:class:`Full`), ``(rows, inputs)``; ``scale_b`` a module giving one factor per head,
    repeated over the head's entries (one module may scale several blocks: a query temperature scales the weight
    rows and the bias entries alike). ``enabled = False`` gives ``W`` back: the teacher's weights.
    """

    def __init__(self, axis: int):
        super().__init__()
        self.axis = axis
        self.enabled = True
        self.blocks: list[tuple[int, int, int]] = []  # (start, stop, entries per head)
        self.deltas = nn.ModuleList()
        self.factors = nn.ModuleList()

    def add(self, block: Block, delta: nn.Module | None = None, scale: tuple[nn.Module, int] | None = None) -> None:
        """Edit ``block`` with ``delta`` and/or ``scale`` (a module giving ``(heads,)`` factors, and the entries per
        head); a second call for the same block adds what the first left out."""
        spans = [(start, stop) for start, stop, _ in self.blocks]
        if (block.start, block.stop) not in spans:
            self.blocks.append((block.start, block.stop, 0))
            self.deltas.append(nn.Identity())
            self.factors.append(nn.Identity())
        i = spans.index((block.start, block.stop)) if (block.start, block.stop) in spans else len(spans)
        if delta is not None:
            assert isinstance(self.deltas[i], nn.Identity), "one delta per block"
            self.deltas[i] = delta
        if scale is not None:
            assert isinstance(self.factors[i], nn.Identity), "one scale per block"
            self.factors[i] = scale[0]
            self.blocks[i] = (block.start, block.stop, scale[1])

    def forward(self, weight: Tensor) -> Tensor:
        if not self.enabled:
            return weight
        moved = weight.movedim(self.axis, 0)
        pieces, at = [], 0
        for (start, stop, per_head), delta, factors in sorted(
            zip(self.blocks, self.deltas, self.factors), key=lambda edit: edit[0][0]
        ):
            pieces.append(moved[at:start])
            block = moved[start:stop]
            if not isinstance(delta, nn.Identity):
                block = block + delta().to(block.dtype)
            if not isinstance(factors, nn.Identity):
                shape = (-1,) + (1,) * (block.dim() - 1)
                block = block * factors().to(block.dtype).repeat_interleave(per_head).view(shape)
            pieces.append(block)
            at = stop
        pieces.append(moved[at:])
        return torch.cat(pieces).movedim(0, self.axis)


class Factor(nn.Module):
    """One factor per head: ``start * (1 + u)`` (a gain: any sign) or ``start * exp(u)`` (a temperature: > 0),
    ``u`` trained from zero, so Adam's steps are relative to the start."""

    def __init__(self, start: Tensor, positive: bool, trainable: bool = True):
        super().__init__()
        self.register_buffer("start", start.float())
        self.u = nn.Parameter(torch.zeros_like(self.start), requires_grad=trainable)
        self.positive = positive

    def forward(self) -> Tensor:
        return self.start * (self.u.exp() if self.positive else 1 + self.u)


class LowRank(nn.Module):
    """``B @ A``: ``A`` random (Kaiming-uniform, as peft's LoRA), ``B`` zero, so the delta starts at zero."""

    def __init__(self, rows: int, inputs: int, rank: int, generator: torch.Generator, like: Tensor):
        super().__init__()
        bound = (3.0 / inputs) ** 0.5  # kaiming_uniform(a=sqrt(5)) of an (r, inputs) weight
        a = (torch.rand(rank, inputs, generator=generator, dtype=torch.float32) * 2 - 1) * bound
        self.A = nn.Parameter(a.to(like.device))
        self.B = nn.Parameter(torch.zeros(rows, rank, device=like.device))

    def forward(self) -> Tensor:
        return self.B @ self.A


class Full(nn.Module):
    """A full delta of ``shape`` (``(rows, inputs)`` for a weight, ``(rows,)`` for a bias), starting at zero."""

    def __init__(self, *shape: int, like: Tensor):
        super().__init__()
        self.D = nn.Parameter(torch.zeros(*shape, device=like.device))

    def forward(self) -> Tensor:
        return self.D


class Edits:
    """The :class:`Edit` parametrizations of one conversion, one per edited parameter: made on first use,
    toggled together (:meth:`enabled`), folded together (:func:`fold`)."""

    def __init__(self) -> None:
        self.edits: dict[tuple[int, str], tuple[nn.Module, str, Edit]] = {}
        self.orders: dict[int, tuple[nn.Module, list[str]]] = {}  # each owner's parameter order, put back by fold

    def on(self, block: Block) -> Edit:
        """The parametrization of ``block``'s parameter (registered on first use)."""
        key = (id(block.owner), block.name)
        if key not in self.edits:
            self.orders.setdefault(id(block.owner), (block.owner, list(block.owner._parameters)))
            edit = Edit(block.axis)
            parametrize.register_parametrization(block.owner, block.name, edit)
            self.edits[key] = (block.owner, block.name, edit)
        return self.edits[key][2]

    def set_enabled(self, enabled: bool) -> None:
        for _, _, edit in self.edits.values():
            edit.enabled = enabled

    def parameters(self) -> Iterator[nn.Parameter]:
        seen: set[int] = set()
        for _, _, edit in self.edits.values():
            for p in edit.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p


def fold(edits: Edits) -> None:
    """Write every edited weight into its original parameter and remove the parametrizations (exact: the same
    tensor the student computed with)."""
    with torch.no_grad():
        for owner, name, _ in edits.edits.values():
            parametrize.remove_parametrizations(owner, name, leave_parametrized=True)
    for owner, order in edits.orders.values():  # removal appends the parameter: the state-dict order as it was
        owner._parameters = {name: owner._parameters[name] for name in order}
        for name in order:  # an edit computed as a transpose leaves a strided weight (FSDP2 and DCP need it dense)
            parameter = owner._parameters[name]
            if parameter is not None and not parameter.is_contiguous():
                parameter.data = parameter.data.contiguous()
    edits.edits.clear()
    edits.orders.clear()


def scale_queries(edits: Edits, found: Projections, factors: nn.Module) -> None:
    """Scale each head's queries by ``factors()`` (a temperature): the factor on its normalised queries (XCA's
    ``temperature``), its slice of a q-norm that normalises all heads together (rows would be normalised back), else
    its query rows and their bias."""
    if found.temperature_refusal is not None:
        raise ConfigError(f"convert: {found.temperature_refusal}, so a per-head temperature cannot be folded")
    if found.query_scale is not None:
        edits.on(found.query_scale).add(found.query_scale, scale=(factors, 1))
        return
    for block in found.query_norm or [b for b in (found.query, found.query_bias) if b is not None]:
        edits.on(block).add(block, scale=(factors, found.head_dim))


__all__ = [
    "Block",
    "Edit",
    "Edits",
    "Factor",
    "Full",
    "LowRank",
    "Projections",
    "base_layer",
    "find_projections",
    "projection_modules",
    "fold",
    "scale_queries",
]
