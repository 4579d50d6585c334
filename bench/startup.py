"""Time-to-ready of ``fusedserve serve`` on a cold machine, and background tuning under traffic.

Run on the GPU host from the repository root (``bench/gpu_check.sh start-up`` and
``start-up-tuning`` run these):

    python bench/startup.py                  # ready times, eight scenarios
    python bench/startup.py --tuning         # one scenario, then background tuning under traffic
    python bench/startup.py --only 4x2048 --compare-serial   # plus a cold start, compiling serially

Scenarios (``ready``): the shipped repository (default ``--max-batch-size``) and a repository of the
shipped digits plus a 4x2048 bf16 MLP (``--max-batch-size 256``), each started three times with an
empty tune cache: with an empty Triton cache (``TRITON_CACHE_DIR`` a fresh directory: a bare host
after ``pip install``), with the Triton cache that first start left (a restart), and with one that
``fusedserve precompile`` filled with no GPU visible (a fresh container from the image; its seconds
recorded too; ``--no-image`` skips it), then once more from the warm Triton cache with one front end
(``--workers 1``; the others use the server's default). Ready = ``GET /v2/health/ready`` answers 200, timed from the
server's process start. Each row also has the server's own split per model (``/kernel-stats``
``served[model].startup_s``: compile, tune, capture, path choice) and its bucket states. Targets
(``READY_TARGET_S``): 20 s with both caches empty, 12 s from the image's, 10 s from a warm Triton cache.

``--tuning``: the 4x2048 repository with a warm Triton cache and an empty tune cache; once ready, a
client sends one request at a time (1, 3, 17 or 64 rows, cycling) while background tuning runs, until
``/kernel-stats`` shows no provisional bucket, and ``--after-s`` more; then two restarts on both caches
as tuning left them (scenario ``4x2048_restart``, target 6 s), with the default front ends and with one.
Reports how long tuning took, every answer's correctness against the torch model on the CPU, and the
p99 latency while tuning against the p99 after (target: at most 2x). ``--clients 256`` adds load: windows of that many
connections on one row of each model, h2load (``--h2load DIR``) and the project's own generator in
turn, while tuning runs and for ``--steady-rounds`` rounds after (``bench/load_windows.py``; issue
38's targets: req/s while tuning >= 0.8x steady, p99 <= 1.5x, per model, under h2load).

Appends the run to ``OUT/startup.jsonl`` (``bench/runs.py``; OUT defaults to bench/results), one row
per scenario (``scenario``: shipped, 4x2048, background_tuning or 4x2048_restart), rewritten after every scenario.
"""

import argparse
import datetime
import functools
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from bench import (  # noqa: E402
    h2load,
    load_windows as windowed,  # noqa: E402
    runs,
)
from bench.loadgen import LoadPool  # noqa: E402
from fusedserve.models import DEFAULT_REPOSITORY, MLP, MLPConfig, load_model, save_model  # noqa: E402

# Seconds to ready by the caches a start finds (issues 23 and 38): Triton's empty (a pip install on a
# bare host), filled by ``fusedserve precompile`` without a GPU (a fresh container from the image),
# left by an earlier start (a restart); "tuned": both caches as background tuning left them.
READY_TARGET_S = {"empty": 20.0, "image": 12.0, "warm": 10.0, "tuned": 6.0}
BIG = ("mlp4x2048", 2048, "bfloat16")
BIG_MAX_BATCH = 256
TRAFFIC_ROWS = (1, 3, 17, 64)


def log(*args):
    print(*args, flush=True)


def big_repository(root: Path) -> Path:
    """The shipped digits plus a 4x2048 bf16 MLP with seeded weights."""
    repo = root / "repo_4x2048"
    if not repo.exists():
        save_model(load_model(DEFAULT_REPOSITORY / "digits", device="cpu", backend="torch"), repo / "digits")
        name, width, dtype = BIG
        torch.manual_seed(width)
        save_model(MLP(MLPConfig(width, (width,) * 3, width, dtype=dtype), name=name), repo / name)
    return repo


class Server:
    """``python -m fusedserve serve`` on CUDA, HTTP only, with its own caches and log file."""

    def __init__(self, repo: Path, max_batch: int | None, port: int, env: dict, log_path: Path, device="cuda",
                 workers: int | None = None):
        argv = [sys.executable, "-m", "fusedserve", "serve", "--device", device, "--port", str(port),
                "--grpc-port", "0", "--model-repository", str(repo)]
        if max_batch:
            argv += ["--max-batch-size", str(max_batch)]
        if workers:
            argv += ["--workers", str(workers)]
        self.port, self.log_path = port, log_path
        self.started, self.started_unix = time.perf_counter(), time.time()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, stdout=open(log_path, "w"),
                                     stderr=subprocess.STDOUT)

    def get(self, path: str):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def wait_ready(self, timeout_s: float) -> float | None:
        """Seconds from the process start to the first 200 on the readiness probe; None if never."""
        while time.perf_counter() - self.started < timeout_s and self.proc.poll() is None:
            try:
                if self.get("/v2/health/ready")[0] == 200:
                    return time.perf_counter() - self.started
            except OSError:
                pass
            time.sleep(0.05)
        return None

    def served(self) -> dict:
        return json.loads(self.get("/kernel-stats")[1])["served"]

    def stop(self) -> list[str]:
        """Stop it (SIGTERM, then SIGKILL after 30 s); its log's lines (the readiness polls' access
        lines fill its tail, so readers filter: ``startup_lines``, ``phases``)."""
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.log_path.read_text(errors="replace").splitlines()


# Seconds from the process start to the first log line holding each mark, from the log's timestamps.
PHASES = {"engine_imported": "engine imported its code", "imported": "Started server process",
          "models_loaded": "loaded model", "warm": "start-up '", "ready": "ready after"}


def phases(lines: list[str], started_unix: float) -> dict[str, float]:
    """Where the time to ready went: when the server had imported its code, loaded, warmed, was ready."""
    found = {}
    for line in lines:
        for phase, mark in PHASES.items():
            if mark in line:
                try:
                    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except ValueError:
                    continue
                found[phase] = round(stamp - started_unix, 2)  # the last such line: the last model
    return found


def startup_lines(lines: list[str]) -> list[str]:
    """The server's own start-up and tuning lines from its log."""
    keys = ("start-up ", "ready after", "background tuning", "tuning worker", "Triton's cache is", "compile worker")
    return [line for line in lines if any(k in line for k in keys)]


def ready_scenario(name, repo, max_batch, triton_dir: Path, work: Path, args, parallel=True,
                   triton_state: str | None = None, tune_dir: Path | None = None, workers: int | None = None) -> dict:
    """Start a server with ``triton_dir`` as Triton's cache and ``tune_dir`` (default: an empty one) as
    its tune cache; time it to ready. ``parallel``: its --parallel-compile; ``workers``: its front ends
    (default: the server's). ``triton_state`` names the Triton cache (default: "warm" where
    ``triton_dir`` holds anything, else "empty")."""
    if triton_state is None:
        triton_state = "warm" if triton_dir.exists() and any(triton_dir.iterdir()) else "empty"
    tune_state = "empty" if tune_dir is None else "tuned"
    tune_dir = tune_dir or Path(tempfile.mkdtemp(prefix="tune-", dir=work))
    env = {"TRITON_CACHE_DIR": str(triton_dir), "FUSEDSERVE_TUNE_CACHE": str(tune_dir),
           "FUSEDSERVE_BACKGROUND_TUNING": "off", "FUSEDSERVE_PARALLEL_COMPILE": "on" if parallel else "off"}
    server = Server(repo, max_batch, args.port, env, work / f"{name}_{triton_state}_{workers}.log", args.device,
                    workers)
    ready_s = server.wait_ready(args.ready_timeout_s)
    served = {}
    if ready_s is not None:
        served = {model: {"startup_s": info.get("startup_s"), "choices": info.get("choices")}
                  for model, info in server.served().items()}
    lines = server.stop()
    target = READY_TARGET_S["tuned" if tune_state == "tuned" else triton_state]
    row = dict(scenario=name, triton_cache=triton_state, tune_cache=tune_state, max_batch_size=max_batch,
               parallel_compile=parallel, workers=workers,
               ready_s=None if ready_s is None else round(ready_s, 2), target_s=target,
               met=ready_s is not None and ready_s <= target, served=served,
               phases_s=phases(lines, server.started_unix), log=startup_lines(lines))
    if ready_s is None:
        row["log_tail"] = lines[-40:]
    ready = "never" if ready_s is None else f"in {ready_s:.1f} s"
    log(f"{name}: Triton cache {triton_state}, tune cache {tune_state}, parallel compile "
        f"{'on' if parallel else 'off'}, front ends {workers or 'default'}: ready {ready} (target {target:.0f} s)")
    log(f"  seconds from start: {row['phases_s']}")
    for model, info in served.items():
        log(f"  {model}: {info['startup_s']}")
    return row


def image_scenario(name, repo, max_batch, work: Path, args) -> dict:
    """A fresh container from the image: Triton's cache filled by ``fusedserve precompile`` with no
    GPU visible (as the image's build does), then a start on it with an empty tune cache."""
    triton_dir = work / f"triton_{name}_image"
    argv = [sys.executable, "-m", "fusedserve", "precompile", "--model-repository", str(repo)]
    if max_batch:
        argv += ["--max-batch-size", str(max_batch)]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=args.precompile_timeout_s,
                          env={**os.environ, "TRITON_CACHE_DIR": str(triton_dir), "CUDA_VISIBLE_DEVICES": ""})
    seconds = round(time.perf_counter() - start, 1)
    log(f"{name}: precompile without a GPU took {seconds} s (exit {done.returncode}): {done.stdout.strip()[-300:]}")
    row = ready_scenario(name, repo, max_batch, triton_dir, work, args, triton_state="image")
    row.update(precompile_s=seconds, precompile_rc=done.returncode)
    if done.returncode:
        row["met"], row["precompile_tail"] = False, (done.stdout + done.stderr).splitlines()[-20:]
    return row


def _infer_body(model: str, in_features: int, rows: int, g: torch.Generator) -> tuple[bytes, torch.Tensor]:
    x = (4 * torch.rand(rows, in_features, generator=g)).round(decimals=3)
    return json.dumps({"model": model, "inputs": x.tolist()}).encode(), x


def traffic(port, model: str, reference, stop: threading.Event, samples: list, wrong: list) -> None:
    """One request at a time on a keep-alive connection; (time, seconds, rows) per answer."""
    g = torch.Generator().manual_seed(0)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    i = 0
    while not stop.is_set():
        rows = TRAFFIC_ROWS[i % len(TRAFFIC_ROWS)]
        i += 1
        body, x = _infer_body(model, reference.config.in_features, rows, g)
        start = time.perf_counter()
        conn.request("POST", "/infer", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
        samples.append((start, time.perf_counter() - start, rows))
        if response.status != 200:
            wrong.append(f"status {response.status}: {payload[:200]!r}")
            continue
        got = torch.tensor(json.loads(payload)["outputs"])
        with torch.no_grad():
            want = reference(x).float()
        if not torch.allclose(got, want, rtol=6e-2, atol=6e-2 * want.abs().max().item()):  # bf16 layers
            wrong.append(f"{rows} rows: max diff {(got - want).abs().max().item():.3g}")
    conn.close()


def p99(values) -> float | None:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 20 else None


def summary(rows: list[dict]) -> dict:
    """Issue 23's targets over the scenarios: whether each met its own, and the ones that missed."""
    missed = [f"{r['scenario']} (Triton cache {r['triton_cache']}): ready {r['ready_s']} s, target {r['target_s']} s"
              if "target_s" in r else f"{r['scenario']}: tuned {r.get('tuned_s')} s, p99 ratio {r.get('p99_ratio')}"
              for r in rows if not r.get("met")]
    return {"met": bool(rows) and not missed, "missed": missed}


def watch_tuning(server: Server, timeout_s: float, done: dict) -> None:
    """Poll ``/kernel-stats`` until no bucket is provisional: ``done["at"]`` is then perf_counter()."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        try:
            choices = [s for info in server.served().values() for s in info["choices"].values()]
        except (OSError, ValueError, KeyError):  # a busy or restarting server: ask again
            choices = ["provisional"]
        if "provisional" not in choices:
            done["at"] = time.perf_counter()
            return
        time.sleep(0.5)


def traffic_windows(repo: Path, port: int, args, pool) -> windowed.LoadWindows | None:
    """Windows of ``--clients`` connections on one row of each model (None without ``--clients``)."""
    if not args.clients:
        return None
    g = torch.Generator().manual_seed(1)
    widths = {name: load_model(repo / name, device="cpu", backend="torch").config.in_features
              for name in ("digits", BIG[0])}
    bodies = {name: _infer_body(name, width, 1, g)[0] for name, width in widths.items()}
    binary = h2load.find(args.h2load)
    if binary is None:
        log("h2load not found (--h2load DIR or PATH): the project's load generator alone")
    return windowed.LoadWindows(port, bodies, args.clients, args.window_s, pool, binary, threads=args.load_procs)


def tuning_scenario(repo, triton_dir: Path, tune_dir: Path, work: Path, args, pool=None) -> dict:
    """Background tuning of the 4x2048 repository under traffic, into ``tune_dir``: duration, answers,
    p99 during vs after from one checking client; with ``--clients``, req/s and p99 of load windows
    during vs after."""
    env = {"TRITON_CACHE_DIR": str(triton_dir), "FUSEDSERVE_TUNE_CACHE": str(tune_dir)}
    server = Server(repo, BIG_MAX_BATCH, args.port, env, work / "tuning.log", args.device)
    ready_s = server.wait_ready(args.ready_timeout_s)
    row = dict(scenario="background_tuning", ready_s=ready_s and round(ready_s, 2), max_batch_size=BIG_MAX_BATCH)
    if ready_s is None:
        row["log_tail"] = server.stop()[-40:]
        return row
    try:
        under_traffic(server, repo, args, pool, row)
    finally:
        row["log"] = startup_lines(server.stop())
    return row


def under_traffic(server: Server, repo: Path, args, pool, row: dict) -> None:
    """Traffic while background tuning runs and after, into ``row``: the checking client's answers
    and p99, and with ``--clients`` the load windows' comparison."""
    reference = load_model(repo / BIG[0], device="cpu", backend="torch")
    loads = traffic_windows(repo, args.port, args, pool)
    samples, wrong, stop, done = [], [], threading.Event(), {}
    client = threading.Thread(target=traffic, args=(args.port, BIG[0], reference, stop, samples, wrong), daemon=True)
    watcher = threading.Thread(target=watch_tuning, args=(server, args.tuning_timeout_s, done), daemon=True)
    t0 = time.perf_counter()
    client.start()
    watcher.start()
    windows = drive(loads, watcher, args)
    stop.set()
    client.join(60)
    tuned_at = done.get("at")
    row.update(tuned_s=None if tuned_at is None else round(tuned_at - t0, 1), **checked(samples, wrong, tuned_at),
               served={m: info["choices"] for m, info in server.served().items()})
    row["met"] = bool(tuned_at and not wrong and row["p99_ratio"] is not None and row["p99_ratio"] <= 2.0)
    log(f"background tuning: {'done in ' + str(row['tuned_s']) + ' s' if tuned_at else 'not done'}, "
        f"{len(samples)} checked requests, {len(wrong)} wrong, their p99 {row['p99_ms_during']} ms while tuning vs "
        f"{row['p99_ms_after']} ms after ({row['p99_ratio']}x, target <= 2x)")
    if loads:
        windowed.label(windows, tuned_at)
        row.update(clients=args.clients, window_s=args.window_s, load=windowed.compare(windows),
                   windows=windowed.stored(windows))
        row["met"] = row["met"] and all(r["met"] for r in row["load"] if r["generator"] == loads.generators()[0])
        for r in row["load"]:
            log(f"  {r['model']} via {r['generator']}: {r['rps_tuning']} req/s while tuning vs {r['rps_steady']} "
                f"({r['rps_ratio']}x), p99 {r['p99_ms_tuning']} vs {r['p99_ms_steady']} ms ({r['p99_ratio']}x)")


def drive(loads: windowed.LoadWindows | None, watcher: threading.Thread, args) -> list[dict]:
    """Load windows while ``watcher`` waits for tuning, then ``--steady-rounds`` more; without load
    windows, the checking client alone until tuned and ``--after-s`` more."""
    windows = []
    while watcher.is_alive():
        if loads:
            windows += loads.round()
        else:
            time.sleep(0.5)
    if not loads:
        time.sleep(args.after_s)
        return windows
    for _ in range(args.steady_rounds):
        windows += loads.round()
    return windows


def checked(samples: list, wrong: list, tuned_at: float | None) -> dict:
    """The checking client's figures: requests, wrong answers, p99 while tuning and after."""
    during = [s for t, s, _ in samples if tuned_at is None or t < tuned_at]
    after = [s for t, s, _ in samples if tuned_at is not None and t >= tuned_at]
    found = dict(requests=len(samples), wrong=wrong[:20], wrong_count=len(wrong),
                 p99_ms_during=p99(during) and round(p99(during) * 1e3, 2),
                 p99_ms_after=p99(after) and round(p99(after) * 1e3, 2))
    found["p99_ratio"] = (round(found["p99_ms_during"] / found["p99_ms_after"], 2)
                          if found["p99_ms_during"] and found["p99_ms_after"] else None)
    return found


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runs.arguments(parser)
    parser.add_argument("--port", type=int, default=18100)
    parser.add_argument("--ready-timeout-s", type=float, default=150)
    parser.add_argument("--tuning", action="store_true", help="background tuning under traffic instead")
    parser.add_argument("--tuning-timeout-s", type=float, default=300)
    parser.add_argument("--after-s", type=float, default=15, help="--tuning: traffic this long once tuned")
    parser.add_argument("--clients", type=int, default=0,
                        help="--tuning: also load each model with this many connections in windows, during and after")
    parser.add_argument("--window-s", type=int, default=3, help="--clients: seconds per load window")
    parser.add_argument("--steady-rounds", type=int, default=3, help="--clients: rounds of windows once tuned")
    parser.add_argument("--h2load", help="--clients: folder holding h2load and its libraries (default: PATH)")
    parser.add_argument("--load-procs", type=int, default=4, help="--clients: the project's generator's processes "
                        "and h2load's threads")
    parser.add_argument("--only", choices=("shipped", "4x2048"), help="one repository of the ready scenarios")
    parser.add_argument("--device", default="cuda", help="the servers' --device (cpu: a dry run of the mechanics)")
    parser.add_argument("--no-image", action="store_true",
                        help="skip the start from a Triton cache `fusedserve precompile` filled (the image's)")
    parser.add_argument("--precompile-timeout-s", type=float, default=240)
    parser.add_argument("--compare-serial", action="store_true",
                        help="also start each repository cold with --parallel-compile off (a fresh Triton cache)")
    return parser.parse_args(argv)


def tuning_rows(big: Path, work: Path, args) -> list[dict]:
    """--tuning: the big repository tuned under traffic, then restarted on what tuning left."""
    triton_dir = work / "triton_big"
    ready_scenario("4x2048_prefill", big, BIG_MAX_BATCH, triton_dir, work, args)  # fills the Triton cache
    pool = LoadPool(args.load_procs) if args.clients else None
    tune_dir = Path(tempfile.mkdtemp(prefix="tune-", dir=work))
    try:
        rows = [tuning_scenario(big, triton_dir, tune_dir, work, args, pool)]
    finally:
        if pool:
            pool.close()
    if rows[-1].get("tuned_s"):  # a restart on what tuning left, both caches warm: 8 front ends, then 1
        for workers in (None, 1):
            rows.append(ready_scenario("4x2048_restart", big, BIG_MAX_BATCH, triton_dir, work, args,
                                       tune_dir=tune_dir, workers=workers))
    return rows


def ready_rows(big: Path, work: Path, args, save) -> list[dict]:
    """Each repository's starts to ready, ``save(rows)`` after each (``repository_starts``)."""
    rows = []
    for name, repo, max_batch in [("shipped", DEFAULT_REPOSITORY, None), ("4x2048", big, BIG_MAX_BATCH)]:
        if not args.only or args.only == name:
            for start in repository_starts(name, repo, max_batch, work, args):
                rows.append(start())
                save(rows)
    return rows


def repository_starts(name: str, repo: Path, max_batch, work: Path, args) -> list:
    """One repository's starts, in order: Triton cache empty, then warm (the first fills what the
    second reads), the image's, one front end, and with --compare-serial serial compiles."""
    triton_dir = work / f"triton_{name}"
    ready = functools.partial(ready_scenario, name, repo, max_batch)
    starts = [functools.partial(ready, triton_dir, work, args)] * 2
    if not args.no_image:
        starts.append(functools.partial(image_scenario, name, repo, max_batch, work, args))
    starts.append(functools.partial(ready, triton_dir, work, args, workers=1))
    if args.compare_serial:
        starts.append(functools.partial(ready, work / f"triton_{name}_serial", work, args, parallel=False))
    return starts


def main():
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="fusedserve-startup-"))
    big = big_repository(work)
    run = runs.Run("startup", args.out, gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                   note=args.note, torch=torch.__version__, device=args.device,
                   method="server process start to the first 200 on /v2/health/ready; tune cache empty unless "
                          "tune_cache says tuned; Triton cache empty (fresh TRITON_CACHE_DIR), warm (the one the "
                          "empty run left) or image (fusedserve precompile with no GPU visible)")
    if args.tuning:
        rows = tuning_rows(big, work, args)
    else:
        rows = ready_rows(big, work, args, lambda rows: run.save(rows, summary(rows), complete=False))
    run.save(rows, summary(rows), complete=True)
    log(f"appended the run to {run.path}")


if __name__ == "__main__":
    main()
