"""PyTorch models to ``graph.Op``s: an ``nn.Sequential`` of ``nn.Linear`` and activation modules, any
module whose ``torch.export`` graph is such a chain, a ``torch.export``-ed program, or a ``state_dict``
of linear layers with the activations named. Files are read with ``weights_only`` unless the user
allows a pickle (which can run any code when loaded)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from fusedserve.kernels.activations import torch_activation
from fusedserve.models.importing.graph import Op, UnsupportedModel

SOURCE = "input"
ACTIVATION_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Softmax)
NO_OP_MODULES = (nn.Identity, nn.Dropout, nn.Flatten)
# torch.export's ops (by packet) a chain may hold between its linear layers; the ones computing
# the layers are ``_LINEAR``'s.
ELEMENTWISE_OPS = {"relu", "gelu", "silu", "sigmoid", "tanh", "softmax", "_softmax", "add", "sub", "rsub", "mul",
                   "div", "neg", "exp", "erf", "pow", "reciprocal", "sqrt", "clone", "alias", "detach", "dropout",
                   "view", "reshape", "flatten", "_to_copy", "to", "contiguous", "clamp_min", "maximum"}
PICKLE_HINT = ("pass allow_pickle=True (the CLI's --allow-pickle) only if you trust the file: a pickle can run any "
               "code when loaded")


def _float64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64) if t.is_floating_point() else t.detach().cpu()


def _linear_op(where: str, source: str, output: str, weight, bias) -> Op:
    weight = _float64(weight)
    bias = torch.zeros(weight.shape[0], dtype=torch.float64) if bias is None else _float64(bias).reshape(-1)
    return Op(where, (source,), output, weight=weight, bias=bias)


def _flat(module: nn.Sequential, prefix: str = ""):
    for name, child in module.named_children():
        if isinstance(child, nn.Sequential):
            yield from _flat(child, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", child


def sequential_ops(module: nn.Sequential) -> tuple[list[Op], str]:
    """The ops of an ``nn.Sequential`` and the name of its output."""
    ops, previous = [], SOURCE
    for name, layer in _flat(module):
        where = f"layer {name!r} ({type(layer).__name__})"
        if isinstance(layer, nn.Linear):
            ops.append(_linear_op(where, previous, name, layer.weight, layer.bias))
        elif isinstance(layer, ACTIVATION_MODULES):
            ops.append(Op(where, (previous,), name, fn=layer))
        elif isinstance(layer, nn.Flatten):
            ops.append(Op(where, (previous,), name, fn=lambda z, f=layer: z.flatten(f.start_dim, f.end_dim)))
        elif isinstance(layer, NO_OP_MODULES):  # (dropout does nothing when serving)
            ops.append(Op(where, (previous,), name, fn=lambda z: z))
        else:
            raise UnsupportedModel(f"{where} is not a linear layer or a supported activation")
        previous = name
    return ops, previous


def _packet(node) -> str:
    """``relu`` for ``aten.relu.default``."""
    return str(node.target).split(".")[1] if str(node.target).startswith("aten.") else str(node.target)


def _program_constants(program) -> dict:
    signature, state = program.graph_signature, program.state_dict
    consts = {}
    for placeholder, fqn in {**signature.inputs_to_parameters, **signature.inputs_to_buffers}.items():
        consts[placeholder] = state[fqn] if fqn in state else program.constants[fqn]
    for placeholder, fqn in signature.inputs_to_lifted_tensor_constants.items():
        consts[placeholder] = program.constants[fqn]
    return {name: _float64(t) if isinstance(t, torch.Tensor) else t for name, t in consts.items()}


def program_ops(program) -> tuple[list[Op], str, str]:
    """The ops of a ``torch.export`` program, its input's name and its output's."""
    user_inputs = program.graph_signature.user_inputs
    if len(user_inputs) != 1:
        raise UnsupportedModel(f"the program takes {len(user_inputs)} inputs; import takes one of rows "
                               "[batch, features]")
    consts, variables, ops, output = _program_constants(program), {user_inputs[0]}, [], None
    for node in program.graph.nodes:
        if node.op == "output":
            outputs = node.args[0]
            if len(outputs) != 1:
                raise UnsupportedModel(f"the program has {len(outputs)} outputs; import serves one")
            output = outputs[0].name
        elif node.op == "call_function":
            _add_node(node, consts, variables, ops)
    return ops, user_inputs[0], output


def _add_node(node, consts: dict, variables: set, ops: list) -> None:
    where, packet = f"node {node.name!r} ({node.target})", _packet(node)
    names = []

    def value(arg, given=None):
        if isinstance(arg, (list, tuple)):
            return type(arg)(value(a, given) for a in arg)
        if not isinstance(arg, torch.fx.Node):
            return arg
        if arg.name in variables:
            if given is None:
                names.append(arg.name)
                return None
            return next(given)
        return consts[arg.name]

    args, kwargs = value(node.args), {k: value(v) for k, v in node.kwargs.items()}
    if not names:  # a constant: computed now (a transposed weight, a scale)
        consts[node.name] = node.target(*args, **kwargs)
        return
    if packet in ("linear", "addmm", "mm", "matmul"):
        ops.append(_program_linear(where, packet, node, args, names))
    elif packet in ELEMENTWISE_OPS:
        def fn(*values, args=node.args, kwargs=node.kwargs):
            given = iter(values)
            return node.target(*value(args, given), **{k: value(v, given) for k, v in kwargs.items()})

        ops.append(Op(where, tuple(names), node.name, fn=fn))
    else:
        raise UnsupportedModel(f"{where} is not a linear layer or a supported activation")
    variables.add(node.name)


def _program_linear(where: str, packet: str, node, args, names) -> Op:
    """``aten.linear(x, W, b)``, ``addmm(b, x, W^T)``, ``mm``/``matmul(x, W^T)`` as a linear op."""
    x_at = 1 if packet == "addmm" else 0
    matrices = [a for i, a in enumerate(args) if i != x_at and isinstance(a, torch.Tensor) and a.dim() == 2]
    if len(names) != 1 or args[x_at] is not None or not matrices:
        raise UnsupportedModel(f"{where} is not a linear layer: it must multiply the rows by constant weights")
    if packet == "linear":
        return _linear_op(where, names[0], node.name, args[1], args[2] if len(args) > 2 else None)
    weight = matrices[-1].T
    bias = None
    if packet == "addmm":
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        bias = beta * torch.broadcast_to(args[0], (1, weight.shape[0]))[0]
        weight = alpha * weight
    return _linear_op(where, names[0], node.name, weight, bias)


def fixed_batch(program) -> int | None:
    """The batch size a program was exported for when it takes no other, else None."""
    node = next(n for n in program.graph.nodes if n.name == program.graph_signature.user_inputs[0])
    rows = node.meta["val"].shape[0] if "val" in node.meta else None
    return rows if isinstance(rows, int) else None


def module_dtype(module) -> str:
    """The dtype name of a module's (or program's) first floating parameter; float32 by default."""
    tensors = module.state_dict().values()
    dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
    return {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "float32")


@contextmanager
def serving(module: nn.Module):
    """``module`` in eval mode, as served (dropout does nothing), and back in its own mode after; an
    exported program's module has no modes."""
    if isinstance(module, torch.fx.GraphModule) or not module.training:
        yield module
        return
    module.eval()
    try:
        yield module
    finally:
        module.train()


def export(module: nn.Module):
    """``torch.export`` of ``module`` on two rows as wide as its first ``nn.Linear``'s input."""
    first = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise UnsupportedModel(f"{type(module).__name__} has no nn.Linear layer")
    dtype = first.weight.dtype
    example = torch.randn(2, first.in_features, dtype=dtype, device=first.weight.device)
    try:
        with serving(module):
            return torch.export.export(module, (example,), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    except Exception as exc:  # export's errors are many types; each means "not one graph on rows"
        raise UnsupportedModel(f"torch.export could not trace {type(module).__name__} on rows of "
                               f"{first.in_features} features: {type(exc).__name__}: {str(exc)[:300]}") from None


def state_dict_ops(state: Mapping, activations, output_activation: str) -> tuple[list[Op], str]:
    """The ops of a ``state_dict`` of linear layers (``<layer>.weight`` [N, K], ``<layer>.bias`` [N]
    in layer order) with ``activations`` named: one per hidden layer, or one for all of them."""
    layers: dict[str, dict] = {}
    for key, tensor in state.items():
        layer, _, kind = key.rpartition(".")
        if kind not in ("weight", "bias") or not isinstance(tensor, torch.Tensor):
            raise UnsupportedModel(f"tensor {key!r} is not a linear layer's weight or bias")
        layers.setdefault(layer, {})[kind] = tensor
    if activations is None:
        raise UnsupportedModel("a state_dict does not say which activations its layers apply: name them "
                               "(activations=['relu', ...], the CLI's --activation relu,...)")
    hidden = len(layers) - 1
    names = [activations] * hidden if isinstance(activations, str) else list(activations)
    if len(names) != hidden:
        raise UnsupportedModel(f"the state_dict has {hidden} hidden layers but {len(names)} activations were named")
    ops, previous = [], SOURCE
    for i, (layer, tensors) in enumerate(layers.items()):
        weight = tensors.get("weight")
        if weight is None or weight.dim() != 2:
            raise UnsupportedModel(f"layer {layer!r} of the state_dict has no 2-dimensional weight")
        ops.append(_linear_op(f"layer {layer!r}", previous, layer, weight, tensors.get("bias")))
        name = names[i] if i < hidden else output_activation
        try:
            act = torch_activation(name)
        except ValueError as exc:
            raise UnsupportedModel(f"activation of layer {layer!r}: {exc}") from None
        ops.append(Op(f"activation {name!r} of layer {layer!r}", (layer,), f"{layer}:{name}", fn=act))
        previous = f"{layer}:{name}"
    return ops, previous


def load_file(path: Path, allow_pickle: bool):
    """A ``.pt2`` program, or what ``torch.load`` reads (a state_dict; a module only if allowed)."""
    if not path.is_file():
        raise FileNotFoundError(f"PyTorch file not found: {path}")
    if path.suffix == ".pt2":
        return torch.export.load(str(path))
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError and friends: the file holds more than tensors
        if not allow_pickle:
            raise UnsupportedModel(f"{path} holds pickled Python objects, not only tensors ({type(exc).__name__}); "
                                   f"{PICKLE_HINT}, or save model.state_dict() or a torch.export program (.pt2)"
                                   ) from None
    return torch.load(path, map_location="cpu", weights_only=False)
