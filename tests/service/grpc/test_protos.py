"""The KServe v2 gRPC messages are our own (service/grpc/inference.proto, compiled by tools/protos.py):
the committed module is what the .proto compiles to, every field has the number and type tritonclient's
messages give it (so the wire bytes are the same), and serving imports neither grpcio nor tritonclient."""

import ast
import re
import subprocess
import sys

import tomllib
from tritonclient.grpc import model_config_pb2, service_pb2

from fusedserve.service.grpc import inference_pb2
from tools import protos

from ..conftest import ROOT

THEIRS = {**service_pb2.DESCRIPTOR.message_types_by_name, **model_config_pb2.DESCRIPTOR.message_types_by_name}


def _serialized(module_text: str) -> bytes:
    """The FileDescriptorProto a generated module registers (what protoc compiled, without its
    version-stamped code around it)."""
    literal = re.search(r"AddSerializedFile\((b'.*?')\)\n", module_text, re.S)
    assert literal, "no AddSerializedFile(...) in the generated module"
    return ast.literal_eval(literal.group(1))


def test_the_generated_module_is_what_the_proto_compiles_to():
    fresh = _serialized(protos.compile_proto())
    committed = _serialized(protos.GENERATED.read_text())
    assert fresh == committed, "service/grpc/inference_pb2.py is stale: run python tools/protos.py"
    assert inference_pb2.DESCRIPTOR.serialized_pb == committed


def _kind(field) -> tuple:
    """A field as the wire sees it: number, type, repeated, and the (unqualified) type it names."""
    named = field.message_type or field.enum_type
    return (field.number, field.type, field.is_repeated, named and named.name)


def _same_fields(ours, theirs, where: str) -> list[str]:
    problems = []
    for field in ours.fields:
        other = theirs.fields_by_name.get(field.name)
        if other is None or _kind(field) != _kind(other):
            problems.append(f"{where}.{field.name}: ours {_kind(field)}, tritonclient's "
                            f"{other and _kind(other)}")
    for nested in ours.nested_types:
        problems += _same_fields(nested, theirs.nested_types_by_name[nested.name], f"{where}.{nested.name}")
    return problems


def test_every_field_has_tritonclients_number_and_type():
    problems = []
    for name, ours in inference_pb2.DESCRIPTOR.message_types_by_name.items():
        assert name in THEIRS, f"message {name} is not one of the protocol's"
        problems += _same_fields(ours, THEIRS[name], name)
    assert not problems, "\n".join(problems)
    ours = {v.name: v.number for v in inference_pb2.DESCRIPTOR.enum_types_by_name["DataType"].values}
    theirs = {v.name: v.number for v in model_config_pb2.DESCRIPTOR.enum_types_by_name["DataType"].values}
    assert ours == theirs


def test_every_method_is_the_protocols():
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name
    for method in inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        other = theirs[method.name]
        assert (method.input_type.name, method.output_type.name, method.client_streaming,
                method.server_streaming) == (other.input_type.name, other.output_type.name,
                                             other.client_streaming, other.server_streaming), method.name


def test_serving_imports_neither_grpcio_nor_tritonclient():
    code = ("import sys; from fusedserve.service.app import create_app; "
            "import fusedserve.service.grpc.server, fusedserve.service.cli; create_app(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'tritonclient')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = " ".join(project["dependencies"])
    assert "grpcio" not in named and "tritonclient" not in named, project["dependencies"]
    assert any(r.startswith("tritonclient[") for r in project["optional-dependencies"]["client"])
