"""bench/runs.py: one appended line per run, rewritten in place while the run goes; a run named by its
line; a GPU host's lines and log brought into bench/results."""

import json

import pytest

from bench import runs


def test_a_run_is_one_line_rewritten_in_place_and_the_next_run_appends(tmp_path):
    first = runs.Run("kernels", tmp_path, gpu="NVIDIA H200", quick=True, note="a")
    first.save([{"M": 1}], None, complete=False)
    first.save([{"M": 1}, {"M": 2}], {"met": True}, complete=True)
    second = runs.Run("kernels", tmp_path, gpu=None, seed=7)
    second.save([], None)
    lines = runs.read(tmp_path / "kernels.jsonl")
    assert len(lines) == 2 and list(lines[0])[:8] == list(runs.HEAD)
    assert (lines[0]["rows"], lines[0]["summary"], lines[0]["complete"], lines[0]["note"]) == (
        [{"M": 1}, {"M": 2}], {"met": True}, True, "a")
    assert (lines[1]["gpu"], lines[1]["seed"], lines[1]["quick"]) == (None, 7, None) and "note" not in lines[1]
    assert lines[0]["date"].endswith("+00:00")


def test_a_line_appended_by_another_writer_is_never_overwritten(tmp_path):
    path = tmp_path / "load.jsonl"
    path.write_text('{"benchmark": "load", "cut": tru')  # a writer killed mid-line
    run = runs.Run("load", tmp_path, gpu=None)
    run.save([1])
    with open(path, "a") as f:
        f.write(json.dumps({"benchmark": "load", "other": True}) + "\n")
    run.save([1, 2])  # no longer the file's last line: appended anew, the other writer's kept
    text = path.read_text().splitlines()
    assert text[0] == '{"benchmark": "load", "cut": tru'
    assert [json.loads(t).get("rows") for t in text[1:]] == [[1], None, [1, 2]]


def test_commit_is_the_environments_else_gits(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDSERVE_COMMIT", "abc1234")
    assert runs.commit() == "abc1234"  # a GPU host's copy may carry a .git of another commit
    monkeypatch.delenv("FUSEDSERVE_COMMIT")
    found = runs.commit()  # git's in a checkout, None in a copy without .git
    assert found is None or len(found.removesuffix("-dirty")) >= 7
    monkeypatch.setattr(runs, "ROOT", tmp_path)  # no git there
    assert runs.commit() is None


def test_pick_names_a_line_the_last_one_or_a_json_file(tmp_path):
    path = tmp_path / "model.jsonl"
    path.write_text("".join(json.dumps({"n": n}) + "\n" for n in (1, 2, 3)))
    assert runs.pick(f"{path}:2") == {"n": 2} and runs.pick(path) == {"n": 3}
    with pytest.raises(ValueError, match="has 3 lines, not 4"):
        runs.pick(f"{path}:4")
    (tmp_path / "old.json").write_text('{"rows": []}')
    assert runs.pick(tmp_path / "old.json") == {"rows": []}


LOG = """=== commit 1a2b3c4
=== env (2026-12-07T10:00:01Z, limit 60s): bash -c nvidia-smi ...
name, driver_version, clocks.max.sm [MHz]
NVIDIA H100 80GB HBM3, 580.159.04, 1980 MHz
=== env: rc=0 in 7 s
=== kernels (2026-12-07T10:00:08Z, limit 260s): python3 bench/kernels.py --quick
=== kernels: rc=124 in 260 s
"""


def test_a_gpu_check_log_becomes_a_line_of_its_stages(tmp_path):
    (tmp_path / "gpu_check.log").write_text(LOG)
    line = runs.log_line(tmp_path / "gpu_check.log")
    assert (line["gpu"], line["commit"], line["date"]) == ("NVIDIA H100 80GB HBM3", "1a2b3c4",
                                                           "2026-12-07T10:00:01+00:00")
    assert line["rows"] == [dict(stage="env", rc=0, seconds=7), dict(stage="kernels", rc=124, seconds=260)]
    assert line["summary"] == {"stages": 2, "failed": ["kernels"]} and line["log"] == LOG


def test_add_brings_a_hosts_lines_and_log_in_once(tmp_path, capsys):
    host, results = tmp_path / "out", tmp_path / "results"
    host.mkdir()
    results.mkdir()
    (results / "kernels.jsonl").write_text(json.dumps({"benchmark": "kernels", "n": 0}) + "\n")
    runs.Run("kernels", host, gpu="g").save([1])
    runs.Run("startup", host, gpu="g").save([2])
    (host / "gpu_check.log").write_text(LOG)
    assert runs.add([host], results) == 3
    assert runs.add([host], results) == 0  # nothing twice
    assert [r.get("rows") for r in runs.read(results / "kernels.jsonl")] == [None, [1]]
    assert runs.read(results / "gpu_check.jsonl")[0]["summary"]["failed"] == ["kernels"]
    assert "kernels.jsonl:2" in capsys.readouterr().out
