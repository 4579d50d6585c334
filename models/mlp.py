"""The MLP served by fusedserve: a config, a fused linear layer and the model built from them.

Definition only: loading lives in ``models.loading`` and running (buckets, CUDA graphs, timing)
in ``models.runner``, which times each layer through ``MLP.forward``'s ``hook``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from fusedserve.kernels.activations import ACTIVATIONS, OUTPUT_ACTIVATIONS, split_activation, torch_activation
from fusedserve.kernels.rules import m_bucket

BACKENDS = ("triton", "torch")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def normalize_rows(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(x - shift) * scale`` in float32, in ``dtype``: x [M, in] raw values of any float dtype."""
    x = x if x.dtype == torch.float32 else x.float()
    y = (x - shift) * scale
    return y if y.dtype == dtype else y.to(dtype)


def reference_layer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, act) -> torch.Tensor:
    """The torch backend's layer, ``act(x @ weight^T + bias)`` (``act``: ``torch_activation`` of a name)."""
    return act(F.linear(x, weight, bias))


def run_layers(x: torch.Tensor, layers, hook=None) -> torch.Tensor:
    """``x`` through each of ``layers`` (callables) in turn; ``hook(i)``, when given, is called before
    layer i and ``hook(len(layers))`` after the last (the runner times layers through it)."""
    for i, layer in enumerate(layers):
        if hook is not None:
            hook(i)
        x = layer(x)  # [M, hidden[i]] ... then [M, out]
    if hook is not None:
        hook(len(layers))
    return x


@dataclass(frozen=True)
class MLPConfig:
    """Shape of an MLP: ``in -> hidden[0] -> ... -> hidden[-1] -> out``.

    ``activation``: what every hidden layer applies (one name), or one name per hidden layer (a
    list). The last layer applies ``output_activation``: "none" (logits, regression), another
    ``ACTIVATIONS`` name (a sigmoid head) or an ``OUTPUT_ACTIVATIONS`` one ("softmax").
    ``dtype`` names the dtype of weights and activations ("float32", "float16", "bfloat16").
    Inputs are normalized inside the model (``(x - input_shift) * input_scale``, per feature),
    so clients send raw feature values.
    """

    in_features: int
    hidden_features: tuple[int, ...]
    out_features: int
    activation: str | tuple[str, ...] = "relu"
    dtype: str = "float32"
    output_activation: str = "none"
    _keys = ("in_features", "hidden_features", "out_features", "activation", "dtype", "output_activation")

    def __post_init__(self):
        for name in ("in_features", "out_features"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        hidden = self.hidden_features
        if isinstance(hidden, (str, bytes)) or not isinstance(hidden, (list, tuple)):
            raise TypeError(f"hidden_features must be a list of positive integers, got {hidden!r}")
        for width in hidden:
            if isinstance(width, bool) or not isinstance(width, int) or width < 1:
                raise ValueError(f"hidden_features must hold positive integers, got {width!r}")
        object.__setattr__(self, "hidden_features", tuple(hidden))
        self._check_activations()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    def _check_activations(self) -> None:
        names = self.activation
        if isinstance(names, (list, tuple)):
            if len(names) != len(self.hidden_features):
                raise ValueError(f"activation must name one activation per hidden layer "
                                 f"({len(self.hidden_features)}), got {len(names)}: {list(names)}")
            object.__setattr__(self, "activation", tuple(names))
        for name in (names,) if isinstance(names, str) else names:
            if not isinstance(name, str) or name not in ACTIVATIONS:
                row_wise = isinstance(name, str) and name in OUTPUT_ACTIVATIONS
                raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}"
                                 + (" (row-wise: only output_activation may be it)" if row_wise else ""))
        output = self.output_activation
        if not isinstance(output, str) or (output not in ACTIVATIONS and output not in OUTPUT_ACTIVATIONS):
            raise ValueError(f"output_activation must be one of {sorted(ACTIVATIONS | OUTPUT_ACTIVATIONS)}, "
                             f"got {output!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def widths(self) -> tuple[int, ...]:
        """Feature widths from input to output: ``(in, *hidden, out)``."""
        return (self.in_features, *self.hidden_features, self.out_features)

    @property
    def activations(self) -> tuple[str, ...]:
        """Each layer's activation, first layer first; the last is ``output_activation``."""
        hidden = self.activation
        if isinstance(hidden, str):
            hidden = (hidden,) * len(self.hidden_features)
        return (*hidden, self.output_activation)

    def to_dict(self) -> dict:
        """The config as written to ``config.json``; ``output_activation`` only when it is not
        "none", so a model without one keeps the file it always had."""
        data = asdict(self)
        data["hidden_features"] = list(self.hidden_features)
        if not isinstance(self.activation, str):
            data["activation"] = list(self.activation)
        if self.output_activation == "none":
            del data["output_activation"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> MLPConfig:
        if not isinstance(data, dict):
            raise TypeError(f"a model config must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(cls._keys))
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; allowed keys are {list(cls._keys)}")
        missing = [k for k in ("in_features", "hidden_features", "out_features") if k not in data]
        if missing:
            raise ValueError(f"missing config keys {missing}")
        return cls(**data)


class FusedLinear(nn.Module):
    """``nn.Linear`` with the activation fused: ``y = act(x @ weight^T + bias)``.

    Same parameters as ``nn.Linear`` (weight ``[out, in]``, bias ``[out]``). Backend "triton" runs
    ``kernels.fused_linear`` (bias and activation in the GEMM epilogue); "torch" is the plain
    reference ``act(F.linear(x, weight, bias))``. ``static_weight``: passed to ``fused_linear``; a
    runner sets it on the layers it serves, whose weights nothing writes while they run.
    """

    static_weight = False

    def __init__(self, in_features: int, out_features: int, activation: str = "relu",
                 backend: str = "torch", device=None, dtype=None):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        # The kernel's epilogue computes the elementwise part; a row-wise one (softmax) runs after it.
        self._epilogue, self._after = split_activation(activation)
        if backend == "triton":
            # Imported here so the torch backend never needs Triton (nor its interpreter set-up).
            from fusedserve.kernels import fused_linear_with_choice

            self._fused_linear = fused_linear_with_choice
        # What the triton backend ran, per tuning bucket of M (kernels.rules.m_bucket): the runner's
        # timing records name it.
        self.choices: dict[int, object] = {}
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Linear's initialization
        bound = in_features**-0.5
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, in_features] -> [M, out_features]
        if self.backend == "triton":
            y, choice = self._fused_linear(x, self.weight, self.bias, self._epilogue, static_weight=self.static_weight)
            if choice is not None:  # (None: no kernel ran, M, N or K is 0)
                self.choices[m_bucket(math.prod(x.shape[:-1]))] = choice
            return y if self._after is None else self._after(y)
        return reference_layer(x, self.weight, self.bias, torch_activation(self.activation))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"activation={self.activation}, backend={self.backend}")


class MLP(nn.Module):
    """Input normalization followed by fused linear layers, each with its activation of
    ``config.activations``."""

    def __init__(self, config: MLPConfig, backend: str = "torch", device=None, name: str = "mlp"):
        super().__init__()
        self.config = config
        self.backend = backend
        self.name = name
        self.labels: tuple[str, ...] = ()  # a classifier's class labels, one per output (models.loading)
        self.layers = nn.ModuleList(
            FusedLinear(k, n, activation, backend, device=device, dtype=config.torch_dtype)
            for (k, n), activation in zip(pairwise(config.widths), config.activations, strict=True)
        )
        # float32 whatever the model dtype: raw inputs may be large before normalization.
        self.register_buffer("input_shift", torch.zeros(config.in_features, device=device))
        self.register_buffer("input_scale", torch.ones(config.in_features, device=device))
        self._normalize_kernel = None
        if backend == "triton":
            from fusedserve.kernels.triton.normalize import normalize

            # One launch instead of torch's two or three elementwise ones, and the same bits.
            self._normalize_kernel = normalize

    @property
    def device(self) -> torch.device:
        return self.input_shift.device

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, in] raw values, any float dtype -> [M, in] normalized, in the model dtype
        if self._normalize_kernel is not None and x.dtype == torch.float32 and x.dim() == 2:
            return self._normalize_kernel(x, self.input_shift, self.input_scale, self.config.torch_dtype)
        return normalize_rows(x, self.input_shift, self.input_scale, self.config.torch_dtype)

    def forward(self, x: torch.Tensor, hook=None) -> torch.Tensor:
        # x: [M, in] -> [M, out]; hook: see run_layers.
        return run_layers(self.normalize(x), self.layers, hook)
