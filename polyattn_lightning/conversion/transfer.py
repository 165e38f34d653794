"""``method="transfer"``: layer-local attention transfer (stage 1 of LoLCATs, arXiv 2410.10254), then folded.

The teacher is the model with softmax (:mod:`.teacher`): each step, it runs once on a sample batch with hooks
that record every attention layer's inputs and outputs. The student is the same layers with the new activation
and a few trainable edits (:mod:`.folding`), each run on the teacher's own inputs, so the layers are independent;
the loss is the sum over layers of their relative squared errors (``sum ||student - softmax||^2 / sum
||softmax||^2``, so layers of any width weigh alike; LoLCATs' MSE times 1000 is the same idea). What trains:

* the query and key projections, which decide attention's pattern (``qk="lora"``: a rank-``rank`` delta on the
  query rows and on the key rows, fused projections included; ``"full"``: full deltas; ``"none"``: the
  factor-only ablation), and their bias entries where they have them (``bias``): a key bias adds ``q . b_k`` to
  every score of a query, which softmax ignores and x^p does not (it mixes lower powers of the scores in);
* one factor per head: for x^p, relu and poly1 (``phi(t S) = t^p phi(S)``) the head's output gain, folded into
  the output projection's input slice of that head, started at its closed-form least-squares value ``<phi(S) v,
  softmax(S) v> / ||phi(S) v||^2`` (any sign); for other activations (softplus, sigmoid) a temperature on the
  head's queries (started at calibration's grid value, kept positive) and the output gain.

What stops it is samples it does not train on: ``holdout`` of the samples (a fraction, spread evenly through
them: :mod:`.holdout`) are held out, and every ``check_every`` steps their layer error (the same sum of relative
errors) is measured; the transfer stops when it has not fallen by ``min_delta`` (relative) for ``patience`` checks
in a row, and the weights it keeps are those of the check with the lowest held-out error (the closed-form start
is the first check, so a transfer that only fits its training samples better ends where it started). ``steps``
(Adam steps at ``lr``, one batch each, passes over the training part repeated) is only a bound, a warning when
reached with the held-out error still falling. With ``holdout`` 0 the same rule runs on the mean training loss
since the previous check. A line about every ``PROGRESS_SECONDS`` logs what it does: the layers, step and both
errors while it trains, the pass over the samples before and after.

Memory is one batch of recorded layer inputs, and ``layers_per_pass`` bounds the layers trained (and recorded)
at once for big models: each chunk stops, and keeps its best weights, on its own layers' held-out error. At the
end every edit is folded (:func:`~.folding.fold`): the converted model has no new parameter, the same state-dict
keys, and computes exactly what the trained student did.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from ..attention.registry import ActivationSpec, get_activation
from ..attention.switch import AttentionInputs, attention_map
from ..errors import ConfigError, options_checked
from .calibrate import TEMPERATURES, temperature_errors
from .folding import Edits, Factor, Full, LowRank, Projections, fold, scale_queries
from .teacher import Batch, Layer, layer_errors, layer_output, quiet, record, squared_errors, token_weights

#: ``qk`` values: what of the query and key projections trains.
QK_MODES = ("lora", "full", "none")
#: Seconds between two progress lines of a running transfer.
PROGRESS_SECONDS = 10.0


@options_checked("convert")
@dataclass
class TransferOptions:
    """How the student trains (:mod:`.transfer`'s docstring): what of the query and key projections trains
    (``qk``: ``lora`` of rank ``rank``, ``full`` or ``none``) and their ``bias``; Adam's ``lr``; the fraction of the
    samples held out (``holdout``), checked every ``check_every`` steps, stopping after ``patience`` checks without
    a ``min_delta`` (relative) fall, ``steps`` at most; ``layers_per_pass`` (None: all) trained at once; the
    ``seed`` of the LoRA deltas' start."""

    qk: str = "lora"
    rank: int = 8
    lr: float = 3e-3
    steps: int = 2000
    patience: int = 5
    min_delta: float = 0.005
    holdout: float = 0.25
    check_every: int = 20
    layers_per_pass: int | None = None
    seed: int = 0
    bias: bool = True

    def __post_init__(self):
        if self.qk not in QK_MODES:
            raise ConfigError(f"convert.qk: {self.qk!r} is not one of {', '.join(QK_MODES)}")
        for name in ("rank", "steps", "patience", "check_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"convert.{name} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"convert.lr must be positive, got {self.lr}")
        if not 0 <= self.holdout < 1:
            raise ConfigError(f"convert.holdout is the fraction of the samples held out, in [0, 1), got {self.holdout}")
        if self.layers_per_pass is not None and self.layers_per_pass < 1:
            raise ConfigError(f"convert.layers_per_pass must be at least 1 (or null: all), got {self.layers_per_pass}")


def homogeneous_degree(spec: ActivationSpec) -> int | None:
    """``p`` where ``phi(t S) = t^p phi(S)`` for ``t > 0`` (x^p: p; relu: 1), None for other activations."""
    act = get_activation(spec)
    if act.shift is not None or not act.kernel:
        return None
    if act.kernel[0] == "poly":
        return int(act.kernel[1])
    return 1 if act.kernel[0] == "relu" else None


class HeadGain(nn.Module):
    """A head's output gain ``g`` for a homogeneous activation of degree ``p``, where it is trained and folded.

    Where the queries can be scaled per head (no shared q-norm, no clamp) it lives there, as the temperature
    ``|g|^(1/p)`` (``phi(t S) = t^p phi(S)``), with only its sign on the output projection; else (Qwen3) on the
    output projection's columns. Why not always the output: the small gains x^3 heads get there leave columns far
    smaller than the rest, on which Adam's first steps of a fine-tune (a fixed size per entry) are changes of
    their whole size, and one fine-tuning step undid what the transfer reached (the tiny Llama's perplexity:
    docs/benchmarks/conversion.md).
    """

    def __init__(self, start: Tensor, degree: int | None):
        super().__init__()
        self.degree = degree
        if degree is None:
            self.temperature, self.output = None, Factor(start, positive=False)
        else:
            sign = torch.where(start < 0, -1.0, 1.0).to(start)
            self.temperature = Factor(start.abs().clamp_min(1e-12) ** (1.0 / degree), positive=True)
            self.output = Factor(sign, positive=False, trainable=False)

    def forward(self) -> Tensor:
        """The gain on the head's output."""
        if self.temperature is None:
            return self.output()
        return self.output() * self.temperature() ** self.degree


@dataclass
class TransferResult:
    """What the transfer did: the factors it folded, the steps it took, why it stopped, the weights it kept and
    its checks (``curve``: one ``[first layer of the chunk, step, mean training loss since the previous check,
    held-out error or None]`` per check, both summed over the chunk's layers)."""

    gains: list[list[float]]
    temperatures: list[list[float]] | None
    steps: int
    stopped: str  # "held-out" (its error stopped falling), "plateau" (no held-out part: the training loss), "steps"
    kept_steps: list[int]  # per chunk of layers, the step whose weights were kept (0: the closed-form start)
    curve: list[list[float | None]]
    trainable: int
    seconds: float


class EarlyStop:
    """The stopping rule on a measured error (the module docstring): the lowest error seen, whose ``parameters``
    are kept, and the checks in a row that have not lowered the reference by ``min_delta``."""

    def __init__(self, parameters: Sequence[nn.Parameter], options: TransferOptions):
        self.parameters, self.patience, self.min_delta = list(parameters), options.patience, options.min_delta
        self.lowest = self.reference = math.inf
        self.waited = self.best_step = 0
        self.kept: list[Tensor] | None = None

    def update(self, step: int, error: float) -> None:
        if error < self.lowest:
            self.lowest, self.best_step = error, step
            self.kept = [p.detach().clone() for p in self.parameters]
        if error < self.reference * (1 - self.min_delta):
            self.reference, self.waited = error, 0
        else:
            self.waited += 1

    @property
    def done(self) -> bool:
        return self.waited >= self.patience

    def restore(self) -> None:
        """Put the kept parameters back."""
        if self.kept is not None:
            with torch.no_grad():
                for parameter, kept in zip(self.parameters, self.kept):
                    parameter.copy_(kept)


class Progress:
    """A running transfer's lines (``rank_zero_info``: the terminal and the log), so that no wait of more than about
    :data:`PROGRESS_SECONDS` goes unsaid: :meth:`say` one unconditionally; :meth:`phase` names a pass over the
    samples (the measures before and after the training, the closed-form start) when the last line is that old;
    :meth:`step`, as often while a chunk of layers trains, its step and its last check's errors (the mean over its
    layers); :meth:`chunk_done` when it stops."""

    def __init__(self, layers: int, options: TransferOptions):
        self.layers, self.options = layers, options
        self.last = time.perf_counter()

    def say(self, line: str) -> None:
        rank_zero_info(line)
        self.last = time.perf_counter()

    def due(self) -> bool:
        return time.perf_counter() - self.last >= PROGRESS_SECONDS

    def phase(self, what: str) -> None:
        if self.due():
            self.say(f"convert transfer: {what}")

    def named(self, chunk: Sequence[int]) -> str:
        """``layers 1-6 of 6``: the chunk of layers training."""
        which = f"layer {chunk[0] + 1}" if len(chunk) == 1 else f"layers {chunk[0] + 1}-{chunk[-1] + 1}"
        return f"{which} of {self.layers}"

    def step(self, chunk: Sequence[int], step: int, curve: Sequence[list], stop: EarlyStop) -> None:
        if not self.due():
            return
        line = f"convert transfer: {self.named(chunk)}, step {step} (at most {self.options.steps})"
        _, checked, training, held_out = curve[-1] if curve and curve[-1][0] == chunk[0] else (0, 0, None, None)
        if training is not None:
            line += f"; at step {checked}: training error {training / len(chunk):.4g}"
        if held_out is not None:
            line += (
                f", held-out {held_out / len(chunk):.4g} (lowest {stop.lowest / len(chunk):.4g}, step {stop.best_step})"
            )
        self.say(line)

    def chunk_done(self, chunk: Sequence[int], step: int, stop: EarlyStop, held_out: bool) -> None:
        measured = "held-out error" if held_out else "training loss"
        why = (
            f"its {measured} fell less than {self.options.min_delta:g} for {self.options.patience} checks"
            if stop.done
            else "the step cap, still improving"
        )
        self.say(
            f"convert transfer: {self.named(chunk)} stopped at step {step} ({why}); kept the weights of step "
            f"{stop.best_step}, {measured} {stop.lowest / len(chunk):.4g} per layer"
        )


class Student:
    """The edits of one transfer on every layer (see the module docstring); :meth:`fit`, then :meth:`fold`."""

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[Layer],
        projections: Sequence[Projections],
        spec: ActivationSpec,
        options: TransferOptions,
        samples: Sequence[Batch],
    ):
        self.model, self.layers, self.spec, self.options = model, list(layers), spec, options
        degree = homogeneous_degree(spec)
        for found in projections:
            if found.output is None:
                raise ConfigError(f"convert: {found.output_refusal}, so transfer cannot fold a per-head gain")
        if degree is None:
            refused = [p.temperature_refusal for p in projections if p.temperature_refusal is not None]
            if refused:
                raise ConfigError(
                    f"convert: {get_activation(spec).name} is not homogeneous, so its per-head temperature must fold "
                    f"into the queries, but {refused[0]}; use poly3, relu or poly1, or another model"
                )
        temperatures = self._start_temperatures(samples) if degree is None else None
        gains = self._start_gains(samples, temperatures)
        generator = torch.Generator().manual_seed(options.seed)
        self.edits = Edits()
        self.gains: list[HeadGain] = []
        self.temperatures: list[Factor] = []
        for index, found in enumerate(projections):
            gain = HeadGain(gains[index], degree if found.temperature_refusal is None else None)
            if gain.temperature is not None:  # the gain as |g|^(1/p) on the queries, its sign on the output
                scale_queries(self.edits, found, gain.temperature)
            self.edits.on(found.output).add(found.output, scale=(gain.output, found.head_dim))
            self.gains.append(gain)
            if temperatures is not None:
                self.temperatures.append(Factor(temperatures[index], positive=True))
                scale_queries(self.edits, found, self.temperatures[-1])
            for block in (found.query, found.key):
                delta = _delta(block, options, generator)
                if delta is not None:
                    self.edits.on(block).add(block, delta=delta)
            for block in (found.query_bias, found.key_bias) if options.bias and options.qk != "none" else ():
                if block is not None:
                    self.edits.on(block).add(block, delta=Full(block.rows, like=block.parameter))

    # ---- starting values ----------------------------------------------------------------------

    def _captured(self, samples: Sequence[Batch], reduce) -> list:
        """``reduce(index, inputs, accumulated)`` over what every layer attends in softmax forwards of ``samples``."""
        totals: list = [None] * len(self.layers)

        def add(index: int, inputs: AttentionInputs) -> None:
            totals[index] = reduce(index, inputs, totals[index])

        with quiet(self.model):
            for batch in samples:
                record(self.model, self.layers, batch, capture=add)
        return totals

    def _start_temperatures(self, samples: Sequence[Batch]) -> list[Tensor]:
        grids = self._captured(
            samples, lambda i, inputs, total: temperature_errors(inputs, self.spec) + (0 if total is None else total)
        )
        return [TEMPERATURES[grid.argmin(dim=0)] for grid in grids]

    def _start_gains(self, samples: Sequence[Batch], temperatures: list[Tensor] | None) -> list[Tensor]:
        """Per head, the least-squares gain of ``phi(S) v`` (at the start temperature) onto ``softmax(S) v``."""

        def reduce(index: int, inputs: AttentionInputs, total):
            q = inputs.q.double()
            if temperatures is not None:
                q = q * temperatures[index].to(q)[:, None, None]
            v = inputs.v.double()
            student = attention_map(inputs._replace(q=q), self.spec).double() @ v
            target = attention_map(inputs, "softmax").double() @ v
            sums = torch.stack([(student * target).sum(dim=(0, 2, 3)), (student * student).sum(dim=(0, 2, 3))])
            return sums if total is None else total + sums

        sums = self._captured(samples, reduce)
        return [torch.where(s[1] > 0, s[0] / s[1].clamp_min(1e-300), torch.zeros_like(s[0])) for s in sums]

    # ---- training -----------------------------------------------------------------------------

    def loss(self, batch: Batch, layers: Sequence[int]) -> Tensor:
        """The sum over ``layers`` (indices) of their relative squared errors on ``batch``."""
        self.edits.set_enabled(False)
        try:
            calls = record(self.model, [self.layers[i] for i in layers], batch)
        finally:
            self.edits.set_enabled(True)
        total = 0.0
        for index, layer_calls in zip(layers, calls):
            for call in layer_calls:
                error, norm = squared_errors(
                    layer_output(self.layers[index], call), call.target, token_weights(batch, call.target)
                )
                total = total + error / norm.clamp_min(1e-30)
        return total

    def error(self, layers: Sequence[int], samples: Sequence[Batch]) -> float:
        """The sum over ``layers`` (indices) of their relative errors over all of ``samples``."""
        return sum(layer_errors(self.model, [self.layers[i] for i in layers], samples, self.edits.set_enabled))

    def fit(
        self, train: Sequence[Batch], held_out: Sequence[Batch] = (), progress: Progress | None = None
    ) -> TransferResult:
        """Train on ``train`` until the error on ``held_out`` (none: the training loss) stops falling, or
        ``options.steps``, a chunk of ``layers_per_pass`` layers at a time; each chunk keeps its best weights.
        ``progress``: the conversion's lines (None: this call's own)."""
        options, begin = self.options, time.perf_counter()
        per_pass = options.layers_per_pass or len(self.layers)
        trainable = sum(p.numel() for p in self.edits.parameters() if p.requires_grad)
        progress = progress or Progress(len(self.layers), options)
        steps, capped, kept_steps, curve = 0, False, [], []
        with quiet(self.model, train=self.edits.parameters()):
            for first in range(0, len(self.layers), per_pass):
                chunk = list(range(first, min(first + per_pass, len(self.layers))))
                params = [p for i in chunk for p in self._layer_parameters(i)]
                optimizer = torch.optim.Adam(params, lr=options.lr)
                stop = EarlyStop(params, options)
                if held_out:  # the closed-form start is the first candidate
                    progress.phase(f"{progress.named(chunk)}: the held-out error at the start")
                    stop.update(0, self.error(chunk, held_out))
                    curve.append([first, 0, None, stop.lowest])
                chunk_steps, losses = 0, []
                while chunk_steps < options.steps and not stop.done:
                    for batch in train:
                        loss = self.loss(batch, chunk)
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        optimizer.step()
                        losses.append(float(loss.detach()))
                        chunk_steps += 1
                        if chunk_steps % options.check_every == 0 or chunk_steps == options.steps:
                            progress.step(chunk, chunk_steps, curve, stop)  # a line due goes before the check's pass
                            training, losses = sum(losses) / len(losses), []
                            error = self.error(chunk, held_out) if held_out else None
                            stop.update(chunk_steps, training if error is None else error)
                            curve.append([first, chunk_steps, training, error])
                        progress.step(chunk, chunk_steps, curve, stop)
                        if chunk_steps >= options.steps or stop.done:
                            break
                stop.restore()
                progress.chunk_done(chunk, chunk_steps, stop, bool(held_out))
                capped = capped or not stop.done
                kept_steps.append(stop.best_step)
                steps += chunk_steps
        return TransferResult(
            gains=[g().detach().cpu().tolist() for g in self.gains],
            temperatures=[t().detach().cpu().tolist() for t in self.temperatures] if self.temperatures else None,
            steps=steps,
            stopped="steps" if capped else "held-out" if held_out else "plateau",
            kept_steps=kept_steps,
            curve=curve,
            trainable=trainable,
            seconds=time.perf_counter() - begin,
        )

    def _layer_parameters(self, index: int) -> list[nn.Parameter]:
        """The trainable tensors of layer ``index``: the edits inside its module (or the projection after it)."""
        layer = self.layers[index]
        owners = [layer.module] + ([layer.outer_output] if layer.outer_output is not None else [])
        inside = {id(p) for owner in owners for p in owner.parameters()}
        return [p for p in self.edits.parameters() if id(p) in inside and p.requires_grad]

    def set_enabled(self, enabled: bool) -> None:
        self.edits.set_enabled(enabled)

    def fold(self) -> None:
        """Fold every edit into the weights it edits (exact) and drop the parametrizations."""
        fold(self.edits)


def _delta(block, options: TransferOptions, generator: torch.Generator) -> nn.Module | None:
    """The trainable delta of a query or key block, as ``options.qk`` says (None: ``"none"``)."""
    if options.qk == "lora":
        return LowRank(block.rows, block.inputs, options.rank, generator, block.parameter)
    if options.qk == "full":
        return Full(block.rows, block.inputs, like=block.parameter)
    return None


__all__ = [
    "PROGRESS_SECONDS",
    "QK_MODES",
    "EarlyStop",
    "Progress",
    "Student",
    "TransferOptions",
    "TransferResult",
    "homogeneous_degree",
]
