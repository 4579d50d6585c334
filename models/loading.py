"""Load and save model directories (``config.json`` + ``model.safetensors``) and repositories.

A model directory holds the ``MLPConfig`` as JSON and every tensor of the model (layer weights and
biases, the input normalization) in one safetensors file, and a classifier's class labels (a JSON list
of strings, one per output) where it has them. A repository is a folder of model directories; the
directory name is the model's name. Files are written readable by everyone (0644): a server in a
container runs as another user than the one who saved the model.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fusedserve.models.mlp import BACKENDS, MLP, MLPConfig

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
LABELS_FILE = "labels.json"
FILE_MODE = 0o644
DEFAULT_REPOSITORY = Path(__file__).parent / "repository"


def resolve_device(device=None) -> torch.device:
    """``None`` means CUDA when available, else CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device name (use 'cpu' or 'cuda')") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available; use 'cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {str(device)!r}")
    return device


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """``None`` means "triton" on CUDA and "torch" on CPU."""
    if backend is None:
        backend = "triton" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend 'triton' on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before starting, or use backend 'torch'"
        )
    return backend


def check_readable(path: Path) -> None:
    """PermissionError naming ``path``, its mode and owner when this process may not read it (the
    safetensors reader calls that "No such file or directory")."""
    if not os.access(path, os.R_OK):
        info = path.stat()
        raise PermissionError(f"cannot read {path}: permission denied (mode {info.st_mode & 0o777:04o}, owner uid "
                              f"{info.st_uid}, this process uid {os.geteuid()}); make it readable: chmod 644 {path}")


def read_config(directory: Path) -> MLPConfig:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"model config not found: {path} (a model directory needs "
                                f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    check_readable(path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    try:
        return MLPConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def read_tensors(directory: Path, model: MLP) -> dict[str, torch.Tensor]:
    """The safetensors file's tensors, checked against ``model``'s names and shapes."""
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"model weights not found: {path}")
    check_readable(path)
    try:
        tensors = load_file(path, device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"{path} does not match {CONFIG_FILE}: missing tensors {missing}, "
                         f"unexpected tensors {extra}")
    for name, want in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(got.shape)}, "
                             f"{CONFIG_FILE} implies {tuple(want.shape)}")
        if not got.is_floating_point():
            raise ValueError(f"{path}: tensor {name!r} has dtype {got.dtype}, expected floats")
        check_finite(got, name, path)
    return tensors


def check_finite(tensor: torch.Tensor, name: str, where) -> None:
    """ValueError naming ``name`` and its first bad element if ``tensor`` holds NaN or Infinity: such
    weights make every answer NaN (served as JSON nulls)."""
    bad = ~torch.isfinite(tensor)
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{where}: tensor {name!r} holds {int(bad.sum())} NaN or infinite value(s), first at "
                         f"{list(index)} ({tensor[index].item()}) in {tensor.dtype}; fix the weights")


def load_model(path, device=None, backend=None, name: str | None = None) -> MLP:
    """Load one model directory; returns the ``MLP`` in eval mode on ``device``.

    ``device``: None = CUDA if available else CPU. ``backend``: "triton" (default on CUDA) or
    "torch" (default on CPU); "triton" on CPU needs ``TRITON_INTERPRET=1``. ``name``: the model's
    name (default: the directory's; a version folder passes its model's).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory not found: {directory}")
    device = resolve_device(device)
    backend = resolve_backend(backend, device)
    config = read_config(directory)
    name = name or directory.name
    model = MLP(config, backend=backend, device="meta", name=name)
    tensors = read_tensors(directory, model)
    model = MLP(config, backend=backend, device=device, name=name)
    # Weights take the config's dtype; the normalization buffers stay float32 (see MLP). A float32
    # weight past float16's 65504 turns infinite there: refused like an infinite one.
    cast = {name: t.to(model.state_dict()[name].dtype) for name, t in tensors.items()}
    for name, t in cast.items():
        check_finite(t, name, f"{directory / WEIGHTS_FILE} (as {config.dtype})")
    model.load_state_dict(cast)
    model.labels = read_labels(directory, config.out_features)
    log.info("loaded model %r from %s: widths %s, %s, device %s, backend %s",
             model.name, directory, config.widths, config.dtype, device, backend)
    return model.eval().requires_grad_(False)


def read_labels(directory: Path, out_features: int) -> tuple[str, ...]:
    """The class labels of ``LABELS_FILE``, one per output; () when the model has none."""
    path = directory / LABELS_FILE
    if not path.is_file():
        return ()
    check_readable(path)
    try:
        labels = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(labels, list) or not all(isinstance(label, str) for label in labels):
        raise ValueError(f"{path} must be a JSON list of strings, one class label per output")
    if len(labels) != out_features:
        raise ValueError(f"{path} has {len(labels)} labels but the model has {out_features} outputs: one each")
    return tuple(labels)


def save_model(model: MLP, path) -> Path:
    """Write ``model`` as a model directory at ``path`` (created if needed); returns the path. Its
    ``labels``, if any, go in ``LABELS_FILE``."""
    if not isinstance(model, MLP):
        raise TypeError(f"model must be a models.MLP, got {type(model).__name__}")
    labels = list(model.labels)
    if labels and (len(labels) != model.config.out_features or not all(isinstance(x, str) for x in labels)):
        raise ValueError(f"model.labels must hold one string per output ({model.config.out_features}), got {labels}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    written = [WEIGHTS_FILE, CONFIG_FILE]
    if labels:
        (directory / LABELS_FILE).write_text(json.dumps(labels, indent=1, ensure_ascii=False) + "\n")
        written.append(LABELS_FILE)
    else:  # (a model saved there before may have left its labels)
        (directory / LABELS_FILE).unlink(missing_ok=True)
    for name in written:  # (safetensors writes its file 0600)
        os.chmod(directory / name, FILE_MODE)
    return directory


def load_repository(path=None, device=None, backend=None) -> dict[str, MLP]:
    """Load every model directory (a subfolder holding ``config.json``) of a repository folder.

    ``path`` None = the shipped ``DEFAULT_REPOSITORY``. Returns ``{name: model}`` sorted by name.
    """
    return {d.name: load_model(latest_version(d)[1], device=device, backend=backend, name=d.name)
            for d in model_directories(path)}


def is_version(name: str) -> bool:
    """Whether a folder's name is a version number: ASCII digits only ("²" and "٣" are digits to
    ``str.isdigit`` and ``int`` reads the latter, but neither is a version anyone wrote)."""
    return name.isascii() and name.isdigit()


def versions(directory: Path) -> dict[str, Path]:
    """A model directory's versions, as Triton lays them out: numbered subfolders (``<model>/2/``)
    each holding a model, or else the directory itself as version "1". Other subfolders holding a
    model, or named with other digits, are ignored with a warning."""
    numbered = {}
    for d in directory.iterdir():
        holds_model = (d / CONFIG_FILE).is_file()
        if is_version(d.name):
            if holds_model:
                numbered[d.name] = d
        elif d.is_dir() and (holds_model or d.name.isdigit()):
            log.warning("ignoring folder %r of model %r: a version folder is named with the digits 0-9 only",
                        d.name, directory.name)
    if numbered:
        return dict(sorted(numbered.items(), key=lambda item: int(item[0])))
    return {"1": directory} if (directory / CONFIG_FILE).is_file() else {}


def latest_version(directory: Path) -> tuple[str, Path]:
    """The highest version of a model directory and the folder that holds it (what is served)."""
    found = versions(directory)
    if not found:
        raise FileNotFoundError(f"model {directory.name!r} has no {CONFIG_FILE}, at its top or in a "
                                "numbered version folder")
    return next(reversed(found.items()))


def model_directories(path=None) -> list[Path]:
    """The model directories (subfolders holding a model or numbered versions of one) of a
    repository, sorted by name."""
    root = Path(DEFAULT_REPOSITORY if path is None else path)
    if not root.is_dir():
        raise FileNotFoundError(f"model repository not found: {root}")
    directories = sorted(d for d in root.iterdir() if d.is_dir() and versions(d))
    if not directories:
        raise ValueError(f"model repository {root} holds no model: expected subfolders with "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    return directories
