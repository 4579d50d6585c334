"""The GPU suite's record: the tree hashes it names are git's, and CI's check says whether the
record is of the code it tests."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools import gpu_record  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_tree_hash_is_gits_and_ignores_bytecode(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg" / "sub").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    (repo / "pkg" / "sub" / "b.py").write_text("y = 2\n")
    (repo / "pkg" / "run.sh").write_text("echo\n")
    (repo / "pkg" / "run.sh").chmod(0o755)
    for cmd in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"]):
        _git(*cmd, cwd=repo)
    (repo / "pkg" / "__pycache__").mkdir()  # what a test run leaves behind
    (repo / "pkg" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0")
    assert gpu_record.tree_hash(repo / "pkg") == _git("rev-parse", "HEAD:pkg", cwd=repo)
    (repo / "pkg" / "a.py").write_text("x = 2\n")
    assert gpu_record.tree_hash(repo / "pkg") != _git("rev-parse", "HEAD:pkg", cwd=repo)


def _record(trees, parts):
    return {"trees": trees, "gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "date": "2026-12-05",
            "parts": parts}


def test_check_says_whether_the_record_is_of_this_code(tmp_path, capsys):
    here = {t: gpu_record._committed_tree(t) for t in gpu_record.TREES}
    path = tmp_path / "record.json"
    path.write_text(json.dumps(_record(here, {"kernels": "900 passed in 400s"})))
    assert gpu_record.check(path) and "matches" in capsys.readouterr().out
    path.write_text(json.dumps(_record(dict(here, models="0" * 40), {"kernels": "900 passed"})))
    assert not gpu_record.check(path) and "OUT OF DATE for models" in capsys.readouterr().out
    assert not gpu_record.check(tmp_path / "none.json") and "no GPU run" in capsys.readouterr().out


def test_parts_merge_only_when_they_ran_on_one_version(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_record({"kernels": "1", "models": "2"}, {"kernels": "10 passed"})))
    b.write_text(json.dumps(_record({"kernels": "1", "models": "2"}, {"rest": "20 passed"})))
    merged = gpu_record.merge(tmp_path / "m.json", [a, b])
    assert merged["parts"] == {"kernels": "10 passed", "rest": "20 passed"}
    b.write_text(json.dumps(_record({"kernels": "1", "models": "3"}, {"rest": "20 passed"})))
    with pytest.raises(SystemExit, match="different code"):
        gpu_record.merge(tmp_path / "m.json", [a, b])


def test_summary_is_pytests_last_line(tmp_path):
    log = tmp_path / "log"
    log.write_text("collected\n...\n==== 5 passed, 2 skipped in 3.0s ====\n")
    assert gpu_record._summary(log) == "5 passed, 2 skipped in 3.0s"
    log.write_text("ImportError: nope\n")
    assert "no pytest summary" in gpu_record._summary(log)
