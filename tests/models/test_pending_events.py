"""PendingEvents (the runner's asynchronous CUDA-event timings), driven by stand-in events."""

from fusedserve.models.timing import LayerTiming, PendingEvents


class FakeEvent:
    """Records like a CUDA event: done once the 'GPU' passes it, elapsed time in milliseconds."""

    def __init__(self, at_ms):
        self.at_ms = at_ms
        self.done = False
        self.waited = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = True
        self.done = True

    def elapsed_time(self, end):
        return end.at_ms - self.at_ms


def timing(layer):
    return LayerTiming(model="m", layer=layer, rows=3, M=4, N=70, K=17, dtype="float32",
                       backend="triton", kernel="k", config="c", seconds=0.0)


def add(pending, layer, start_ms, end_ms):
    start, end = FakeEvent(start_ms), FakeEvent(end_ms)
    pending.add(timing(layer), start, end)
    return end


def test_ready_resolves_finished_launches_in_order_and_stops_at_the_first_pending():
    pending = PendingEvents()
    first = add(pending, "layers.0", 0.0, 0.5)
    second = add(pending, "layers.1", 0.5, 2.0)
    add(pending, "layers.2", 2.0, 2.25)
    assert pending.ready() == [] and len(pending) == 3
    first.done = second.done = True
    done = pending.ready()
    assert [(t.layer, t.seconds) for t in done] == [("layers.0", 0.5e-3), ("layers.1", 1.5e-3)]
    assert len(pending) == 1


def test_drain_waits_for_everything():
    pending = PendingEvents()
    ends = [add(pending, f"layers.{i}", i, i + 0.25) for i in range(3)]
    done = pending.drain()
    assert [t.seconds for t in done] == [0.25e-3] * 3
    assert all(end.waited for end in ends), "drain returned timings it did not wait for"
    assert len(pending) == 0 and pending.drain() == []
