"""Service settings: every field is a CLI flag and a ``FUSEDSERVE_<NAME>`` environment variable."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_workers(cores: int | None = None) -> int:
    """Front-end processes for ``cores`` CPUs (default: those this process may run on): one process up
    to 3 cores (on 2 cores a second front end and the engine process only compete for them), else
    half the cores, at most 8: the engine, its batch threads and the kernel's network work need the rest."""
    cores = cores if cores is not None else usable_cores()
    return 1 if cores <= 3 else min(cores // 2, 8)


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """CPUs this process may run on, capped by its cgroup's CPU quota (a container's CPU limit: a pod
    limited to 4 CPUs on a 64-core node must not start 8 front ends)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return max(1, min(cores, -(-int(quota) // int(period))))


def _shipped_repository() -> Path:
    # Found, not imported: importing fusedserve.models pulls in torch, which the supervisor and the
    # front ends of --workers N never need (models.loading.DEFAULT_REPOSITORY is the same folder).
    spec = importlib.util.find_spec("fusedserve.models")
    return Path(next(iter(spec.submodule_search_locations))) / "repository"


def _one_device(value: str) -> bool:
    """Whether ``value`` names one device: cpu, cuda or cuda:<index>."""
    return value in ("cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit())


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FUSEDSERVE_", protected_namespaces=())

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # KServe v2 gRPC on the same host (Triton's default port); 0 turns gRPC off.
    grpc_port: int = Field(8001, ge=0, le=65535)
    # Front-end processes; 1 serves everything in one process, N > 1 adds one engine process
    # (service.workers.supervisor). The default grows with the cores (docs/architecture.md, "Processes").
    workers: int = Field(default_factory=default_workers, ge=1)
    model_repository: Path = Field(default_factory=_shipped_repository)
    device: str = "auto"  # "auto", "cpu", "cuda" or "cuda:<index>"
    # One engine process per entry (service.workers.devices): "auto" (every visible GPU when device is
    # auto, else device alone), "all" (every visible GPU), or a list ("cuda:0,cuda:2"; "cpu,cpu" runs
    # two CPU engines that share the cores, for tests). Several engines start the supervisor.
    devices: str = "auto"
    backend: str = "auto"  # "auto", "triton" or "torch"
    max_batch_size: int = Field(64, ge=1)
    max_delay_ms: float = Field(2.0, ge=0.0)
    # Experiment: a filling batch also closes once no request arrived for this long (0: off).
    batch_quiet_ms: float = Field(0.0, ge=0.0)
    # Rows waiting in one model's queue before new requests get 503 + Retry-After.
    max_queue_rows: int = Field(4096, ge=1)
    # Whole-request deadline; a client's X-Request-Timeout-Ms header may only shorten it.
    request_timeout_ms: float = Field(30_000.0, gt=0.0)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1)
    # Rows one request may carry; None means max_batch_size, since a request is never split.
    max_rows_per_request: int | None = Field(None, ge=1)
    # Where batches run. None: a CPU model's batch runs on the event loop's thread when its row count
    # last took < 25 ms (torch then has every core to itself; next to request handling in a worker
    # thread its threads straggle: 4x2048 float32, ~11 ms batches, on the 2-core dev machine at 64
    # clients, ~980 -> ~1180 req/s), longer ones in the worker thread so probes and request parsing
    # never stall longer than that; a CUDA model's when it last took < 1 ms (a thread hand-off costs
    # ~0.15 ms). A number sets that threshold for every model; 0 = always the worker thread.
    inline_batch_ms: float | None = Field(None, ge=0.0)
    # torch intra-op threads for CPU models; 0 = torch's default (one per physical core).
    torch_threads: int = Field(0, ge=0)
    # After SIGTERM (readiness false, new connections refused): at most this long open connections
    # keep being answered; the process exits sooner once none is left (service.http.server).
    drain_grace_s: float = Field(2.0, ge=0.0)
    # A model that fails to load stops start-up (Triton's --exit-on-error); off, the others serve
    # and the failed one answers 503 saying why (model ready/metadata routes, /metrics).
    exit_on_error: bool = True
    # HTTP connections (service.http.connection): request line + headers over this many bytes get 431; a
    # request head or body not fully received in time gets 408; connections past the cap get 503
    # (0: 4096, or fewer under a lower open-file limit). gRPC (service.grpc.policy): the same cap,
    # counted apart (GOAWAY past it), each protocol within its share of the open-file limit; the
    # HTTP/2 preface and SETTINGS are due within header_timeout_s (clients send them in their first
    # write; grpc-go's 120 s also covers a TLS handshake), a request message within body_timeout_s
    # of its stream opening (DEADLINE_EXCEEDED), and a connection with no stream for
    # grpc_idle_timeout_s gets GOAWAY and is closed (0: never): a client calling every few minutes
    # keeps its connection; one a client leaked frees its slot in minutes, not Envoy's hour.
    max_header_bytes: int = Field(32 * 1024, ge=1024)
    header_timeout_s: float = Field(10.0, gt=0.0)
    body_timeout_s: float = Field(30.0, gt=0.0)
    max_connections: int = Field(0, ge=0)
    grpc_idle_timeout_s: float = Field(300.0, ge=0.0)
    # What one gRPC client may make its connection hold (service.grpc.h2_limits). Requests in flight (handlers
    # running, a stream's requests taken and not yet answered), per connection and per
    # ModelStreamInfer stream: at the cap the server stops reading the connection, or stops taking
    # the stream's messages (they then wait under HTTP/2 flow control), until some are answered;
    # 256 fills several batches from one connection without letting it crowd the queue, 128 leaves
    # a stream's neighbours room. Bytes written and unsent past grpc_write_buffer_bytes: reading
    # stops until they drain (1 MiB: Envoy's per_connection_buffer_limit_bytes); far past it the
    # client is cut off. Control frames (PING/SETTINGS ACKs, RST_STREAM) written and unsent past
    # grpc_max_queued_control_frames: GOAWAY ENHANCE_YOUR_CALM (nghttp2's max_outbound_ack and
    # Envoy's max_outbound_control_frames, both 1000).
    grpc_calls_per_connection: int = Field(256, ge=1)
    grpc_calls_per_stream: int = Field(128, ge=1)
    grpc_write_buffer_bytes: int = Field(1 << 20, ge=1 << 14)
    grpc_max_queued_control_frames: int = Field(1000, ge=1)
    # After the drain (or on SIGINT): how long requests still being read or answered get before the
    # process exits anyway.
    shutdown_timeout_s: float = Field(10.0, ge=0.0)
    # Security (service.security). api_key: every route but the probes needs "Authorization: Bearer
    # <key>"; admin_api_key: the admin routes (kernel-stats reset, model control) need it instead
    # (it opens every other route too; the API key never opens admin routes). allowed_hosts:
    # comma-separated Host names answered ("*.x" for subdomains, "local" for localhost and IP
    # addresses, "*" for any); empty = "local" when listening on loopback only, else "*".
    # docs: serve /docs, /redoc and /openapi.json.
    api_key: SecretStr | None = None
    admin_api_key: SecretStr | None = None
    allowed_hosts: str = ""
    docs: bool = True
    # Move start-up objects out of the garbage collector's scans once warm (see service.app).
    gc_freeze: bool = True
    # OpenTelemetry: a span per request, continuing its traceparent, exported over OTLP/HTTP to where
    # the standard OTEL_EXPORTER_OTLP_* variables say (service.tracing; the otel extra).
    tracing: bool = False
    # After ready, tune the buckets warmed on provisional kernel choices on a background thread and
    # swap each result in between batches (models.background); off: they keep the provisional ones.
    background_tuning: bool = True
    # How widely tuning searches (kernels.choosing.SEARCH_ENV): "near", the candidates that won at the
    # GPU's nearest measured shapes beside the vendor's GEMM; "full", every candidate (~5x longer).
    tuning_search: Literal["near", "full"] = "near"
    # Where warm-up finds Triton's cache cold, compile the provisional kernels of the remaining
    # buckets in worker processes at once (models.precompile); off: one after another in-process.
    parallel_compile: bool = True
    # --workers N: an engine process that answers no heartbeat this long (its event loop stopped or
    # wedged) makes the front ends answer 503 and turns readiness off; the supervisor kills and
    # restarts it at twice this. Loads, warm-up, compiles and long batches run off the engine's
    # event loop, which answers between them, and inline batches stop at ~25 ms: seconds of silence
    # mean a stopped loop, not a busy one, and 5 s leaves room for a starved 2-core machine. 0: off.
    engine_heartbeat_timeout_s: float = Field(5.0, ge=0.0)

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if value != "auto" and not _one_device(value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:<index>, got {value!r}")
        return value

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, value: str) -> str:
        if value in ("auto", "all"):
            return value
        entries = [entry.strip() for entry in value.split(",")]
        bad = [entry for entry in entries if not _one_device(entry)]
        if bad:
            raise ValueError(f"devices must be auto, all, or a comma-separated list of cpu, cuda and "
                             f"cuda:<index>; {bad[0]!r} is none of them (in {value!r})")
        gpus = [entry for entry in entries if entry != "cpu"]
        if len(set(gpus)) < len(gpus) or ("cuda" in gpus and "cuda:0" in gpus):
            raise ValueError(f"devices names a GPU twice ({value!r}): one engine per GPU")
        return ",".join(entries)

    @model_validator(mode="after")
    def _check_device_kinds(self) -> Settings:
        kind = self.device.split(":")[0]
        kinds = {entry.split(":")[0] for entry in self.devices.split(",")} - {"auto", "all"}
        if self.devices == "all":
            kinds = {"cuda"}
        if self.device != "auto" and kinds and kinds != {kind}:
            raise ValueError(f"device {self.device!r} and devices {self.devices!r} disagree: set devices "
                             "alone (each engine runs on its entry)")
        return self

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, value: str) -> str:
        if value not in ("auto", "triton", "torch"):
            raise ValueError(f"backend must be auto, triton or torch, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_queue(self) -> Settings:
        if self.max_queue_rows < self.max_batch_size:
            raise ValueError(f"max_queue_rows ({self.max_queue_rows}) must be >= max_batch_size "
                             f"({self.max_batch_size}): a full batch must fit in the queue")
        return self

    def handoff(self) -> str:
        """These settings as JSON for a child process, secrets included: ``model_dump_json`` writes
        every SecretStr as "**********", which would become the child's key."""
        data = self.model_dump(mode="json")
        data.update({name: value.get_secret_value() for name, value in self if isinstance(value, SecretStr)})
        return json.dumps(data)

    @classmethod
    def from_fd(cls, fd: int) -> Settings:
        """The settings a parent wrote with ``handoff`` into the pipe ``fd`` (read to its end, closed)."""
        with os.fdopen(fd, "rb") as pipe:
            return cls(**json.loads(pipe.read()))

    def inline_ms(self, device_type: str) -> float:
        """``inline_batch_ms`` resolved for a model on ``device_type`` ("cpu", "cuda")."""
        if self.inline_batch_ms is not None:
            return self.inline_batch_ms
        return 25.0 if device_type == "cpu" else 1.0

    @property
    def rows_per_request(self) -> int:
        limit = self.max_rows_per_request or self.max_batch_size
        return min(limit, self.max_batch_size)
