"""What tests/deploy reads: the manifests under deploy/, kustomize's renderings of them, the Dockerfile."""

from __future__ import annotations

import functools
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="`kubectl kustomize` renders the kustomizations; kubectl is not installed")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def resource_files() -> list[Path]:
    """The files the kustomizations list as resources: complete objects, each valid on its own."""
    listed = {(k / r).resolve() for k in KUSTOMIZATIONS for r in load(k / "kustomization.yaml")[0].get("resources", [])}
    return sorted(p for p in listed if p.is_file())


@functools.cache
def render(directory: Path) -> tuple[dict, ...]:
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {rel(directory)}: {out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc is not None)


def one(docs, kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@functools.cache
def image() -> dict:
    """The final stage of the Dockerfile: its ENV as a dict, USER, and HEALTHCHECK's --start-period."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    last = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    env, user, start_period = {}, None, None
    for line in lines[last + 1:]:
        instruction, _, rest = line.partition(" ")
        if instruction == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(rest))
        elif instruction == "USER":
            user = rest.strip()
        elif instruction == "HEALTHCHECK":
            start_period = int(re.search(r"--start-period=(\d+)s", rest)[1])
    return {"env": env, "user": user, "start_period_s": start_period}
