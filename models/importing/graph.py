"""The one shape every importer reduces a model to, checked and folded here into an MLP.

A frontend (ONNX, torch, scikit-learn) turns its model into ``Op``s: linear layers (a weight and a
bias) and the small functions between them (a node, a module, a scaler), each a function of the
tensors it reads. ``chain`` checks that they form a chain, input -> [scale and shift] -> linear ->
[activation] -> linear -> ... -> [output activation], and ``fold`` names each gap's function:

- before the first layer, a per-feature ``x * a + c`` becomes the input normalization;
- between layers and after the last, the function must equal an entry of the activation table (or,
  after the last layer, softmax), found by evaluating it in float64 on probe values; a 1-wide layer
  answered as ``[1 - sigmoid, sigmoid]`` (a binary classifier's two probabilities) becomes a 2-wide
  layer with softmax, the same numbers.

Anything else is refused naming the node or layer, never approximated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fusedserve.kernels.activations import ACTIVATIONS, OUTPUT_ACTIVATIONS
from fusedserve.models.mlp import DTYPES, MLP, MLPConfig

# A gap's function matches an activation when it is within this of it (scaled by max(1, |y|))
# everywhere on the probes: float32 constants of a decomposed GELU are within 1e-7 of the real ones,
# and the tanh and the erf forms differ by up to 4.7e-4. 16-bit constants are off by up to 1e-3.
MATCH_TOLERANCE = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 4e-3}
# Probe values per feature, and at most this many probe elements in all (a 4096-wide layer gets 512 rows).
PROBE_RANGE, PROBE_ROWS, PROBE_ELEMENTS = 8.0, 2001, 1 << 21
BINARY = "binary"  # a 1-wide layer whose answer is [1 - sigmoid(z), sigmoid(z)]


class UnsupportedModel(ValueError):
    """The model is not a chain of linear layers and supported activations; the message says where."""


@dataclass
class Op:
    """One step of a source model. ``inputs``: the names of the computed tensors it reads (constants
    are bound into ``fn``). A linear layer has ``weight`` [N, K] and ``bias`` [N] (float64); any
    other op computes ``fn(*inputs)`` on float64 tensors."""

    where: str  # for messages: "node 'fc1' (Gemm)", "layer '2' (Linear)"
    inputs: tuple[str, ...]
    output: str
    fn: Callable | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None


@dataclass
class Gap:
    """The ops between two linear layers (or before the first, or after the last)."""

    entry: str
    ops: list[Op] = field(default_factory=list)
    exit: str | None = None

    @property
    def where(self) -> str:
        return ", ".join(op.where for op in self.ops)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        values = {self.entry: z}
        for op in self.ops:
            values[op.output] = op.fn(*(values[name] for name in op.inputs))
        return values[self.exit]


@dataclass
class Imported:
    """An MLP read from a source model, in float64, before it takes a dtype."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor]
    activations: list[str]  # per layer, the last one's included
    shift: torch.Tensor  # [in_features]: the model computes (x - shift) * scale first
    scale: torch.Tensor
    labels: tuple[str, ...] = ()

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.weights[0].shape[1], *(w.shape[0] for w in self.weights))

    def to_mlp(self, dtype: str, name: str = "imported") -> MLP:
        """The ``MLP`` (torch backend, CPU) of these weights in ``dtype``."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        widths = self.widths
        config = MLPConfig(in_features=widths[0], hidden_features=widths[1:-1], out_features=widths[-1],
                           activation=list(self.activations[:-1]), dtype=dtype,
                           output_activation=self.activations[-1])
        model = MLP(config, name=name)
        with torch.no_grad():
            for layer, weight, bias in zip(model.layers, self.weights, self.biases, strict=True):
                layer.weight.copy_(weight)
                layer.bias.copy_(bias)
            model.input_shift.copy_(self.shift)
            model.input_scale.copy_(self.scale)
        model.labels = tuple(self.labels)
        return model.eval().requires_grad_(False)


def chain(ops: list[Op], source: str, output: str) -> tuple[list[Op], list[Gap]]:
    """The linear layers of ``ops`` (in order: each reads what the previous computed) and the gaps
    around them, ``len(layers) + 1``; UnsupportedModel where the ops branch, skip or lead nowhere."""
    gaps, layers, gap_of = [Gap(source)], [], {source: 0}
    for op in ops:
        if not op.inputs:
            raise UnsupportedModel(f"{op.where} reads no computed tensor")
        tags = {gap_of.get(name, -1) for name in op.inputs}
        if -1 in tags:
            unknown = [name for name in op.inputs if name not in gap_of]
            raise UnsupportedModel(f"{op.where} reads {unknown}, which the model input does not lead to")
        if len(tags) > 1 or tags.pop() != len(gaps) - 1:
            raise UnsupportedModel(f"{op.where} reads a tensor computed before the last linear layer: "
                                   "the model is not a chain of layers (a skip connection or a branch?)")
        if op.weight is not None:
            gaps[-1].exit = op.inputs[0]
            layers.append(op)
            gaps.append(Gap(op.output))
        else:
            gaps[-1].ops.append(op)
        gap_of[op.output] = len(gaps) - 1
    if not layers:
        raise UnsupportedModel("the model has no linear layer (Gemm, MatMul, nn.Linear)")
    if gap_of.get(output) != len(gaps) - 1:
        raise UnsupportedModel(f"the model's output {output!r} is not computed from its last linear layer")
    gaps[-1].exit = output
    for gap in gaps:
        _check_used(gap)
    return layers, gaps


def _check_used(gap: Gap) -> None:
    """UnsupportedModel naming an op of ``gap`` whose result never reaches the gap's exit."""
    needed = {gap.exit}
    for op in reversed(gap.ops):
        if op.output in needed:
            needed.update(op.inputs)
        else:
            raise UnsupportedModel(f"{op.where} computes a tensor the model's chain never uses")


def probes(width: int) -> torch.Tensor:
    """float64 [rows, width]: every column runs over the probe range, each from another start, so a
    row holds different values (softmax over a row is not softmax over a column)."""
    rows = max(8, min(PROBE_ROWS, PROBE_ELEMENTS // width))
    grid = torch.linspace(-PROBE_RANGE, PROBE_RANGE, PROBE_ROWS, dtype=torch.float64)
    starts = torch.arange(width) * 37 % PROBE_ROWS
    index = (torch.arange(rows)[:, None] * (PROBE_ROWS // rows) + starts[None, :]) % PROBE_ROWS
    return grid[index]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return ((got - want).abs() / want.abs().clamp(min=1.0)).max().item()


def identify(gap: Gap, width: int, last: bool, tolerance: float) -> str:
    """The activation ``gap`` computes on a ``width``-wide layer's output: the closest of the table
    (and softmax or ``BINARY`` after the last layer) within ``tolerance``, else UnsupportedModel."""
    if not gap.ops:
        return "none"
    z = probes(width)
    try:
        y = gap(z).to(torch.float64)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise UnsupportedModel(f"{gap.where} cannot run on one {width}-wide row per example: {exc}") from None
    if y.dim() != 2 or y.shape[0] != z.shape[0]:
        raise UnsupportedModel(f"{gap.where} turns {z.shape[0]} rows of {width} values into shape {list(y.shape)}: "
                               "import serves one output row per input row")
    candidates = dict(ACTIVATIONS)
    if last:
        candidates.update(OUTPUT_ACTIVATIONS)
        if width == 1:
            candidates[BINARY] = lambda v: torch.cat([1 - torch.sigmoid(v), torch.sigmoid(v)], dim=-1)
    errors = {name: _error(y, act(z)) for name, act in candidates.items()}
    best = min(errors, key=errors.get)
    if errors[best] <= tolerance:
        return best
    allowed = sorted(candidates)
    place = "after the last linear layer" if last else "between two linear layers"
    raise UnsupportedModel(f"{gap.where} {place} computes none of the supported activations {allowed} "
                           f"(closest: {best}, off by {errors[best]:.3g})")


def input_affine(gap: Gap, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(shift, scale)`` with ``gap(x) == (x - shift) * scale`` per feature: what the ops before
    the first layer compute, as the model's input normalization; else UnsupportedModel."""
    ones = torch.ones(1, width, dtype=torch.float64)
    if not gap.ops:
        return torch.zeros(width, dtype=torch.float64), ones[0]
    try:
        c = gap(0 * ones).to(torch.float64)
        a = gap(ones).to(torch.float64) - c
        z = probes(width) * 100  # raw features may be large
        y = gap(z).to(torch.float64)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise UnsupportedModel(f"{gap.where} before the first linear layer cannot run on rows of {width} "
                               f"features: {exc}") from None
    if c.shape != (1, width) or _error(y, z * a + c) > 1e-9:
        raise UnsupportedModel(f"{gap.where} before the first linear layer is not a per-feature scale and "
                               "shift, the only thing allowed there (it becomes the input normalization)")
    zero = (a[0] == 0).nonzero()
    if zero.numel():
        raise UnsupportedModel(f"{gap.where} multiplies input feature {int(zero[0])} by 0")
    return -c[0] / a[0], a[0]


def fold(layers: list[Op], gaps: list[Gap], tolerance: float, labels=()) -> Imported:
    """The ``Imported`` MLP of a chain: normalization, layers and each gap's activation."""
    widths = [layers[0].weight.shape[1]]
    for layer in layers:
        if layer.weight.dim() != 2 or layer.weight.shape[1] != widths[-1] or layer.bias.shape != layer.weight.shape[:1]:
            raise UnsupportedModel(f"{layer.where} takes {list(layer.weight.shape)} weights and a "
                                   f"{list(layer.bias.shape)} bias after a {widths[-1]}-wide input")
        widths.append(layer.weight.shape[0])
    shift, scale = input_affine(gaps[0], widths[0])
    weights = [layer.weight.to(torch.float64) for layer in layers]
    biases = [layer.bias.to(torch.float64) for layer in layers]
    activations = [identify(gap, width, i == len(layers) - 1, tolerance)
                   for i, (gap, width) in enumerate(zip(gaps[1:], widths[1:], strict=True))]
    if activations[-1] == BINARY:  # softmax([0, z]) == [1 - sigmoid(z), sigmoid(z)]
        weights[-1] = torch.cat([torch.zeros_like(weights[-1]), weights[-1]])
        biases[-1] = torch.cat([torch.zeros_like(biases[-1]), biases[-1]])
        activations[-1] = "softmax"
    for weight, layer in zip(weights, layers, strict=True):
        if not torch.isfinite(weight).all():
            raise UnsupportedModel(f"{layer.where} has NaN or infinite weights")
    if labels and len(labels) != weights[-1].shape[0]:
        raise UnsupportedModel(f"the model has {len(labels)} class labels for {weights[-1].shape[0]} outputs")
    return Imported(weights, biases, activations, shift, scale, tuple(str(label) for label in labels))
