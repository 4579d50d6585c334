"""What ``save_model`` writes for others to read: files readable by every user (a server in a
container runs as another user), class labels beside the weights, and a permission problem named as
one when loading."""

import json
import os
import stat

import pytest

from fusedserve.models import MLP, MLPConfig, load_model, loading, save_model

CONFIG = MLPConfig(in_features=3, hidden_features=(4,), out_features=2)


def test_every_file_written_is_readable_by_others(tmp_path):
    model = MLP(CONFIG)
    model.labels = ("cat", "dog")
    directory = save_model(model, tmp_path / "m")
    for name in ("config.json", "model.safetensors", "labels.json"):
        assert stat.S_IMODE(os.stat(directory / name).st_mode) == 0o644, name


def test_labels_are_stored_and_loaded_with_the_model(tmp_path):
    model = MLP(CONFIG)
    model.labels = ("chat", "Hund")
    save_model(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "labels.json").read_text()) == ["chat", "Hund"]
    assert load_model(tmp_path / "m", device="cpu").labels == ("chat", "Hund")
    model.labels = ()
    save_model(model, tmp_path / "m")  # saved again without labels: the old ones must not stay
    assert load_model(tmp_path / "m", device="cpu").labels == ()


@pytest.mark.parametrize("labels, match", [
    ('["a"]', "has 1 labels but the model has 2 outputs"),
    ('{"0": "a"}', "JSON list of strings"),
    ('["a", 2]', "JSON list of strings"),
    ("[", "not valid JSON"),
])
def test_bad_labels_files_are_refused(tmp_path, labels, match):
    save_model(MLP(CONFIG), tmp_path / "m")
    (tmp_path / "m" / "labels.json").write_text(labels)
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path / "m", device="cpu")


def test_labels_that_do_not_fit_the_outputs_are_not_saved(tmp_path):
    model = MLP(CONFIG)
    model.labels = ("only one",)
    with pytest.raises(ValueError, match="one string per output"):
        save_model(model, tmp_path / "m")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "labels.json"])
def test_an_unreadable_file_is_named_as_a_permission_problem(tmp_path, monkeypatch, name):
    model = MLP(CONFIG)
    model.labels = ("a", "b")
    directory = save_model(model, tmp_path / "m")
    real = os.access
    # (Tests may run as root, whom no mode stops: the loader's question is answered "no" instead.)
    monkeypatch.setattr(loading.os, "access", lambda p, mode: real(p, mode) and os.fspath(p) != str(directory / name))
    with pytest.raises(PermissionError, match=rf"cannot read .*{name}: permission denied .*chmod 644"):
        load_model(directory, device="cpu")
