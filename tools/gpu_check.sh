#!/usr/bin/env bash
# Everything that needs the GPU: the GPU tests, kernel and model benchmarks, an end-to-end server.
# Run on the GPU host from the repository root (after `. .whl/setup.sh` where the web stack is
# missing):  bash tools/gpu_check.sh [STAGE ...]   (default: env tests e2e model kernels load)
#
# tests: the whole GPU suite, nothing left out, in two parts that each fit one device call:
#   tests-kernels (tests/kernels) and tests-rest (tests/models, tests/service, tests/bench,
#   tests/tools). Each part writes gpu_record_<part>.json (tools/gpu_record.py: the git trees of
#   kernels/ and models/ it ran on, GPU, versions, pytest's summary); merge them into
#   tests/gpu_record.json.
#   tests-all: the whole suite in one pytest (about 8 minutes on an H100 with 16 workers).
# smoke: a few minutes of GPU tests across every kernel family and the runner, after a refactor.
# tests-gluon-small, tests-gluon-ws, tests-tma: one family's GPU tests.
# e2e: a real server on the GPU answers POST /infer; its answers must match the CPU model.
# start-up: time-to-ready of `fusedserve serve` with an empty tune cache, Triton's cache empty then
#   warm, for the shipped repository and digits + a 4x2048 bf16 model at --max-batch-size 256
#   (bench/startup.py). start-up-tuning: then background tuning under traffic (answers checked, p99
#   while tuning vs after). start-up-load: the same under $LOAD_CLIENTS (256) connections per model in
#   windows, h2load from .tools/ (carry it) beside the project's generator, while tuning and after.
# tuning: bench/tuning.py (a model's tuning seconds, compiling against timing; TUNING_MODELS;
#   TUNING_AHEAD=1: the background tuner's way, candidates compiled ahead in parallel; TUNING_SEARCH
#   near (default) or full; TUNING_PROFILE=1 with TUNING_AHEAD: a cProfile of the tuning calls).
# kernels-random: bench/kernels.py --random $RANDOM_N --seed $RANDOM_SEED (shapes nobody benchmarked;
#   both seeds default to one from the clock; RANDOM_DTYPES, e.g. float32, draws those dtypes instead
#   of bf16/fp16; RANDOM_PRECOMPILE=1 compiles every shape's candidates first in parallel, so more
#   shapes fit the budget; RANDOM_SEARCH=near tunes as a server does, default full).
# configs: bench/configs.py $CONFIGS_FAMILY (gluon_small_m) at $CONFIGS_SHAPES ("MxNxK[:dtype] ..."), its best
#   configs again with each of $CONFIGS_VARY ("KEY=V,KEY=V ...") applied, against the library.
# host-path: bench/host_path.py at $HOST_PATH_CASES ("WIDTHS:DTYPE:BATCH ..."; HOST_PATH_AT_READY=1: provisional
#   choices): run() with graph copies against itself with one host step done the peer's way.
# model-contract-random: bench/model_contract.py --random $CONTRACT_RANDOM --seed $CONTRACT_SEED (models
#   nobody tuned for; CONTRACT_AT_READY=1: provisional choices, as a server before background tuning;
#   CONTRACT_STAGED=1: runners that copy the rows around their graphs, not inside them).
# onnx-peer: bench/onnx_peer.py (imported ONNX models vs onnxruntime on the same file; ONNX_DTYPE; needs
#   onnx and onnxruntime on the host). onnx-peer-http: the same end to end, fusedserve serve against a naive
#   FastAPI app on onnxruntime, loaded over HTTP (ONNX_BUDGET_S).
# model-contract: bench/model.py --contract (host rows in and out vs a torch CUDA graph with staging).
# dashboard: a real server on the GPU (DASHBOARD_REPOSITORY, default the shipped one) driven for
#   20 s; the live page's JSON saved to dashboard.jsonl (tools/dashboard_shot.py replay draws it).
# load-workers: issue 22's run: 8 front ends (LOAD_WORKERS="8 12": each count, the first is ours)
#   against naive FastAPI under uvicorn --workers 12, 64 and 256 clients, digits and the 4x2048 bf16
#   model (LOAD_MODELS), py-spy by process at 256 clients of PROFILE_MODEL (digits); LOAD_PROTOCOL=v2-binary
#   sends KServe v2 binary tensors instead of JSON /infer (fusedserve only).
# grpc-load: issue 22's gRPC against HTTP (bench/grpc_load.py) with 8 front ends and 8 client processes.
# model, kernels, kernels-small, kernels-at, kernels-full, load: benchmarks (bench/README.md);
#   kernels-at runs KERNELS_MS x KERNELS_NK (e.g. "128,256" and "4096x4096") in KERNELS_DTYPES
#   within KERNELS_BUDGET_S, its line noted $KERNELS_TAG.
# ab: this checkout against another at $AB_DIR (whose bench/kernels.py writes kernels.jsonl too),
#   bench/kernels.py alternated A B A B ($AB_ROUNDS); the comparison in ab.jsonl.
# imports: what start-up waits on before an engine loads (issue 38): torch's import, cold then warm,
#   with -X importtime (torch_importtime_<n>.txt), and the engine process's own imports.
# pack (last): everything under $OUT into one results.tgz.
# Results go to $OUT (default bench/results/gpu_check) as each benchmark's <benchmark>.jsonl, one
# line per run, with its plot (<stage>_<gpu>.png: h100, h200...) and the log, gpu_check.log; each
# stage has its own time limit. Back here, `python bench/runs.py add DIR` appends the runs and the log
# to bench/results. A run's commit is FUSEDSERVE_COMMIT where set (a copy's .git may be of another
# commit than the files it came with), else git's.
set -uo pipefail
out=${OUT:-bench/results/gpu_check}
# Plots are named after the GPU they ran on (h100, h200...), read from nvidia-smi.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -oiE '[a-z][0-9]{2,4}' | head -n 1 | tr 'A-Z' 'a-z')
gpu=${gpu:-gpu}
mkdir -p "$out"
log="$out/gpu_check.log"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(env tests e2e model kernels load)
export PYTHONUNBUFFERED=1 FUSEDSERVE_TUNE_CACHE=${FUSEDSERVE_TUNE_CACHE:-/tmp/fusedserve-tune}
commit=${FUSEDSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
[ -z "$commit" ] || echo "=== commit $commit" >> "$log"

# The package as pip installs it (fusedserve.kernels, .models, .service), linked to this checkout,
# so nothing needs building here.
pkg=/tmp/fusedserve-pkg
mkdir -p "$pkg/fusedserve"
for d in kernels models service; do ln -sfn "$PWD/$d" "$pkg/fusedserve/$d"; done
ln -sf "$PWD/fusedserve/__main__.py" "$pkg/fusedserve/__main__.py"
export PYTHONPATH=$pkg${PYTHONPATH:+:$PYTHONPATH}

stage() {  # stage NAME SECONDS CMD...: run one stage, log it, never stop the others
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date -u +%FT%TZ), limit ${limit}s): $*" | tee -a "$log"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$log"
}

load_workers() {  # issue 22's run: fusedserve with each of $LOAD_WORKERS front ends (the first is "ours");
    # LOAD_PROTOCOL=v2-binary drives KServe v2 binary tensors (the naive peer speaks only JSON: skipped)
    local w names=() servers=() workers=${LOAD_WORKERS:-8} protocol=${LOAD_PROTOCOL:-json} tag=""
    [ "$protocol" = json ] || tag="_$protocol"
    for w in $workers; do
        names+=("fusedserve_w$w")
        servers+=(--server "fusedserve_w$w={python} -m fusedserve serve --port {port} --device {device} \
--model-repository {repo} --grpc-port 0 --log-level warning --workers $w --background-tuning off")
    done
    stage load-workers 560 python3 bench/load.py --device cuda --models ${LOAD_MODELS:-digits wide} --clients 64 256 \
        --rounds 2 --duration 3 --servers "${names[@]}" naive_fastapi_12w --ours "${names[0]}" "${servers[@]}" \
        --profile --profile-clients 256 --profile-model "${PROFILE_MODEL:-digits}" --ready-timeout 110 \
        --protocol "$protocol" --out "$out" --note "load-workers: ${workers} front ends$tag" \
        --plot "$out/load_${gpu}_workers${workers// /_}$tag.png"
}

serve_bg() {  # serve_bg PORT LOG ARGS...: `fusedserve serve` in the background (its PID in server_pid);
    # succeeds once it is ready, fails if it exits or is not ready within 300 s
    local port=$1 log=$2; shift 2
    python3 -m fusedserve serve --port "$port" "$@" > "$log" 2>&1 &
    server_pid=$!
    for _ in $(seq 1 300); do
        if python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$port/v2/health/ready').status_code != 200)" 2>/dev/null; then
            return 0
        fi
        kill -0 "$server_pid" 2>/dev/null || return 1
        sleep 1
    done
    return 1
}

stop_bg() {  # stop_bg LOG LINES: SIGTERM the server serve_bg started (SIGKILL after 30 s), then its log's tail
    kill -TERM "$server_pid" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$server_pid" 2>/dev/null; wait "$server_pid" 2>/dev/null
    echo "--- server log (tail)"; tail -n "$2" "$1"
}

e2e() {  # a real server on the GPU, asked over HTTP, stopped by its PID
    local port=18000
    if serve_bg "$port" /tmp/fusedserve-e2e.log --device cuda; then
        python3 - "$port" "$out/e2e_kernel_stats.json" <<'PY'
import json, sys, httpx, torch
from fusedserve.models import load_model
port, dest = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
try:  # real digits where scikit-learn is installed (its wheels are ~45 MB of the device's carry)
    from sklearn.datasets import load_digits
    digits = load_digits()
    x, y = digits.data[:200].tolist(), digits.target[:200].tolist()
except ImportError:
    x, y = (torch.randint(0, 17, (200, 64), generator=torch.Generator().manual_seed(0)).float().tolist(), None)
outputs = []
for i in range(0, len(x), 50):  # the default --max-batch-size is 64 rows per request
    r = httpx.post(f"{base}/infer", json={"model": "digits", "inputs": x[i:i + 50]}, timeout=30)
    r.raise_for_status()
    outputs += r.json()["outputs"]
# The same rows through the plain torch model on the CPU: the served answers must match it.
reference = load_model("models/repository/digits", device="cpu", backend="torch")(torch.tensor(x))
worst = (torch.tensor(outputs) - reference).abs().max().item() / reference.abs().max().item()
print(f"e2e: {len(x)} rows over POST /infer on the GPU, largest difference from the torch model on "
      f"the CPU {worst:.2e} of its largest output")
if y is not None:
    pred = [max(range(10), key=row.__getitem__) for row in outputs]
    acc = sum(p == t for p, t in zip(pred, y)) / len(y)
    print(f"e2e: digits accuracy {acc:.3f}")
    assert acc > 0.95, acc
stats = httpx.get(f"{base}/kernel-stats", timeout=10).json()
json.dump(stats, open(dest, "w"), indent=2)
print(json.dumps(stats)[:1500])
assert worst < 1e-3, worst
PY
    else
        echo "e2e: server never became ready"
    fi
    stop_bg /tmp/fusedserve-e2e.log 40
}

dashboard() {  # a real server on the GPU under load, its page's JSON captured
    local port=18002 log=/tmp/fusedserve-dashboard.log
    if serve_bg "$port" "$log" --device "${DASHBOARD_DEVICE:-cuda}" --grpc-port 0 \
            ${DASHBOARD_REPOSITORY:+--model-repository "$DASHBOARD_REPOSITORY"}; then
        python3 tools/dashboard_shot.py drive --url "http://127.0.0.1:$port" --seconds 20 --out "$out"
    else
        echo "dashboard: server never became ready"
    fi
    stop_bg "$log" 20
}

gpu_tests() {  # gpu_tests PART PATH...: one part of the GPU suite, then its record
    local part=$1; shift
    # What the suite imports (serving's dependencies and the test extra's): a missing one fails every
    # test at collection, so name them all and skip the run.
    local missing
    missing=$(python3 -c 'import importlib, sys
def absent(name):
    try:
        importlib.import_module(name)
    except ImportError:
        return True
print(" ".join(m for m in sys.argv[1:] if absent(m)))' \
        fastapi uvicorn pydantic pydantic_settings orjson simdjson google.protobuf hpack prometheus_client safetensors \
        xdist pytest_timeout pytest_asyncio hypothesis httpx tritonclient)
    if [ -n "$missing" ]; then
        echo "=== tests-$part: not run, these modules are missing (bring their wheels): $missing" | tee -a "$log"
        return 1
    fi
    stage "tests-$part" "${GPU_TESTS_LIMIT:-560}" python3 -m pytest -m gpu -n 16 -q -rfs --tb=short --durations=10 --no-header \
        -p no:cacheprovider "$@" 2>&1 | tee "$out/tests_$part.log"
    python3 tools/gpu_record.py part "$part" "$out/tests_$part.log" "$out/gpu_record_$part.json"
}

ab() {  # A/B of two checkouts, runs alternated so process-to-process drift hits both sides alike
    [ -d "${AB_DIR:-}" ] || { echo "ab: AB_DIR must name the other checkout"; return 1; }
    local dir b_dir b_path runs_a=() runs_b=()
    dir=$(cd "$out" && pwd)/ab${AB_TAG:+_$AB_TAG}
    b_dir=$(cd "$AB_DIR" && pwd)
    # B's own checkout first on the path, and this checkout not on it at all
    b_path=$(printf '%s' "${PYTHONPATH:-}" | tr ':' '\n' | grep -vx -e "$(pwd)" -e '' | paste -sd: -)
    mkdir -p "$dir"
    local args=(--quick --no-compile --budget-s 200 --ms "${KERNELS_MS:-1,4,16,64}" --nk "${KERNELS_NK:-4096x4096}"
                --dtypes "${AB_DTYPES:-bfloat16}")
    for r in $(seq 1 "${AB_ROUNDS:-2}"); do  # each run in a kernels.jsonl of its own
        stage "ab-a-$r" 300 python3 bench/kernels.py "${args[@]}" --out "$dir/a_$r" --tune-cache "$dir/tune_a"
        stage "ab-b-$r" 300 env PYTHONPATH="$b_dir${b_path:+:$b_path}" bash -c 'cd "$0" && exec python3 bench/kernels.py "$@"' \
            "$b_dir" "${args[@]}" --out "$dir/b_$r" --tune-cache "$dir/tune_b"
        runs_a+=("$dir/a_$r/kernels.jsonl"); runs_b+=("$dir/b_$r/kernels.jsonl")
    done
    python3 tools/ab.py --a "${runs_a[@]}" --b "${runs_b[@]}" --out "$out" \
        --names "${AB_NAME_A:-this checkout}" "${AB_NAME_B:-$AB_DIR}" 2>&1 | tee -a "$log"
}

# Random shapes and models draw a seed nobody chose unless RANDOM_SEED / CONTRACT_SEED name one (the
# run's line records it).
fresh_seed=$(( $(date +%s) % 100000 ))
# The kernel stages share one tune cache, as the runs of one session on one GPU.
kernels_out=(--out "$out" --tune-cache "$out/tune_cache")
for s in "${stages[@]}"; do
    case $s in
        imports) stage imports 120 bash -c 'for i in 1 2; do python3 -X importtime -c "import torch" 2> "$0/torch_importtime_$i.txt"; \
            python3 -c "import time; t = time.perf_counter(); import fusedserve.service.workers.engine_process; \
print(f\"engine code imported in {time.perf_counter() - t:.2f} s\")"; done; sort -t"|" -k2 -n "$0/torch_importtime_2.txt" | tail -n 15' "$out" ;;
        env) stage env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"' ;;
        tests) gpu_tests kernels tests/kernels; gpu_tests rest tests/models tests/service tests/bench tests/tools ;;
        tests-all) GPU_TESTS_LIMIT=${GPU_TESTS_LIMIT:-500} gpu_tests all tests/kernels tests/models tests/service tests/bench tests/tools ;;
        tests-kernels) gpu_tests kernels tests/kernels ;;
        tests-rest) gpu_tests rest tests/models tests/service tests/bench tests/tools ;;
        smoke) stage smoke 300 python3 -m pytest -m gpu -n 16 -q -rfs --tb=short --no-header -p no:cacheprovider \
            tests/kernels/test_activations.py tests/kernels/test_gluon_ws.py tests/models/test_runner_gpu.py \
            tests/kernels/test_fused_linear_gpu.py -k "not dependent_layers and not large_shapes" ;;
        tests-gluon-small) stage tests-gluon-small 300 python3 -m pytest -m gpu -n 8 -q -rfs --tb=short --no-header \
            -p no:cacheprovider tests/kernels/test_gluon_small_m.py tests/kernels/test_fused_linear_gpu.py ;;
        tests-gluon-ws) stage tests-gluon-ws 240 python3 -m pytest -m gpu -n 8 -q -rfs --tb=short --no-header \
            -p no:cacheprovider tests/kernels/test_gluon_ws.py ;;
        tests-tma) stage tests-tma 200 python3 -m pytest -m gpu -n 8 -q -rfs --tb=short --no-header -p no:cacheprovider \
            tests/kernels/test_fused_linear_gpu.py tests/kernels/test_fused_linear.py -k "tma" ;;
        kernels-small) stage kernels-small 330 python3 bench/kernels.py --quick --no-compile --budget-s 270 \
            --ms "${KERNELS_MS:-1,4,16,32,64,128,256,512}" --dtypes "${KERNELS_DTYPES:-float16,bfloat16}" \
            --note kernels-small "${kernels_out[@]}" --plot "$out/kernels-small_$gpu.png" ;;
        e2e) echo "=== e2e ($(date -u +%FT%TZ))" | tee -a "$log"; e2e 2>&1 | tee -a "$log" ;;
        model) stage model 420 python3 bench/model.py --quick --out "$out" --plot "$out/model_$gpu.png" ;;
        start-up) stage start-up 560 python3 bench/startup.py --ready-timeout-s 120 --out "$out" ;;
        start-up-tuning) stage start-up-tuning 580 python3 bench/startup.py --tuning --ready-timeout-s 120 \
            --tuning-timeout-s 360 --out "$out" ;;
        start-up-load) stage start-up-load 590 python3 bench/startup.py --tuning --ready-timeout-s 120 \
            --tuning-timeout-s "${LOAD_TUNING_S:-300}" --clients "${LOAD_CLIENTS:-256}" --h2load .tools --out "$out" ;;
        configs) stage configs "${CONFIGS_LIMIT_S:-240}" python3 bench/configs.py "${CONFIGS_FAMILY:-gluon_small_m}" \
            $CONFIGS_SHAPES ${CONFIGS_VARY:+--vary $CONFIGS_VARY} --out "$out" ;;
        host-path) stage host-path "${HOST_PATH_LIMIT_S:-240}" python3 bench/host_path.py $HOST_PATH_CASES \
            ${HOST_PATH_AT_READY:+--at-ready} --out "$out" ;;
        tuning) stage tuning "${TUNING_LIMIT_S:-300}" python3 bench/tuning.py ${TUNING_MODELS:+--models $TUNING_MODELS} ${TUNING_AHEAD:+--ahead} \
            ${TUNING_SEARCH:+--search $TUNING_SEARCH} ${TUNING_PROFILE:+--profile} \
            --out "$out" ;;
        kernels-random) stage kernels-random 590 python3 bench/kernels.py --random "${RANDOM_N:-40}" \
            --seed "${RANDOM_SEED:-$fresh_seed}" --budget-s "${RANDOM_BUDGET_S:-480}" ${RANDOM_DTYPES:+--dtypes "$RANDOM_DTYPES"} ${RANDOM_PRECOMPILE:+--precompile} "${kernels_out[@]}" \
            ${RANDOM_SEARCH:+--search $RANDOM_SEARCH} \
            --plot "$out/kernels-random_$gpu.png" ;;
        model-contract-random) stage model-contract-random "${CONTRACT_LIMIT_S:-590}" python3 bench/model_contract.py \
            --random "${CONTRACT_RANDOM:-6}" --seed "${CONTRACT_SEED:-$fresh_seed}" ${CONTRACT_AT_READY:+--at-ready} ${CONTRACT_QUICK:+--quick} \
            ${CONTRACT_STAGED:+--staged} \
            --budget-s "${CONTRACT_BUDGET_S:-420}" --out "$out" ;;
        onnx-peer) stage onnx-peer "${ONNX_LIMIT_S:-400}" python3 bench/onnx_peer.py --dtype "${ONNX_DTYPE:-float32}" \
            --out "$out" ;;
        onnx-peer-http) stage onnx-peer-http "${ONNX_LIMIT_S:-400}" python3 bench/onnx_peer.py --http --device cuda \
            --dtype "${ONNX_DTYPE:-float32}" --budget-s "${ONNX_BUDGET_S:-300}" --out "$out" ;;
        model-contract) stage model-contract 590 python3 bench/model.py --contract --budget-s "${CONTRACT_BUDGET_S:-420}" \
            ${CONTRACT_QUICK:+--quick} --out "$out" --plot "$out/model-contract_$gpu.png" ;;
        dashboard) echo "=== dashboard ($(date -u +%FT%TZ))" | tee -a "$log"; dashboard 2>&1 | tee -a "$log" ;;
        kernels) stage kernels 260 python3 bench/kernels.py --quick --budget-s 140 "${kernels_out[@]}" \
            --plot "$out/kernels_$gpu.png" ;;
        kernels-at) stage kernels-at $((${KERNELS_BUDGET_S:-270} + 60)) python3 bench/kernels.py --quick --no-compile \
            --budget-s "${KERNELS_BUDGET_S:-270}" \
            --ms "${KERNELS_MS:?}" --nk "${KERNELS_NK:-4096x4096}" --dtypes "${KERNELS_DTYPES:-bfloat16,float16}" \
            --note "kernels-at ${KERNELS_TAG:-}" "${kernels_out[@]}" --plot "$out/kernels-at_$gpu.png" ;;
        kernels-full) stage kernels-full 570 python3 bench/kernels.py --budget-s 400 "${kernels_out[@]}" \
            --plot "$out/kernels-full_$gpu.png" ${KERNELS_NK:+--nk "$KERNELS_NK" --note "kernels-full at $KERNELS_NK"} ;;
        # ~4 min with the tune cache warm (a cold one adds ~2-3 min of start-up); LitServe and py-spy
        # where their wheels were brought (../shared/gpu/wheels.sh litserve py-spy matplotlib).
        load) stage load 420 python3 bench/load.py --device cuda --quick --out "$out" --plot "$out/load_$gpu.png" ;;
        load-workers) load_workers ;;
        # gRPC against HTTP on the GPU host: 8 front ends, the clients spread over 8 processes (needs
        # tritonclient[grpc] and hpack among the brought wheels).
        grpc-load) stage grpc-load 560 python3 bench/grpc_load.py --device cuda --procs 8 \
            --fusedserve-flags "--workers 8 --max-batch-size 256" --clients 64 256 --reps 2 --no-floor \
            --out "$out" ;;
        ab) ab ;;
        pack) tar -czf "/tmp/gpu_check_results.tgz" -C "$out" . && rm -rf "${out:?}"/* \
            && mv /tmp/gpu_check_results.tgz "$out/results.tgz" && echo "packed into $out/results.tgz" ;;
        *) echo "unknown stage: $s (see the list at the top of tools/gpu_check.sh)" | tee -a "$log" ;;
    esac
done
