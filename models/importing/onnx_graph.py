"""ONNX files to ``graph.Op``s: ``Gemm`` or ``MatMul`` (+ ``Add``) layers, elementwise nodes between them,
``Scaler`` and arithmetic by constants at the input, a classifier's label branch (``ArgMax`` +
``ArrayFeatureExtractor``, or ``ZipMap``) turned into class labels. Files of ``torch.onnx.export``
(either exporter) and ``skl2onnx`` read as they come. Needs the ``onnx`` extra.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fusedserve.models.importing.graph import MATCH_TOLERANCE, Op, UnsupportedModel

OPSETS = range(11, 24)  # the default domain's opset versions read: 11 to 23
ML_DOMAIN = "ai.onnx.ml"
LABEL_OPS = {"ArgMax", "ArrayFeatureExtractor", "ZipMap"}
DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 11: "float32"}  # TensorProto float types -> ours


def _same(x, *unused):
    return x


_PLAIN = {"Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Erf": torch.erf, "Exp": torch.exp,
          "Neg": torch.neg, "Reciprocal": torch.reciprocal, "Sqrt": torch.sqrt, "Add": torch.add, "Sub": torch.sub,
          "Mul": torch.mul, "Div": torch.div, "Pow": torch.pow, "Identity": _same, "Dropout": _same}


def _reshape(x, shape):
    shape = [x.shape[i] if int(d) == 0 else int(d) for i, d in enumerate(shape.tolist())]
    return x.reshape(shape)


def _function(node, attrs: dict, opset: int):
    """What ``node`` computes, on float64 tensors and its constants in input order; None if it is
    not one of the nodes a chain may hold."""
    op = node.op_type
    if node.domain == ML_DOMAIN and op == "Scaler":
        offset = torch.tensor(attrs.get("offset", [0.0]), dtype=torch.float64)
        scale = torch.tensor(attrs.get("scale", [1.0]), dtype=torch.float64)
        return lambda x: (x - offset) * scale
    if node.domain not in ("", "ai.onnx"):
        return None
    if op in _PLAIN:
        return _PLAIN[op]
    if op == "Gelu":
        return lambda x: F.gelu(x, approximate=attrs.get("approximate", b"none").decode())
    if op == "Cast":
        return _same if attrs.get("to") in DTYPES else None
    if op == "Softmax":
        return lambda x: torch.softmax(x, dim=attrs.get("axis", -1 if opset >= 13 else 1))
    if op == "Concat":
        return lambda *xs: torch.cat(xs, dim=attrs["axis"])
    if op == "Reshape":
        return _reshape
    if op == "Flatten":
        return lambda x: x.reshape(int(np.prod(x.shape[:attrs.get("axis", 1)])), -1)
    if op == "Transpose":
        return lambda x: x.permute(*attrs["perm"]) if "perm" in attrs else x.T
    return None


def _tensor(proto) -> torch.Tensor | np.ndarray:
    """An ONNX tensor as torch (floats as float64, integers as int64), or numpy for strings."""
    from onnx import numpy_helper

    array = numpy_helper.to_array(proto)
    if array.dtype.kind in "OSU":
        return array
    if array.dtype.kind in "fV":  # (bfloat16 comes as a numpy void type)
        return torch.from_numpy(array.astype(np.float64))
    return torch.from_numpy(array.astype(np.int64))


def _where(node) -> str:
    return f"node {node.name or node.output[0]!r} ({node.op_type})"


@dataclass
class Reading:
    """What an ONNX file holds, as ops, with the names the self-check runs it by."""

    ops: list[Op]
    source: str  # the graph input
    output: str  # the served tensor: the probabilities of a classifier, else the one output
    labels: tuple[str, ...]
    dtype: str  # of its weights
    opset: int

    @property
    def tolerance(self) -> float:
        return MATCH_TOLERANCE[self.dtype]


def load(source):
    """An ``onnx.ModelProto`` from a path or one, with a clear error for a file that is not ONNX."""
    import onnx

    if isinstance(source, onnx.ModelProto):
        return source
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"ONNX file not found: {path}")
    try:
        return onnx.load(str(path))
    except Exception as exc:  # onnx raises DecodeError and friends: all mean "not an ONNX model"
        raise UnsupportedModel(f"{path} is not a readable ONNX model: {exc}") from None


def _opset(model) -> int:
    versions = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    opset = versions.get("ai.onnx", 0)
    if opset not in OPSETS:
        raise UnsupportedModel(f"the model uses ONNX opset {opset}; import reads opsets "
                               f"{OPSETS.start} to {OPSETS.stop - 1} (convert it with onnx.version_converter)")
    return opset


def _label_branch(graph, consts: dict) -> tuple[set[int], dict, tuple[str, ...]]:
    """The nodes (indices) of a classifier's label branch, the alias of a ZipMap's output (its
    input, the probabilities) and the class labels the branch picks from."""
    from onnx import helper

    branch, aliases, labels, derived = set(), {}, (), set()
    for i, node in enumerate(graph.node):
        if node.op_type == "ZipMap":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            found = attrs.get("classlabels_strings") or attrs.get("classlabels_int64s") or []
            labels = tuple(x.decode() if isinstance(x, bytes) else str(x) for x in found)
            aliases[node.output[0]] = node.input[0]
            branch.add(i)
        elif node.op_type == "ArgMax" or any(name in derived for name in node.input):
            branch.add(i)
            derived.update(node.output)
            if node.op_type == "ArrayFeatureExtractor" and node.input[0] in consts:
                classes = consts[node.input[0]]
                classes = classes.tolist() if isinstance(classes, (np.ndarray, torch.Tensor)) else classes
                labels = tuple(x.decode() if isinstance(x, bytes) else str(x) for x in classes)
    return branch, aliases, labels




def _source(graph, consts: dict) -> str:
    inputs = [i for i in graph.input if i.name not in consts]
    if len(inputs) != 1:
        raise UnsupportedModel(f"the model takes {len(inputs)} inputs ({[i.name for i in inputs]}); import "
                               "takes models with one input of rows [batch, features]")
    tensor = inputs[0].type.tensor_type
    if tensor.elem_type not in DTYPES:
        raise UnsupportedModel(f"input {inputs[0].name!r} holds ONNX type {tensor.elem_type}, not floats")
    if tensor.HasField("shape") and len(tensor.shape.dim) != 2:
        raise UnsupportedModel(f"input {inputs[0].name!r} has {len(tensor.shape.dim)} dimensions; import "
                               "takes rows [batch, features]")
    return inputs[0].name


def read(model) -> Reading:
    """The ops of ``model`` (an ``onnx.ModelProto``); UnsupportedModel naming the first node that
    is not a linear layer, a supported activation or a no-op."""
    from onnx import helper

    opset, graph = _opset(model), model.graph
    consts = {t.name: _tensor(t) for t in graph.initializer}
    source = _source(graph, consts)
    branch, aliases, labels = _label_branch(graph, consts)
    uses = Counter([name for node in graph.node for name in node.input] + [o.name for o in graph.output])
    builder = _Builder(consts, {source}, aliases, uses, {t.name: t.data_type for t in graph.initializer})
    for i, node in enumerate(graph.node):
        if i in branch:
            continue
        builder.add(node, {a.name: helper.get_attribute_value(a) for a in node.attribute}, opset)
    dropped = {name for i in branch for name in graph.node[i].output} - set(aliases)
    outputs = [aliases.get(o.name, o.name) for o in graph.output if o.name not in dropped]
    if len(outputs) != 1:
        raise UnsupportedModel(f"the model has {len(outputs)} outputs {outputs}; import serves one "
                               "(a classifier's label output is read as its class labels)")
    if not builder.dtypes:
        raise UnsupportedModel("the model has no linear layer (Gemm, MatMul)")
    return Reading(builder.ops, source, builder.resolve(outputs[0]), labels, builder.dtypes[0], opset)


class _Builder:
    """Turns nodes into ops in graph order, folding constant nodes and a bias ``Add`` into its layer."""

    def __init__(self, consts: dict, variables: set[str], aliases: dict, uses: Counter, types: dict[str, int]):
        self.consts, self.variables, self.aliases = consts, variables, dict(aliases)
        self.uses = uses  # how many nodes (and graph outputs) read each tensor
        self.types = types  # ONNX element type of each constant tensor
        self.ops: list[Op] = []
        self.dtypes: list[str] = []  # of each layer's weights

    def resolve(self, name: str) -> str:
        while name in self.aliases:
            name = self.aliases[name]
        return name

    def add(self, node, attrs: dict, opset: int) -> None:
        inputs = [self.resolve(name) for name in node.input]
        computed = [name for name in inputs if name in self.variables]
        if node.op_type == "Constant" or not computed:
            self._fold_constant(node, attrs, inputs, opset)
        elif node.op_type in ("Gemm", "MatMul"):
            self._linear(node, attrs, inputs)
        elif node.op_type == "Add" and self._bias_of_last_layer(node, inputs):
            return
        else:
            fn = _function(node, attrs, opset)
            if fn is None or node.op_type in LABEL_OPS:
                raise UnsupportedModel(f"{_where(node)} is not a linear layer or a supported activation")
            names, bound = self._bind(fn, inputs)
            self.ops.append(Op(_where(node), names, node.output[0], fn=bound))
            self.variables.add(node.output[0])

    def _bind(self, fn, inputs: list[str]):
        """``(computed inputs, g)`` with ``g(*their values) == fn(*every input)``, constants bound."""
        slots = [(name in self.variables, name if name in self.variables else self.consts.get(name))
                 for name in inputs if name]
        names = tuple(value for computed, value in slots if computed)

        def bound(*values):
            given = iter(values)
            return fn(*(next(given) if computed else value for computed, value in slots))

        return names, bound

    def _fold_constant(self, node, attrs: dict, inputs: list[str], opset: int) -> None:
        if node.op_type == "Constant":
            if "value" in attrs:
                value = _tensor(attrs["value"])
                self.types[node.output[0]] = attrs["value"].data_type
            elif "value_float" in attrs or "value_floats" in attrs:
                value = torch.tensor(attrs.get("value_float", attrs.get("value_floats")), dtype=torch.float64)
            else:
                value = torch.tensor(attrs.get("value_int", attrs.get("value_ints")), dtype=torch.int64)
            self.consts[node.output[0]] = value
            return
        fn = _function(node, attrs, opset)
        if fn is None:
            raise UnsupportedModel(f"{_where(node)} is not a linear layer or a supported activation")
        self.consts[node.output[0]] = fn(*(self.consts[name] for name in inputs if name))
        self.types[node.output[0]] = next((self.types[name] for name in inputs if name in self.types), 1)

    def _linear(self, node, attrs: dict, inputs: list[str]) -> None:
        x, b = inputs[0], inputs[1]
        if x not in self.variables or b not in self.consts or attrs.get("transA", 0):
            raise UnsupportedModel(f"{_where(node)} is not a linear layer: it must multiply the rows by "
                                   "constant weights")
        w = self.consts[b]
        if w.dim() != 2:
            raise UnsupportedModel(f"{_where(node)} multiplies by a {w.dim()}-dimensional tensor, not a matrix")
        if node.op_type == "Gemm":
            weight = attrs.get("alpha", 1.0) * (w if attrs.get("transB", 0) else w.T)
            c = self.consts.get(inputs[2]) if len(inputs) > 2 and inputs[2] else None
            bias = torch.zeros(weight.shape[0], dtype=torch.float64) if c is None else \
                attrs.get("beta", 1.0) * torch.broadcast_to(c.to(torch.float64), (1, weight.shape[0]))[0]
        else:
            weight, bias = w.T, torch.zeros(w.shape[1], dtype=torch.float64)
        self.ops.append(Op(_where(node), (x,), node.output[0], weight=weight.contiguous(), bias=bias.clone()))
        self.variables.add(node.output[0])
        self.dtypes.append(DTYPES.get(self.types.get(b, 1), "float32"))

    def _bias_of_last_layer(self, node, inputs: list[str]) -> bool:
        """Fold ``Add(layer output, constant [N])`` into that layer's bias (MatMul + Add is one layer)."""
        last = self.ops[-1] if self.ops else None
        if last is None or last.weight is None or len(inputs) != 2 or last.output not in inputs \
                or self.uses[last.output] != 1:
            return False
        other = inputs[1] if inputs[0] == last.output else inputs[0]
        n = last.weight.shape[0]
        c = self.consts.get(other)
        if not isinstance(c, torch.Tensor) or not c.is_floating_point() or c.numel() not in (1, n) \
                or (c.dim() == 2 and c.shape[0] != 1) or c.dim() > 2:
            return False
        last.bias = last.bias + c.reshape(-1).to(torch.float64)
        self.aliases[node.output[0]] = last.output
        return True


def session(model, output: str):
    """An onnxruntime CPU session answering ``output`` (added to the graph's outputs if it is an
    inner tensor, as a ZipMap's input is)."""
    import onnx
    import onnxruntime

    if output not in {o.name for o in model.graph.output}:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(output))
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def answerer(model, reading: Reading):
    """onnxruntime's answer to float32 rows (cast to the input's type): the served tensor."""
    run = session(model, reading.output)
    types = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16}
    cast = types.get(run.get_inputs()[0].type, np.float32)
    return lambda x: run.run([reading.output], {reading.source: x.astype(cast)})[0]
