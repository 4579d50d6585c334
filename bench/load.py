"""Load benchmark of issue 22: fusedserve against its peers, alternated in one run.

Writes a model repository (the shipped ``digits``, 64-256-256-10, and ``wide``, a seeded MLP of four
2048-wide layers: float32 on a CPU, bfloat16 on CUDA), starts every server once on a loopback port
and keeps it up across rounds (bench/servers.py: fusedserve, the naive FastAPI app of bench/peers
under uvicorn with 1 and N workers, LitServe where it imports), checks they give the same answers,
then drives each in turn. A round runs every model x client count x server; the server order is
reversed every other round (A B C, C B A, ...) so drifting machine noise hits all alike. The load
comes from several processes (bench/loadgen.py), each run bounded by --duration and --max-requests.
Per run: req/s, p50/p90/p99, errors by status, CPU time per request of the server's whole process
tree (and of the load generator, the idle servers and the machine, which share the cores).
``--profile`` samples fusedserve with py-spy under 64 clients (its collapsed stacks kept in the run)
and times one request's stages. ``--protocol v2-binary`` sends KServe v2 infer requests with binary
tensors (tritonclient.http's default form) instead of JSON ``/infer``: a wide row's cost without
JSON, on the servers that speak v2. Appends the run to ``OUT/load.jsonl`` (``bench/runs.py``; OUT
defaults to bench/results): every run of a server as a row, each group's spread over rounds as the
summary (bench/load_report.py), issue 22's targets and the ratios; ``--plot PNG`` draws latency
against throughput.

    python bench/load.py --device cpu --clients 1 16 64 --profile   # the 2-core box, ~8 min
    python bench/load.py --device cuda --quick                      # a GPU host, ~4 min once warm
    python bench/load.py --replot bench/results/load.jsonl:5 --plot load.png   # a stored run's plot
    python bench/load.py --fusedserve-flags="--workers 4" --server 'mine=python -m mymod --port {port}'
    python bench/load.py --device cuda --models wide --clients 256 --devices cuda:0 all \\
        --servers fusedserve fusedserve_all   # a multi-GPU host: every GPU against one
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: bench, models and service import from the checkout

from bench import load_profile, load_report, runs  # noqa: E402
from bench.loadgen import LoadPool, default_procs  # noqa: E402
from bench.servers import ServerProcess, available, default_servers, parse_server, read_procs  # noqa: E402

WIDE = 2048  # width of every layer of the "wide" model


def parse_args(argv=None) -> argparse.Namespace:
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the servers run the models")
    p.add_argument("--models", nargs="+", default=["digits", "wide"], choices=["digits", "wide"])
    p.add_argument("--clients", type=int, nargs="+", help="client counts (default 1 16 64, cuda 1 64 256)")
    p.add_argument("--rounds", type=int, help="rounds, each server once per model and client count (default 3)")
    p.add_argument("--duration", type=float, help="seconds per run (default 5; --quick 2)")
    p.add_argument("--max-requests", type=int, default=2_000_000, help="request cap per run, over all clients")
    p.add_argument("--procs", type=int, default=default_procs(), help="load generator processes")
    p.add_argument("--naive-workers", type=int, help="uvicorn workers of the N-worker naive app (cpu: cores; cuda: 12)")
    p.add_argument("--fusedserve-flags", default="", help='extra flags for fusedserve, e.g. "--workers 4"')
    p.add_argument("--devices", nargs="+", help="fusedserve once per value of its --devices (cuda:0 all: one GPU "
                   "against every GPU); the first keeps the name fusedserve, the others fusedserve_<value>")
    p.add_argument("--server", action="append", default=[], metavar="NAME=COMMAND",
                   help="add or replace a server; {python} {port} {repo} {device} are filled in")
    p.add_argument("--servers", nargs="+", help="only these servers (default: all; LitServe where installed)")
    p.add_argument("--ours", default="fusedserve", help="the server the targets and ratios are about")
    p.add_argument("--rows", type=int, default=1, help="rows per request")
    p.add_argument("--protocol", default="json", choices=list(PROTOCOLS),
                   help="json: POST /infer; v2-binary: KServe v2 infer with binary tensors both ways, as "
                        "tritonclient.http sends them (only servers that speak it)")
    p.add_argument("--quick", action="store_true", help="2 rounds of 2 s (cpu 1 64, cuda 1 64 256), within --budget-s")
    p.add_argument("--budget-s", type=float, help="start no run after this many seconds of runs (--quick: 150)")
    p.add_argument("--profile", action="store_true",
                   help="py-spy on --ours under load (by process), and a request's stages")
    p.add_argument("--profile-clients", type=int, nargs="+", default=[1, 64], help="client counts --profile samples")
    p.add_argument("--profile-model", default="digits", choices=["digits", "wide"], help="the model --profile drives")
    p.add_argument("--ready-timeout", type=float, default=400.0, help="seconds a server may take to warm up")
    p.add_argument("--replot", metavar="RUN", help="only draw --plot from a stored run, FILE.jsonl:LINE")
    runs.arguments(p)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.clients = args.clients or ([1, 64, 256] if cuda else [1, 64] if args.quick else [1, 16, 64])
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.duration = args.duration or (2.0 if args.quick else 5.0)
    args.budget_s = args.budget_s or (150.0 if args.quick else None)
    args.naive_workers = args.naive_workers or (12 if cuda else cores)
    return args


def write_repository(root: Path, device: str) -> Path:
    """The shipped digits plus the seeded wide model, in a fresh repository folder."""
    import torch

    from fusedserve import models

    shutil.copytree(Path(models.DEFAULT_REPOSITORY) / "digits", root / "digits")
    dtype = "float32" if device == "cpu" else "bfloat16"
    torch.manual_seed(0)
    models.save_model(models.MLP(models.MLPConfig(WIDE, (WIDE, WIDE, WIDE), WIDE, dtype=dtype)), root / "wide")
    return root


@dataclass(frozen=True)
class Traffic:
    """What the clients send to one model: 64 seeded bodies in turn, to ``path`` (None: the server's
    own JSON route) with ``headers``."""

    bodies: list[bytes]
    path: str | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def path_of(self, spec) -> str:
        return self.path or spec.infer_path


def _json_traffic(model: str, rows: list[np.ndarray]) -> Traffic:
    return Traffic([json.dumps({"model": model, "inputs": x.tolist()}).encode() for x in rows])


def _v2_binary_traffic(model: str, rows: list[np.ndarray]) -> Traffic:
    """KServe v2 infer, the input as raw float32 after a JSON header and the output asked for as raw
    bytes too (the binary-tensor extension, tritonclient.http's default)."""
    from fusedserve.service.tensors import INPUT, OUTPUT

    shape = list(rows[0].shape)
    head = json.dumps({"inputs": [{"name": INPUT, "shape": shape, "datatype": "FP32",
                                   "parameters": {"binary_data_size": 4 * rows[0].size}}],
                       "outputs": [{"name": OUTPUT, "parameters": {"binary_data": True}}]}).encode()
    return Traffic([head + x.astype("<f4").tobytes() for x in rows], f"/v2/models/{model}/infer",
                   (("Content-Type", "application/octet-stream"), ("Inference-Header-Content-Length", str(len(head)))))


PROTOCOLS = {"json": _json_traffic, "v2-binary": _v2_binary_traffic}


def send(pool: LoadPool, server, traffic: Traffic, clients: int, seconds: float, max_requests: int, **kw) -> dict:
    """One load run of ``traffic`` against ``server`` (a ServerProcess)."""
    return pool.run(server.port, traffic.path_of(server.spec), traffic.bodies, clients, seconds, max_requests,
                    headers=traffic.headers, **kw)


def request_traffic(model: str, width: int, rows: int, protocol: str = "json") -> Traffic:
    """64 seeded requests of ``rows`` rows each; the clients send them in turn."""
    rng = np.random.default_rng(0)
    low, high = (0.0, 16.0) if model == "digits" else (-1.0, 1.0)  # digits takes raw 0..16 pixel values
    return PROTOCOLS[protocol](model, [rng.uniform(low, high, size=(rows, width)).round(3) for _ in range(64)])


def post(url: str, body: bytes) -> dict:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def check_answers(servers: dict, bodies: list[bytes], ours: str) -> dict:
    """Max |difference| of every server's digits outputs from ours; a peer that disagrees is an error."""
    reference = [np.array(post(servers[ours].url + servers[ours].spec.infer_path, b)["outputs"]) for b in bodies]
    diffs = {}
    for name, s in servers.items():
        outs = [np.array(post(s.url + s.spec.infer_path, b)["outputs"]) for b in bodies]
        diffs[name] = float(max(np.abs(o - r).max() for o, r in zip(outs, reference, strict=True)))
        # float32 logits (|x| ~ 10) of one model: summation order alone moves them by ~1e-5, a wrong model by ~1.
        if not diffs[name] <= 1e-2:
            raise RuntimeError(f"{name} answers digits differently from {ours}: max |diff| {diffs[name]}")
    return diffs


def cpu_times() -> np.ndarray:
    """The machine's CPU ticks (user nice system idle iowait irq softirq steal) from /proc/stat."""
    with open("/proc/stat") as f:
        return np.array([int(v) for v in f.readline().split()[1:9]], dtype=np.float64)


def busy_fraction(seconds: float) -> float:
    """How busy the machine's CPUs are over ``seconds`` (before the servers start: is it quiet?)."""
    t0 = cpu_times()
    time.sleep(seconds)
    ticks = cpu_times() - t0
    return round(1 - (ticks[3] + ticks[4]) / max(ticks.sum(), 1), 3)


def measure(pool: LoadPool, servers: dict, name: str, traffic: Traffic, clients: int, args) -> dict:
    """One run against ``name``. CPU seconds of its process tree, of the other (idle) servers, of the
    load generator, and of the rest of the machine (``foreign_cpu_s``: anything else that ran)."""
    s = servers[name]
    s.resume()
    procs0, machine0, own0 = read_procs(), cpu_times(), time.process_time()
    run = send(pool, s, traffic, clients, args.duration, args.max_requests)
    procs1, machine1, own1 = read_procs(), cpu_times(), time.process_time()
    s.pause()
    mine = s.cpu_seconds(procs1) - s.cpu_seconds(procs0)
    idle = sum(o.cpu_seconds(procs1) - o.cpu_seconds(procs0) for n, o in servers.items() if n != name)
    ticks = machine1 - machine0
    busy_s = (ticks.sum() - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    per_request = 1e3 / max(run["requests"], 1)
    run.update(server_cpu_s=round(mine, 3), server_cpu_ms_per_request=round(mine * per_request, 4),
               client_cpu_ms_per_request=round(run["client_cpu_s"] * per_request, 4),
               other_servers_cpu_s=round(idle, 3),
               foreign_cpu_s=round(busy_s - mine - idle - run["client_cpu_s"] - (own1 - own0), 3),
               machine_busy=round(1 - (ticks[3] + ticks[4]) / max(ticks.sum(), 1), 3),
               machine_steal=round(ticks[7] / max(ticks.sum(), 1), 3),
               server_cores_by_process=s.cpu_by_process(procs0, procs1, run["seconds"]))
    return run


def rounds(pool: LoadPool, servers: dict, traffic: dict, args, started: float) -> tuple[list[dict], bool]:
    """Every round: each model x client count x server, the order of servers reversed every other round.
    Returns the runs and whether --budget-s cut them short."""
    runs, names = [], list(servers)
    for r in range(args.rounds):
        for model in args.models:
            for clients in args.clients:
                for name in names if r % 2 == 0 else names[::-1]:
                    if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                        return runs, True
                    run = measure(pool, servers, name, traffic[model], clients, args)
                    run.update(round=r, model=model, clients=clients, server=name)
                    runs.append(run)
                    print(f"round {r} {model:6s} {clients:4d} clients {name:20s} {run['rps']:9.0f} req/s "
                          f"p50 {run['p50_ms']} p99 {run['p99_ms']} ms, server CPU "
                          f"{run['server_cpu_ms_per_request']} ms/req, errors {run['errors']}", flush=True)
    return runs, False


def warm(pool: LoadPool, servers: dict, traffic: dict, args) -> None:
    """An untimed second per server and model at the most clients: first traffic (page faults, lazy
    set-up) skews no run."""
    for s in servers.values():
        for model in args.models:
            send(pool, s, traffic[model], max(args.clients), 1.0, args.max_requests)
        s.pause()


def profile(pool: LoadPool, servers: dict, traffic: dict, args, work: Path) -> dict:
    """Our server under 1 and 64 digits clients (untimed runs): CPU by thread, and py-spy's samples
    where it is installed (the collapsed stacks kept in the run, for a flame graph)."""
    if args.ours not in servers:
        return {"skipped": f"{args.ours} is not among the servers"}
    s, seconds, found = servers[args.ours], max(args.duration, 5.0), {}
    s.resume()
    for clients in args.profile_clients:
        spy = None
        out = work / f"pyspy_{clients}c.txt"
        if load_profile.py_spy() is not None:
            spy = load_profile.record(s.proc.pid, seconds, out)
            time.sleep(0.5)  # py-spy attaches
        pids = s.pids()
        before = load_profile.thread_ticks(pids)
        run = send(pool, s, traffic[args.profile_model], clients, seconds, args.max_requests, lead_s=0.2)
        split = load_profile.thread_split(before, load_profile.thread_ticks(pids), s.proc.pid)
        found[clients] = {"rps": run["rps"], "cpu_ms_per_request_by_thread": {
            k: round(v * 1e3 / max(run["requests"], 1), 4) for k, v in split.items()}}
        if spy is None:
            found[clients]["py_spy"] = "not installed (pip install py-spy)"
            continue
        log = spy.communicate(timeout=seconds + 60)[0].decode(errors="replace")
        if spy.returncode != 0 or not out.exists():
            found[clients]["py_spy"] = f"py-spy exited {spy.returncode}: {log[-1000:]}"
            continue
        text = out.read_text()
        stacks = load_profile.parse_stacks(text)
        found[clients]["by_process"] = load_profile.summarize_by_process(text)
        found[clients].update(**load_profile.summarize_stacks(stacks),  # the stacks without the process frame
                              stacks="".join(f"{';'.join(k)} {n}\n" for k, n in stacks.most_common()))
    return {"server": args.ours, "model": args.profile_model, "seconds": seconds, "by_clients": found}


def specs(args) -> tuple[dict, dict]:
    """The servers to run and those skipped (with why)."""
    all_specs = default_servers(args.naive_workers, args.fusedserve_flags.split(), args.devices)
    for text in args.server:
        spec = parse_server(text)
        all_specs[spec.name] = spec
    chosen = {n: s for n, s in all_specs.items() if args.servers is None or n in args.servers}
    skipped = {n: f"{s.needs} does not import" for n, s in chosen.items() if not available(s)}
    skipped.update({n: f"speaks no {args.protocol}" for n, s in chosen.items()
                    if n not in skipped and args.protocol not in s.protocols})
    return {n: s for n, s in chosen.items() if n not in skipped}, skipped


def start(chosen: dict, args, repo: Path, work: Path) -> dict:
    """Starts every server at once (their warm-ups overlap), then waits for each to be ready."""
    servers = {}
    try:
        for name, spec in chosen.items():
            servers[name] = ServerProcess(spec, args.device, repo, work)
        for s in servers.values():
            s.wait_ready(args.ready_timeout)
    except BaseException:
        stop(servers)
        raise
    return servers


def stop(servers: dict) -> None:
    for s in servers.values():
        s.stop()


def machine(args) -> dict:
    from importlib import metadata

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    gpu = None
    if args.device == "cuda" and shutil.which("nvidia-smi"):
        gpu = os.popen("nvidia-smi --query-gpu=name --format=csv,noheader").read().strip().splitlines()[0]
    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "gpu": gpu,
            "python": platform.python_version(),
            "versions": {d: version(d) for d in ("torch", "triton", "fastapi", "uvicorn", "litserve", "uvloop")}}


def benchmark(args, work: Path, started: float) -> dict:
    chosen, skipped = specs(args)
    for name, why in skipped.items():
        print(f"skipping {name}: {why}")
    quiet = busy_fraction(2.0)
    if quiet > 0.15:  # other work on the machine shares the cores with the servers and the load
        print(f"warning: the CPUs are {quiet:.0%} busy before the benchmark starts", flush=True)
    repo = write_repository(work / "repo", args.device)
    widths = {"digits": 64, "wide": WIDE}
    traffic = {m: request_traffic(m, widths[m], args.rows, args.protocol) for m in {*args.models, args.profile_model}}
    servers = start(chosen, args, repo, work)
    try:
        print(f"{len(servers)} servers ready after {time.monotonic() - started:.0f} s: {', '.join(servers)}",
              flush=True)
        agree = check_answers(servers, request_traffic("digits", 64, 1).bodies[:4],
                              args.ours if args.ours in servers else next(iter(servers)))
        with LoadPool(args.procs) as pool:
            warm(pool, servers, traffic, args)
            t0 = time.monotonic()
            runs, cut = rounds(pool, servers, traffic, args, t0)
            runs_s = time.monotonic() - t0
            prof = profile(pool, servers, traffic, args, work) if args.profile else None
        argv = {n: s.argv for n, s in servers.items()}
    finally:
        stop(servers)
    return {"servers": argv, "skipped": skipped, "machine_busy_before": quiet, "answers_max_abs_diff": agree,
            "runs": runs, "cut_short": cut, "runs_s": round(runs_s, 1), "profile": prof}


def portable(text: str) -> str:
    """``text`` without this machine's paths: the interpreter reads ``python``, the checkout ``.``."""
    return text.replace(json.dumps(sys.executable)[1:-1], "python").replace(json.dumps(str(ROOT))[1:-1], ".")


def title(report: dict) -> str:
    """The plot's title: what was sent, and where."""
    config, machine = report["config"], report["machine"]
    route = "/infer" if config["protocol"] == "json" else "KServe v2 infer, binary tensors"
    return (f"{route}, {config['rows']} row(s)/request, {report['device']} on {machine['host']} "
            f"({machine['cores']} cores)")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.replot:
        report = runs.pick(args.replot)
        load_report.plot(report["summary"], args.plot or Path("load.png"), title(report))
        return
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="fusedserve_load_"))  # the repository and the servers' logs
    try:
        result = benchmark(args, work, started)
    finally:
        shutil.rmtree(work)
    measured = result.pop("runs")
    summary = load_report.summarize(measured)
    naive_one, naive_many = "naive_fastapi_1w", f"naive_fastapi_{args.naive_workers}w"
    p50s = [r["p50_ms"] for r in measured if (r["model"], r["clients"], r["server"]) == ("digits", 1, args.ours)]
    if args.profile and args.ours == "fusedserve":  # in this process: after the servers, on quiet cores
        digits = request_traffic("digits", 64, 1).bodies[0]
        result["profile"]["stages_us"] = load_profile.stages(args.device, digits, np.median(p50s) if p50s else None,
                                                             reps=1000)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "plot", "replot", "note")}
    report = {"machine": machine(args), "device": args.device, "config": config,
              "wall_s": round(time.monotonic() - started, 1), "ratios": load_report.ratios(summary, args.ours),
              "targets": load_report.evaluate(summary, args.device, args.ours, naive_one, naive_many), **result}
    # Neither this machine's interpreter nor its checkout's path goes into the results.
    measured, summary, report = json.loads(portable(json.dumps([measured, summary, report])))
    run = runs.Run("load", args.out, gpu=report["machine"]["gpu"], quick=args.quick, note=args.note, **report)
    run.save(measured, summary)
    print("\n".join(load_report.format_targets(report["targets"])))
    print(f"appended the run to {run.path}")
    if args.plot and not load_report.plot(summary, args.plot, title({**report, "config": config})):
        print("no plot: matplotlib is missing")


if __name__ == "__main__":
    main()
