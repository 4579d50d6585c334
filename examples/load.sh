#!/usr/bin/env bash
# Load a running fusedserve with h2load, nghttp2's C load generator for HTTP/1.1 and HTTP/2
# (Debian/Ubuntu: apt-get install nghttp2-client): POST /infer over HTTP/1.1, then gRPC ModelInfer,
# one digit per request. A Python client is no load generator: it would saturate before the server.
#
#   examples/load.sh [HOST [HTTP_PORT [GRPC_PORT]]]      # default 127.0.0.1 8000 8001
#   CLIENTS=256 DURATION=30 examples/load.sh             # connections, seconds per run
#
# h2load counts HTTP statuses; a gRPC call's own status travels in its trailers, so read the outcomes
# of the gRPC run from fusedserve_requests_total in /metrics. Needs the fusedserve package importable
# (PYTHON, default python3) to write the request bodies.
set -euo pipefail
host=${1:-127.0.0.1}
http_port=${2:-8000}
grpc_port=${3:-8001}
clients=${CLIENTS:-64}
duration=${DURATION:-10}
threads=$(( $(nproc) < clients ? $(nproc) : clients ))
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"${PYTHON:-python3}" - "$work" <<'PY'
import json
import sys

from fusedserve.service.grpc import inference_pb2 as pb
from fusedserve.service.http.routes.openapi import INFER_EXAMPLE

out = sys.argv[1]
with open(f"{out}/infer.json", "w") as f:
    json.dump(INFER_EXAMPLE, f)
row = INFER_EXAMPLE["inputs"][0]
request = pb.ModelInferRequest(model_name=INFER_EXAMPLE["model"], inputs=[
    pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=[1, len(row)],
                                          contents=pb.InferTensorContents(fp32_contents=row))])
message = request.SerializeToString()
with open(f"{out}/infer.grpc", "wb") as f:  # gRPC's framing: not compressed, length, message
    f.write(b"\x00" + len(message).to_bytes(4, "big") + message)
PY

echo "== POST /infer over HTTP/1.1: $clients connections, $duration s"
h2load --h1 -c "$clients" -t "$threads" -D "$duration" -d "$work/infer.json" \
    -H 'content-type: application/json' "http://$host:$http_port/infer"

if [ "$grpc_port" != 0 ]; then
    echo "== gRPC ModelInfer: $clients connections x 8 streams, $duration s"
    h2load -c "$clients" -m 8 -t "$threads" -D "$duration" -d "$work/infer.grpc" \
        -H 'content-type: application/grpc' -H 'te: trailers' \
        "http://$host:$grpc_port/inference.GRPCInferenceService/ModelInfer"
fi
