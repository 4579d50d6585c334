"""A runner's input and output staging: rows in, padded on the device, and outputs back to the host."""

from __future__ import annotations

import torch

# Padded output rows copied back with a batch rather than slicing them off: about what the host
# spends on one view, at pinned device-to-host bandwidth.
_PADDING_COPY_BYTES = 16 * 1024
# Padded bytes (in and out) a graph that copies the whole bucket may move for a batch, in place of the
# two copies it saves launching on the host.
_GRAPH_COPY_PADDING_BYTES = 16 * 1024


class Staging:
    """The preallocated device input ``[max_batch_size, in_features]`` float32 that batches are padded
    into, and on CUDA page-locked host buffers for the copies in and out (copies from or to pageable
    memory cost a driver bounce each).

    Contract: ``copy_out`` synchronizes the stream, so when the next ``copy_in`` writes the host
    staging buffer no copy still reads it, and whatever the batch recorded (events) is finished.
    Rows past a batch keep what an earlier batch left there: rows are independent, so padded rows
    are computed and dropped without changing real ones.

    A bucket's graph may hold the copies itself (``copy_in_captured``/``copy_out_captured`` inside its
    capture, the whole bucket each way): a batch then ``fill``s the pinned rows, replays, and ``take``s
    the answer, one launch where the staged way makes three.
    """

    def __init__(self, name: str, max_batch_size: int, in_features: int, out_features: int,
                 device: torch.device):
        self.name = name
        self.max_batch_size = max_batch_size
        self.in_features = in_features
        self.device = device
        self.input = torch.zeros(max_batch_size, in_features, device=device)
        self._host_in = self._host_out = None
        if device.type == "cuda":
            # Zeros: a graph that copies whole buckets reads rows no batch wrote yet.
            self._host_in = torch.zeros(max_batch_size, in_features, pin_memory=True)
            self._host_out = torch.empty(max_batch_size, out_features, pin_memory=True)
        # rows -> (host input, device input, host output) views of the first rows: made once, since
        # slicing per batch costs about a microsecond a view on the host's hot path.
        self._row_views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._row_bytes = 4 * out_features
        self._padding_rows = _GRAPH_COPY_PADDING_BYTES // (4 * (in_features + out_features))

    def check(self, x) -> int:
        """Rows of ``x`` once it is a float32 CPU ``[M, in_features]`` tensor with 1 to
        ``max_batch_size`` rows; TypeError or ValueError saying what is wrong otherwise."""
        shape = getattr(x, "shape", ())
        # Every batch passes here: the usual case in one test, the ones below to say what is wrong.
        if (type(x) is torch.Tensor and x.dtype is torch.float32 and x.is_cpu and len(shape) == 2
                and shape[1] == self.in_features and 1 <= shape[0] <= self.max_batch_size):
            return shape[0]
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.float32:
            raise TypeError(f"x must be float32, got {x.dtype}")
        if x.device.type != "cpu":
            raise ValueError(f"x must be a CPU tensor, got one on {x.device}")
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must have shape [M, {self.in_features}] for model {self.name!r}, "
                             f"got {list(x.shape)}")
        rows = x.shape[0]
        if not 1 <= rows <= self.max_batch_size:
            raise ValueError(f"x must have 1 to {self.max_batch_size} rows (max_batch_size), got {rows}")
        return rows

    def _views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        views = self._row_views.get(rows)
        if views is None:
            views = self._row_views[rows] = (self._host_in[:rows], self.input[:rows], self._host_out[:rows])
        return views

    def copy_in(self, x: torch.Tensor, rows: int) -> None:
        """``x`` (``[rows, in]``, checked) into the first rows of ``input``."""
        if self._host_in is None:
            self.input[:rows].copy_(x)
            return
        host, device, _ = self._views(rows)
        host.copy_(x)  # the previous copy_out synchronized, so no copy still reads the staging buffer
        device.copy_(host, non_blocking=True)

    def copy_out(self, out: torch.Tensor, rows: int) -> torch.Tensor:
        """The first ``rows`` of the device output ``out`` (``[bucket, out]``) as float32 on the CPU;
        on CUDA the stream is synchronized when this returns."""
        if self._host_out is None:
            return out[:rows].float().cpu()
        bucket = out.shape[0]
        # The whole bucket where its padded rows are a few bytes (no view of ``out`` to make per
        # batch); only the rows where the padding would cost more to copy than a view to make.
        if (bucket - rows) * self._row_bytes > _PADDING_COPY_BYTES:
            bucket, out = rows, out[:rows]
        # A blocking copy waits for the stream in C++ (cheaper than a Python synchronize).
        self._views(bucket)[2].copy_(out.float())
        return self._views(rows)[2].clone()  # the staging buffer is the next batch's

    def pads_cheaply(self, rows: int, bucket: int) -> bool:
        """Whether a graph copying the whole ``bucket`` in and out serves ``rows`` rows cheaply."""
        return bucket - rows <= self._padding_rows

    def copy_in_captured(self, bucket: int) -> None:
        """Inside a graph's capture: the first ``bucket`` pinned rows into ``input`` at each replay."""
        self.input[:bucket].copy_(self._host_in[:bucket], non_blocking=True)

    def copy_out_captured(self, out: torch.Tensor) -> None:
        """Inside a graph's capture: the float32 device output ``out`` ``[bucket, out]`` into the
        pinned output at each replay."""
        self._host_out[:out.shape[0]].copy_(out, non_blocking=True)

    def fill(self, x: torch.Tensor, rows: int) -> None:
        """``x`` (``[rows, in]``, checked) into the pinned rows a graph's ``copy_in_captured`` reads."""
        self._views(rows)[0].copy_(x)  # the previous batch synchronized: no copy still reads it

    def take(self, rows: int) -> torch.Tensor:
        """After a replay of a graph with its copies: waits for the stream, then the first ``rows``."""
        torch.cuda.current_stream(self.device).synchronize()
        return self._views(rows)[2].clone()  # the staging buffer is the next batch's
