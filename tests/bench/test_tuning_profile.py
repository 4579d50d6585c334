"""bench/tuning.py --profile: only the calls timed under the profiler count, and its dump and top
functions come out."""

import cProfile
import pstats

import pytest

from bench import tuning

pytestmark = pytest.mark.timeout(30)


def profiled_work():
    return sum(i * i for i in range(20_000))


def unprofiled_work():
    return sum(range(20_000))


def test_only_the_timed_calls_are_profiled_and_the_dump_names_them(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning.torch.cuda, "synchronize", lambda: None)  # no GPU here
    profiler, logged = cProfile.Profile(), []
    assert tuning.seconds_of(profiled_work, profiler) >= 0
    assert tuning.seconds_of(unprofiled_work) >= 0
    tuning.save_profile(profiler, tmp_path / "p.pstats", logged.append, top=5)
    names = {function for _, _, function in pstats.Stats(str(tmp_path / "p.pstats")).stats}
    assert "profiled_work" in names and "unprofiled_work" not in names
    assert len(logged) == 2 and "tottime" in logged[0] and "profiled_work" in logged[1]


def test_profile_without_ahead_is_refused_with_a_reason(capsys):
    with pytest.raises(SystemExit) as exit_:
        tuning.main(["--profile"])
    assert exit_.value.code == 2 and "pass --ahead too" in capsys.readouterr().err
