"""What bench/load.py makes of its runs: each group's spread over rounds, issue 22's targets, a plot.

A group is one (model, clients, server); its figures are the median over rounds, with the min and
max beside them (``spread_pct``: (max - min) / median of req/s). Targets compare medians of servers
measured in the same run, never figures from another run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FIGURES = ("rps", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "server_cpu_ms_per_request", "client_cpu_ms_per_request",
           "foreign_cpu_s", "machine_busy")


def _stats(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": round(float(np.median(values)), 3), "min": round(float(min(values)), 3),
            "max": round(float(max(values)), 3)}


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (model, clients, server) in the order first run: each figure's median/min/max."""
    keys = list(dict.fromkeys((r["model"], r["clients"], r["server"]) for r in runs))
    rows = []
    for model, clients, server in keys:
        group = [r for r in runs if (r["model"], r["clients"], r["server"]) == (model, clients, server)]
        row = {"model": model, "clients": clients, "server": server, "rounds": len(group),
               "errors": sum(r["errors"] for r in group)}
        row.update({f: _stats([r.get(f) for r in group]) for f in FIGURES})
        rps = row["rps"]
        row["spread_pct"] = (round(100 * (rps["max"] - rps["min"]) / rps["median"], 1)
                             if rps and rps["median"] else None)
        rows.append(row)
    return rows


def median_of(summary: list[dict], model: str, clients: int, server: str, figure: str) -> float | None:
    for row in summary:
        if (row["model"], row["clients"], row["server"]) == (model, clients, server) and row.get(figure):
            return row[figure]["median"]
    return None


# How a target's value must stand to its threshold.
_TESTS = {">=": lambda v, t: v >= t, "<": lambda v, t: v < t, "<=": lambda v, t: v <= t}


def _target(name: str, value: float | None, test: str, threshold: float | None, unit: str) -> dict:
    """A target's record; ``met`` is None where a figure it needs was not measured."""
    met = None if value is None or threshold is None else _TESTS[test](value, threshold)
    return {"target": name, "value": None if value is None else round(value, 3), "test": test,
            "threshold": threshold, "unit": unit, "met": met}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def cpu_box_targets(summary: list[dict], ours: str, naive: str) -> list[dict]:
    """The 2-core box: digits at 64 clients >= 2.0x the naive app's req/s with a lower p99; at 1
    client a p50 no higher than its."""
    def med(clients, server, figure):
        return median_of(summary, "digits", clients, server, figure)

    return [
        _target(f"digits, 64 clients: {ours} req/s over {naive}'s", _ratio(med(64, ours, "rps"), med(64, naive, "rps")),
                ">=", 2.0, "x"),
        _target(f"digits, 64 clients: {ours} p99 under {naive}'s", med(64, ours, "p99_ms"), "<",
                med(64, naive, "p99_ms"), "ms"),
        _target(f"digits, 1 client: {ours} p50 over {naive}'s", _ratio(med(1, ours, "p50_ms"), med(1, naive, "p50_ms")),
                "<=", 1.0, "x"),
    ]


def gpu_host_targets(summary: list[dict], ours: str, naive_many: str) -> list[dict]:
    """The GPU host, 256 clients: digits >= 50k req/s with p99 < 15 ms and >= 3x the N-worker naive
    app; the 4x2048 bf16 model >= 20k req/s."""
    def med(model, server, figure):
        return median_of(summary, model, 256, server, figure)

    return [
        _target(f"digits, 256 clients: {ours} req/s", med("digits", ours, "rps"), ">=", 50_000, "req/s"),
        _target(f"digits, 256 clients: {ours} p99", med("digits", ours, "p99_ms"), "<", 15.0, "ms"),
        _target(f"digits, 256 clients: {ours} req/s over {naive_many}'s",
                _ratio(med("digits", ours, "rps"), med("digits", naive_many, "rps")), ">=", 3.0, "x"),
        _target(f"wide (4x2048 bf16), 256 clients: {ours} req/s", med("wide", ours, "rps"), ">=", 20_000, "req/s"),
    ]


def evaluate(summary: list[dict], device: str, ours: str, naive_one: str, naive_many: str) -> list[dict]:
    """Issue 22's targets for the machine ``device`` says this is (cpu: the 2-core box; cuda: the GPU host)."""
    if device == "cpu":
        return cpu_box_targets(summary, ours, naive_one)
    return gpu_host_targets(summary, ours, naive_many)


def ratios(summary: list[dict], ours: str) -> list[dict]:
    """``ours`` against every other server, per model and client count: req/s and latency ratios."""
    rows, figures = [], ("rps", "mean_ms", "p50_ms", "p99_ms")
    for row in summary:
        if row["server"] == ours:
            continue
        mine = {f: median_of(summary, row["model"], row["clients"], ours, f) for f in figures}
        theirs = {f: (row[f] or {}).get("median") for f in figures}
        rows.append({"model": row["model"], "clients": row["clients"], "peer": row["server"],
                     **{f"{f}_ratio": None if r is None else round(r, 3)
                        for f, r in ((f, _ratio(mine[f], theirs[f])) for f in mine)}})
    return rows


def format_targets(targets: list[dict]) -> list[str]:
    words = {True: "MET ", False: "MISS", None: "N/A "}
    return [f"{words[t['met']]} {t['target']}: {t['value']} {t['unit']} (target {t['test']} {t['threshold']})"
            for t in targets]


def plot(summary: list[dict], path: Path, title: str) -> bool:
    """p50 and p99 against req/s (one line per server through its client counts) and server CPU per
    request, per model; False (no plot) where matplotlib is missing, as on a bare GPU host."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in summary))
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.5 * len(models)), squeeze=False)
    for (ax_lat, ax_cpu), model in zip(axes, models, strict=True):
        for k, server in enumerate(dict.fromkeys(r["server"] for r in summary if r["model"] == model)):
            rows = sorted((r for r in summary if (r["model"], r["server"]) == (model, server) and r["rps"]),
                          key=lambda r: r["clients"])
            color = f"C{k}"
            rps = [r["rps"]["median"] for r in rows]
            err = [[v - r["rps"]["min"] for v, r in zip(rps, rows, strict=True)],
                   [r["rps"]["max"] - v for v, r in zip(rps, rows, strict=True)]]
            ax_lat.errorbar(rps, [r["p99_ms"]["median"] for r in rows], xerr=err, marker="o", color=color,
                            label=f"{server} p99")
            ax_lat.plot(rps, [r["p50_ms"]["median"] for r in rows], ls=":", marker=".", color=color)
            for r, x in zip(rows, rps, strict=True):
                ax_lat.annotate(str(r["clients"]), (x, r["p99_ms"]["median"]), fontsize=7,
                                textcoords="offset points", xytext=(3, 3))
            cpu = [(r["clients"], r["server_cpu_ms_per_request"]["median"]) for r in rows
                   if r["server_cpu_ms_per_request"]]
            ax_cpu.plot(*zip(*cpu, strict=True), marker="o", color=color, label=server) if cpu else None
        ax_lat.set(xlabel="requests / s (median of rounds; bars: min-max)", ylabel="latency, ms (p99; dotted p50)",
                   title=f"{model}: latency against throughput (labels: clients)", yscale="log")
        ax_cpu.set(xlabel="concurrent keep-alive clients", ylabel="server CPU ms per request (all processes)",
                   title=f"{model}: server CPU per request", xscale="log")
        for ax in (ax_lat, ax_cpu):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
