"""examples/ against the shipped server: the client classifies the digits, and the load recipe sends
requests the server answers (h2load itself is stood in for by a script that sends each body once)."""

import json
import os
import subprocess
import sys

import pytest

from fusedserve.service.grpc import inference_pb2 as pb
from fusedserve.service.http.routes.openapi import INFER_EXAMPLE

from . import test_readme_snippets
from .service.conftest import ROOT

server = test_readme_snippets.server  # the fixture: the shipped server, one per module

# Stands in for h2load: checks it was asked for one of the two runs, and sends its body once with curl.
FAKE_H2LOAD = """#!/usr/bin/env bash
set -euo pipefail
args=("$@"); url=${args[-1]}; body=""; headers=()
while [ $# -gt 1 ]; do
    case $1 in -d) body=$2; shift 2 ;; -H) headers+=(-H "$2"); shift 2 ;; *) shift ;; esac
done
cp "$body" "$OUT/$(basename "$body")"
if [[ $url == */infer ]]; then curl -sf "${headers[@]}" --data-binary @"$body" "$url" > "$OUT/answer.json"; fi
echo "$url" >> "$OUT/urls"
"""


@pytest.mark.timeout(120)
def test_the_client_classifies_the_digits(server):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "client.py"), "--url", server.url],
                         capture_output=True, text=True, timeout=100, check=False)
    assert out.returncode == 0, out.stderr
    right, total = map(int, out.stdout.split()[0].split("/"))
    assert total == 1797 and right / total > 0.95, out.stdout  # scikit-learn's digits; held-out 98.3%


@pytest.mark.timeout(120)
def test_the_load_recipe_sends_what_the_server_answers(server, tmp_path):
    fake = tmp_path / "bin" / "h2load"
    fake.parent.mkdir()
    fake.write_text(FAKE_H2LOAD)
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path),
           "PYTHON": sys.executable, "DURATION": "1", "CLIENTS": "2"}
    out = subprocess.run(["bash", str(ROOT / "examples" / "load.sh"), "127.0.0.1", str(server.port),
                          str(server.grpc_port)], capture_output=True, text=True, timeout=100, env=env, check=False)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "urls").read_text().split() == [
        f"http://127.0.0.1:{server.port}/infer",
        f"http://127.0.0.1:{server.grpc_port}/inference.GRPCInferenceService/ModelInfer"]
    assert json.loads((tmp_path / "infer.json").read_text()) == INFER_EXAMPLE
    assert json.loads((tmp_path / "answer.json").read_text())["model"] == "digits"
    frame = (tmp_path / "infer.grpc").read_bytes()
    assert frame[0] == 0 and int.from_bytes(frame[1:5], "big") == len(frame) - 5
    request = pb.ModelInferRequest.FromString(frame[5:])
    assert list(request.inputs[0].contents.fp32_contents) == INFER_EXAMPLE["inputs"][0]
