"""Hands each layer timing from the runner to every sink (the stats object and the metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a front-end process of --workers N never imports torch (models/)
    from fusedserve.models.timing import LayerTiming, TimingSink


class LayerSinks:
    def __init__(self, sinks: tuple[TimingSink, ...]):
        self.sinks = sinks

    def record_layer(self, timing: LayerTiming) -> None:
        for sink in self.sinks:
            sink.record_layer(timing)
