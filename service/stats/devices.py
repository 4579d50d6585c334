"""The stats of several engines (one per device, ``--devices``) as one answer, built in a front end:
per device (each engine's own answer, under ``by_device``) and in total (the answer one engine would
give had it served every request). Totals add counts and sums, and take percentiles over every
engine's recent samples (``ServiceStats.merged``). In /metrics each engine's samples carry a
``device`` label; a total is a ``sum without (device)`` away."""

from __future__ import annotations

from collections.abc import Mapping

from fusedserve.service.engine.state import ModelInfo
from fusedserve.service.stats.model_stats import build
from fusedserve.service.stats.service_stats import ServiceStats

# A bucket's kernel choice in total: the least settled of the engines' (bench/servers.py waits for
# no "provisional" left).
_CHOICE_ORDER = ("provisional", "tuned", "fixed")


def with_label(line: str, name: str, value: str) -> str:
    """A sample line of the Prometheus text format with one more label ``name="value"``."""
    close = line.rfind("}")  # values never hold a brace, label values may: the last one closes the labels
    if close >= 0 and line.find("{") < close:
        return f'{line[:close]},{name}="{value}"{line[close:]}'
    metric, _, rest = line.partition(" ")
    return f'{metric}{{{name}="{value}"}} {rest}'


def merge_metrics(texts: Mapping[str, str]) -> str:
    """Several engines' expositions (text format, by device label) as one: each family once, with
    every engine's samples under it, each labelled ``device``."""
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for label, text in texts.items():
        family = ""
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line.split(" ", 3)[2]
                head = heads.setdefault(family, [])
                samples.setdefault(family, [])
                if len(head) < 2 and line not in head:
                    head.append(line)
            elif line and not line.startswith("#"):
                samples.setdefault(family, []).append(with_label(line, "device", label))
    out = [line for family in heads for line in (*heads[family], *samples[family])]
    out += [line for family in samples if family not in heads for line in samples[family]]
    return "\n".join(out) + "\n"


def _served(parts: Mapping[str, dict]) -> dict:
    """Each model's ``served`` entry in total: the first engine's, with every engine's device, the least
    settled choice per bucket and the slowest warm-up per phase."""
    total: dict[str, dict] = {}
    for part in parts.values():
        for name, info in part["served"].items():
            row = total.get(name)
            if row is None:
                total[name] = {**info, "choices": dict(info.get("choices", {})),
                               "startup_s": dict(info.get("startup_s", {}))}
                continue
            row["device"] += "," + info["device"]
            for bucket, choice in info.get("choices", {}).items():
                mine = row["choices"].get(bucket, choice)
                row["choices"][bucket] = min(mine, choice, key=lambda c: _CHOICE_ORDER.index(c)
                                             if c in _CHOICE_ORDER else len(_CHOICE_ORDER))
            for phase, seconds in info.get("startup_s", {}).items():
                row["startup_s"][phase] = max(row["startup_s"].get(phase, 0.0), seconds)
    return total


def merge_kernel_stats(parts: Mapping[str, dict], exports: Mapping[str, dict]) -> dict:
    """/kernel-stats of several engines: ``parts`` their answers, ``exports`` their ``ServiceStats.export``."""
    total = ServiceStats.merged(list(exports.values())).snapshot()
    total["served"] = _served(parts)
    mixed: dict[str, int] = {}
    for part in parts.values():
        for name, count in part["processes"]["batches_with_rows_from_several_front_ends"].items():
            mixed[name] = mixed.get(name, 0) + count
    total["processes"] = {
        "front_ends_connected": max(p["processes"]["front_ends_connected"] for p in parts.values()),
        "batches_with_rows_from_several_front_ends": mixed, "engines": len(parts)}
    total["by_device"] = dict(parts)
    return total


def merge_model_stats(parts: Mapping[str, dict], exports: Mapping[str, dict]) -> dict:
    """/model-stats of several engines: ``parts`` their answers, ``exports`` their ``ServiceStats.export``.
    A model's total row names every device that serves it (``cuda:0,cuda:1``)."""
    models: dict[str, ModelInfo] = {}
    queued: dict[str, int] = {}
    devices: dict = {}
    for part in parts.values():
        devices.update(part["devices"])
        for name, row in part["models"].items():
            queued[name] = queued.get(name, 0) + row["queued_rows"]
            info = models.get(name)
            device = row["device"] if info is None else f"{info.device},{row['device']}"
            models[name] = ModelInfo(name, row["in_features"], row["out_features"], row["dtype"], row["backend"],
                                     device)
    total = build(ServiceStats.merged(list(exports.values())).snapshot(), models, queued, devices)
    total["by_device"] = dict(parts)
    return total


def merge_counts(counts: list[dict]) -> dict:
    """``ServiceStats.model_counts`` of one model summed over engines (the v2 statistics route)."""
    total: dict = {"batch_sizes": {}}
    for part in counts:
        for key, value in part.items():
            if key == "batch_sizes":
                for size, n in value.items():
                    total["batch_sizes"][size] = total["batch_sizes"].get(size, 0) + n
            elif key == "last_inference_ms":
                total[key] = max(total.get(key, 0), value)
            else:
                total[key] = total.get(key, 0) + value
    return total
