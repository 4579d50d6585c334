"""The ways a runner computes a bucket, what each layer runs on them, and the timed choice.

"layers": the model's own ``MLP.forward`` (its input normalization, then each ``FusedLinear``); with the
torch backend the same math on tensors bound once.
"fused": ``kernels/triton/fused_mlp.py``, one launch per layer with the input normalization fused into layer
0, its layers' configs tuned together on the whole chain (``tune_chain``) at warm-up.
"vendor": every layer on the vendor's GEMM (``kernels/vendor/cublas.py``), what a user would run instead;
nothing to compile or tune, so a bucket on provisional choices is timed against it and never starts slower.
Each takes the raw float32 input ``[bucket, in]`` and a per-layer ``hook`` (see ``MLP.forward``).
"""

from __future__ import annotations

from functools import partial

import torch

from fusedserve.kernels import choosing
from fusedserve.kernels.activations import split_activation, torch_activation
from fusedserve.kernels.family import config_str
from fusedserve.kernels.rules import m_bucket, problem_of_shape
from fusedserve.kernels.triton import fused_mlp
from fusedserve.kernels.vendor import cublas
from fusedserve.models.mlp import MLP, normalize_rows, reference_layer, run_layers

# Warm-up times each candidate path with this many rounds of back-to-back calls (best round wins).
CHOICE_ROUNDS, CHOICE_CALLS = 3, 10
# Before timing, the fused path is taken for models this narrow at batches this small: on the H200
# it won every bucket up to 512 rows of the 64-256-256-10 digits model, and lost every bucket of the
# 1024- and 4096-wide ones (bench/results/model.jsonl:2).
PROVISIONAL_FUSED_MAX_WIDTH, PROVISIONAL_FUSED_MAX_ROWS = 512, 512


class LayersPath:
    """The model's own forward. Its layers are marked ``static_weight``: a served model's weights
    are loaded, then synchronized in warm-up, and nothing writes them while it runs, so each layer
    may start streaming its weights before the previous layer ends."""

    name = "layers"

    def __init__(self, model: MLP):
        self.model = model
        for layer in model.layers:
            layer.static_weight = True
        # The torch backend's layers with their tensors looked up once: through the modules a digits
        # row takes ~35 us on the 2-core dev box, ~20 of them attribute lookups and module dispatch.
        self._bound = None if model.backend != "torch" else tuple(
            partial(reference_layer, weight=layer.weight, bias=layer.bias, act=torch_activation(layer.activation))
            for layer in model.layers)

    def tune(self, x: torch.Tensor) -> None:
        """Nothing ahead: each layer's first launch at a new bucket tunes its kernel."""

    def forward(self, x: torch.Tensor, hook=None) -> torch.Tensor:
        if self._bound is None:
            return self.model(x, hook)  # [bucket, in] -> [bucket, out]
        model = self.model  # the same math as MLP.forward, hooks included
        return run_layers(normalize_rows(x, model.input_shift, model.input_scale, model.config.torch_dtype),
                          self._bound, hook)

    def tuned(self, bucket: int) -> bool:
        """Whether every layer's choice at ``bucket`` is in the tune cache (nothing to time: True)."""
        model = self.model
        if model.backend == "torch" or model.device.type != "cuda":
            return True
        return all(choosing.cached(problem_of_shape(bucket, layer.out_features, layer.in_features,
                                                    model.config.torch_dtype, model.device),
                                   model.device, static_weight=True) is not None for layer in model.layers)

    def kernel(self, index: int, bucket: int) -> tuple[str, str]:
        """``(kernel, config)`` that layer ``index`` ran at ``bucket``, as its last call there reported
        it ("", "" before it has run there)."""
        layer = self.model.layers[index]
        if self.model.backend == "torch":
            return ("torch.linear" if layer.activation == "none" else f"torch.linear+{layer.activation}", "")
        choice = layer.choices.get(m_bucket(bucket))
        return ("", "") if choice is None else (choice.kernel, choice.describe())


class FusedPath:
    """``fused_mlp`` on the model's weights, packed once into two buffers."""

    name = "fused"

    def __init__(self, model: MLP):
        self.model = model
        layers = model.layers
        self.packed = fused_mlp.pack_mlp([layer.weight.detach() for layer in layers],
                                         [layer.bias.detach() for layer in layers], model.config.activations)

    def tune(self, x: torch.Tensor) -> None:
        """Every layer's config at this bucket, timed in the whole chain (once per bucket and GPU)."""
        fused_mlp.tune_chain(x, self.packed, self.model.input_shift, self.model.input_scale)

    def forward(self, x: torch.Tensor, hook=None) -> torch.Tensor:
        model, h = self.model, x
        for i in range(self.packed.num_layers):  # [bucket, in] -> [bucket, hidden[i]] ... -> [bucket, out]
            if hook is not None:
                hook(i)
            h = fused_mlp.fused_mlp_layer(h, self.packed, i, model.input_shift, model.input_scale)
        if hook is not None:
            hook(self.packed.num_layers)
        return h

    def tuned(self, bucket: int) -> bool:
        """Whether every layer's config at ``bucket`` is chain-tuned (nothing to time: True)."""
        return fused_mlp.chain_tuned(bucket, self.packed, self.model.device)

    def kernel(self, index: int, bucket: int) -> tuple[str, str]:
        """``(kernel, config)`` that layer ``index`` runs at ``bucket``."""
        config = fused_mlp.layer_config(bucket, self.packed, index, self.model.device)
        return fused_mlp.NAME, config_str(config)


def vendor_layer(h: torch.Tensor, layer) -> torch.Tensor:
    """``layer`` on ``h`` through ``kernels/vendor/cublas.py``'s first config, its activation in
    cuBLASLt's epilogue where it has one, a row-wise one after (``split_activation``)."""
    epilogue, after = split_activation(layer.activation)
    out = torch.empty(h.shape[0], layer.out_features, device=h.device, dtype=h.dtype)
    out = cublas.launch(h, layer.weight, layer.bias, epilogue, out, VendorPath.CONFIG)
    return out if after is None else after(out)


class VendorPath:
    """Every layer through ``kernels/vendor/cublas.py`` with its first config (cuBLASLt with the bias
    and the activation in its epilogue where it has one), after the input normalization in torch ops."""

    name = "vendor"
    CONFIG = dict(cublas.CANDIDATES[0])

    def __init__(self, model: MLP):
        self.model = model
        self._bound = tuple(partial(vendor_layer, layer=layer) for layer in model.layers)

    def tune(self, x: torch.Tensor) -> None:
        """Nothing to tune: cuBLAS picks its own algorithm."""

    def forward(self, x: torch.Tensor, hook=None) -> torch.Tensor:
        model = self.model  # [bucket, in] -> [bucket, out], hooks as MLP.forward calls them
        return run_layers(normalize_rows(x, model.input_shift, model.input_scale, model.config.torch_dtype),
                          self._bound, hook)

    def tuned(self, bucket: int) -> bool:
        return True

    def kernel(self, index: int, bucket: int) -> tuple[str, str]:
        return cublas.NAME, cublas.describe(self.CONFIG)


def candidate_paths(model: MLP, fused: bool | None) -> dict:
    """The paths a runner of ``model`` may take, by name, in order of preference on a tie.

    ``fused=None``: with the triton backend on CUDA "fused" (where the chain fits), "layers" and
    "vendor" (timed per bucket at warm-up), "fused" alone under the CPU interpreter; "layers" with
    the torch backend. ``True``/``False`` forces "fused" or "layers".
    """
    dtype, device = model.config.torch_dtype, model.device
    use_fused = fused is not False and (fused or model.backend == "triton")
    if use_fused:
        fits = model.backend == "triton" and fused_mlp.fused_mlp_supported(model.config.widths, dtype, device)
        if fused and not fits:
            raise ValueError(f"fused=True but model {model.name!r} ({dtype}, backend {model.backend}, "
                             f"{device}) cannot run the fused MLP chain: it needs the triton backend")
        use_fused = fits
    automatic = fused is None and device.type == "cuda" and model.backend == "triton"
    paths = {"fused": FusedPath(model)} if use_fused else {}
    if automatic or not use_fused:
        paths["layers"] = LayersPath(model)
    if automatic:
        paths["vendor"] = VendorPath(model)
    return paths


def provisional_path(candidates: tuple[str, ...], model: MLP, bucket: int) -> str:
    """The path a bucket compiles before anything is timed (the runner then times it against
    "vendor" where that is a candidate): "fused" for narrow models at small batches
    (``PROVISIONAL_FUSED_MAX_*``), else "layers", else what is left."""
    narrow = max(model.config.widths) <= PROVISIONAL_FUSED_MAX_WIDTH and bucket <= PROVISIONAL_FUSED_MAX_ROWS
    for path in ("fused", "layers") if narrow else ("layers", "fused"):
        if path in candidates:
            return path
    return candidates[0]


def seconds_per_call(step) -> float:
    """Seconds per call of ``step`` on CUDA (events around back-to-back calls), best of a few rounds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    with torch.no_grad():
        step()
        for _ in range(CHOICE_ROUNDS):
            start.record()
            for _ in range(CHOICE_CALLS):
                step()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / CHOICE_CALLS)  # elapsed_time is in ms
    return best


def choose(steps: dict) -> tuple[str, dict[str, float]]:
    """The fastest of ``steps`` (path name -> one call of it, as the runner would make it) and
    every path's seconds per call; the first named wins a tie."""
    seconds = {name: seconds_per_call(step) for name, step in steps.items()}
    return min(seconds, key=seconds.get), seconds


def current_is_faster(current, tuned) -> bool:
    """Whether ``current`` (a bucket's graph replay on provisional choices) beats ``tuned`` (the
    graph tuning just built), timed back to back: tuning times each kernel alone, and a chain of
    kernels alone-fastest can be slower together, so a swap must not make a bucket slower."""
    _, seconds = choose({"tuned": tuned, "current": current})
    return seconds["current"] < seconds["tuned"]

