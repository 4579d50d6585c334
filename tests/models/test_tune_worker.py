"""The tuning worker's command line and the folder through which processes compiling tuning candidates
ahead tell it which buckets are ready to time (``tune_worker.CompileProgress``), with a real worker."""

import queue
import subprocess
import threading
import time

import pytest
import torch

from fusedserve.models import MLP, MLPConfig, ModelRunner, tune_worker
from fusedserve.models.tune_worker import CompileProgress


def test_it_travels_as_one_argument():
    progress = CompileProgress("/some/dir:with colon", 8)
    again = CompileProgress.parse(str(progress))
    assert (again.directory, again.shares) == (progress.directory, 8)


@pytest.mark.parametrize("text", ["", "dir", "dir:", ":8", "dir:x"])
def test_a_bad_argument_says_what_it_should_be(text):
    with pytest.raises(ValueError, match="DIRECTORY:SHARES"):
        CompileProgress.parse(text)


def test_a_bucket_is_compiled_once_every_share_marked_it(tmp_path):
    progress = CompileProgress(tmp_path, 2)
    progress.mark(4, 0)
    assert not progress.compiled(4)
    progress.mark(4, 1)
    assert progress.compiled(4) and not progress.compiled(8)


def test_waiting_ends_when_the_compiling_ends_however_it_ended(tmp_path):
    progress = CompileProgress(tmp_path, 3)
    assert progress.wait(1, timeout_s=0.05) >= 0.05  # nothing marked: it gives up after the timeout
    progress.finish()  # (processes that died mark nothing more)
    assert progress.compiled(1) and progress.wait(1) < 0.05


def test_marks_after_the_tuner_removed_the_folder_are_dropped(tmp_path):
    progress = CompileProgress(tmp_path / "gone", 1)
    progress.mark(1, 0)
    progress.finish()
    assert not (tmp_path / "gone").exists()


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line.strip())


@pytest.mark.timeout(120)
def test_a_worker_times_each_bucket_only_once_its_kernels_are_compiled(tmp_path):
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_features=17, hidden_features=(70,), out_features=5), backend="torch", name="tiny")
    runner = ModelRunner(model.eval().requires_grad_(False), max_batch_size=2)
    progress = CompileProgress(tmp_path, 2)
    progress.mark(1, 0)
    progress.mark(1, 1)
    progress.mark(2, 0)  # share 1 has not compiled bucket 2 yet
    worker = subprocess.Popen(tune_worker.argv(runner, [1, 2], compiled=progress), stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(worker.stdout, lines), daemon=True).start()
    try:
        assert lines.get(timeout=90) == f"{tune_worker.TUNED} 1"
        with pytest.raises(queue.Empty):  # bucket 2 waits for its last share
            lines.get(timeout=1.5)
        marked = time.monotonic()
        progress.mark(2, 1)
        assert lines.get(timeout=30) == f"{tune_worker.TUNED} 2"
        assert time.monotonic() - marked < 10
        assert worker.wait(30) == 0
    finally:
        worker.kill()
