"""``fusedserve serve`` and ``python -m fusedserve serve``: flags override FUSEDSERVE_* environment variables."""

from __future__ import annotations

import argparse
import os

from fusedserve import __version__
from fusedserve.service.logs import FORMATS, configure, mark_start

LOG_LEVELS = ("debug", "info", "warning", "error")


def _on_off(text: str) -> bool:
    """A yes/no flag value: on/off, true/false, yes/no or 1/0."""
    value = text.strip().lower()
    if value not in ("on", "off", "true", "false", "yes", "no", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value in ("on", "true", "yes", "1")


# Flag name -> Settings field; a flag left unset keeps the environment's (or the default) value.
_FLAGS = {
    "--host": ("host", str, "interface to bind (default 127.0.0.1)"),
    "--port": ("port", int, "TCP port (default 8000)"),
    "--grpc-port": ("grpc_port", int, "KServe v2 gRPC port (default 8001); 0 turns gRPC off"),
    "--workers": ("workers", int, "front-end processes; > 1 adds one engine process (default: from the cores)"),
    "--model-repository": ("model_repository", str, "folder of model directories (default: shipped)"),
    "--device": ("device", str, "auto, cpu, cuda or cuda:<index>"),
    "--devices": ("devices", str, "one engine per device: auto (every GPU when --device is auto), all, "
                                  "or a list (cuda:0,cuda:2; cpu,cpu)"),
    "--backend": ("backend", str, "auto, triton or torch"),
    "--max-batch-size": ("max_batch_size", int, "rows per batch (default 64)"),
    "--max-delay-ms": ("max_delay_ms", float, "wait for a fuller batch behind a busy model (default 2)"),
    "--batch-quiet-ms": ("batch_quiet_ms", float, "experiment: also close a filling batch after this long "
                                                  "with no new request (default 0: off)"),
    "--max-queue-rows": ("max_queue_rows", int, "queued rows per model before 503 (default 4096)"),
    "--request-timeout-ms": ("request_timeout_ms", float, "per-request deadline, 504 after (default 30000)"),
    "--max-body-bytes": ("max_body_bytes", int, "request body cap, 413 above (default 8 MiB)"),
    "--max-rows-per-request": ("max_rows_per_request", int, "rows per request (default max batch size)"),
    "--inline-batch-ms": ("inline_batch_ms", float,
                          "batches faster than this skip the worker thread (default: CPU 25, CUDA 1)"),
    "--torch-threads": ("torch_threads", int, "torch threads for CPU models (default 0: torch's own)"),
    "--drain-grace-s": ("drain_grace_s", float,
                        "after SIGTERM, at most this long open connections are answered (default 2)"),
    "--max-header-bytes": ("max_header_bytes", int, "request line + headers cap, 431 above (default 32 KiB)"),
    "--header-timeout-s": ("header_timeout_s", float,
                           "deadline for a request's headers (408) or gRPC's preface and SETTINGS (default 10)"),
    "--body-timeout-s": ("body_timeout_s", float,
                         "deadline for a request's body (408) or a gRPC request message (default 30)"),
    "--max-connections": ("max_connections", int,
                          "open HTTP connections (503 above) and gRPC ones, each (default 0: 4096 or the fd limit)"),
    "--grpc-idle-timeout-s": ("grpc_idle_timeout_s", float,
                              "a gRPC connection with no stream this long gets GOAWAY (default 300; 0: never)"),
    "--grpc-calls-per-connection": ("grpc_calls_per_connection", int,
                                    "gRPC requests in flight per connection before reading it pauses (default 256)"),
    "--grpc-calls-per-stream": ("grpc_calls_per_stream", int,
                                "requests in flight per ModelStreamInfer stream (default 128)"),
    "--grpc-write-buffer-bytes": ("grpc_write_buffer_bytes", int,
                                  "unsent bytes per gRPC connection before reading it pauses (default 1 MiB)"),
    "--grpc-max-queued-control-frames": ("grpc_max_queued_control_frames", int,
                                         "unsent ACKs and resets per gRPC connection before GOAWAY (default 1000)"),
    "--shutdown-timeout-s": ("shutdown_timeout_s", float,
                             "after the drain, the most seconds left for requests in progress (default 10)"),
    "--api-key": ("api_key", str, "require Authorization: Bearer <key> on all but the probes (prefer the env var)"),
    "--admin-api-key": ("admin_api_key", str, "key for admin routes (kernel-stats reset, model control)"),
    "--allowed-hosts": ("allowed_hosts", str, "comma-separated Host names to answer ('*.example.com', 'local', '*'); "
                                          "empty: local names when listening on loopback, else any"),
    "--docs": ("docs", str, "true: serve /docs and /openapi.json; false: turn them off"),
    # Booleans go to Settings as text: pydantic reads true/false, 1/0, yes/no, on/off.
    "--exit-on-error": ("exit_on_error", str, "true: a model that fails to load stops start-up; false: serve the rest"),
    "--tracing": ("tracing", _on_off, "on/off: an OpenTelemetry span per request, exported over OTLP/HTTP to "
                                      "OTEL_EXPORTER_OTLP_ENDPOINT (default off; needs fusedserve[otel])"),
    "--background-tuning": ("background_tuning", _on_off,
                            "on/off: tune provisional kernel choices after ready (default on)"),
    "--tuning-search": ("tuning_search", str, "near: time the kernels that won at the GPU's nearest measured "
                                              "shapes and the vendor's GEMM; full: every candidate (default near)"),
    "--parallel-compile": ("parallel_compile", _on_off,
                           "on/off: compile a cold start's kernels in worker processes (default on)"),
    "--engine-heartbeat-timeout-s": ("engine_heartbeat_timeout_s", float,
                                     "--workers N: an engine silent this long is unready, at twice it restarted "
                                     "(default 5; 0: off)"),
}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="fusedserve", description="Serve MLPs on fused Triton kernels.")
    top.add_argument("--version", action="version", version=f"fusedserve {__version__}")
    sub = top.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model repository over HTTP and gRPC")
    for flag, (field, kind, help_text) in _FLAGS.items():
        env = "FUSEDSERVE_" + field.upper()
        serve.add_argument(flag, dest=field, type=kind, default=None, help=f"{help_text}; env {env}")
    serve.add_argument("--log-level", default=os.environ.get("FUSEDSERVE_LOG_LEVEL", "info"),
                       choices=LOG_LEVELS, help="env FUSEDSERVE_LOG_LEVEL")
    serve.add_argument("--log-format", default=os.environ.get("FUSEDSERVE_LOG_FORMAT", "text"), choices=FORMATS,
                       help="text, or json: one JSON object per line; env FUSEDSERVE_LOG_FORMAT")
    pre = sub.add_parser("precompile", help="compile a repository's kernels for a GPU model into Triton's cache "
                         "(TRITON_CACHE_DIR), no GPU needed")
    for flag in ("--model-repository", "--max-batch-size", "--backend"):
        field, kind, help_text = _FLAGS[flag]
        pre.add_argument(flag, dest=field, type=kind, default=None,
                         help=f"{help_text}; env FUSEDSERVE_{field.upper()}")
    pre.add_argument("--capability", default="9.0", help="the known GPU models of this capability (default 9.0)")
    pre.add_argument("--gpu", action="append", metavar="NAME[:SMS]", help="this GPU model instead (repeatable)")
    pre.add_argument("--cache-dir", help="Triton's cache to fill (default TRITON_CACHE_DIR, else ~/.triton/cache)")
    pre.add_argument("--jobs", type=int, default=None, help="compile processes at once (default: half the cores, <= 8)")
    pre.add_argument("--no-launchers", dest="launchers", action="store_false", help="skip Triton's launcher stubs")
    _add_import(sub)
    return top


def _add_import(sub) -> None:
    """``fusedserve import``'s flags (``models.importing.command`` runs it)."""
    imp = sub.add_parser("import", help="turn an ONNX, PyTorch or scikit-learn MLP into a model directory")
    imp.add_argument("source", help="the model file: .onnx; .pt2 (torch.export); .pt/.pth (a state_dict, or a "
                     "pickled nn.Module with --allow-pickle); .pkl/.joblib (scikit-learn, with --allow-pickle)")
    imp.add_argument("destination", metavar="REPOSITORY/NAME", help="the model directory to write")
    imp.add_argument("--version", type=int, default=None, help="write the model's version folder N")
    imp.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: the source's weights')")
    imp.add_argument("--activation", default=None,
                     help="a state_dict's hidden activations: one name, or one per hidden layer (relu,gelu)")
    imp.add_argument("--output-activation", default=None, help="a state_dict's last activation (softmax, ...)")
    imp.add_argument("--allow-pickle", action="store_true",
                     help="read a pickle (a whole nn.Module, a scikit-learn model): only for files you trust")


def settings_from_args(args: argparse.Namespace):
    """Settings from the environment, with every flag given on the command line taking precedence."""
    from fusedserve.service.settings import Settings

    # (a command takes some of the flags: the others keep the environment's values)
    given = {field: getattr(args, field, None) for field, _, _ in _FLAGS.values()}
    overrides = {field: value for field, value in given.items() if value is not None}
    return Settings(**overrides)


def serve(args: argparse.Namespace, settings) -> None:
    from fusedserve.service.workers import devices, supervisor

    configure(args.log_level, args.log_format)
    try:
        slots = devices.engines(settings)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if settings.workers > 1 or len(slots) > 1:  # several engines or front ends: processes
        supervisor.run(settings, args.log_level, args.log_format, slots)
        return
    settings = devices.engine_settings(settings, slots[0])
    # Both ports before the imports and the models (the supervisor checks its own).
    supervisor.check_free(settings.host, settings.port, "--port")
    if settings.grpc_port:
        supervisor.check_free(settings.host, settings.grpc_port, "--grpc-port")
    from fusedserve.service.app import create_app
    from fusedserve.service.http.server import DrainingServer, uvicorn_config

    app = create_app(settings)
    config = uvicorn_config(app, settings, args.log_level)
    DrainingServer(config, app.state.service, settings.drain_grace_s).run()


def main(argv: list[str] | None = None) -> None:
    from pydantic import ValidationError

    top = parser()
    args = top.parse_args(argv)
    if args.command == "serve":
        mark_start()  # the ready line counts from here, in every process this command starts
        # Defaults read from the environment skip argparse's choices check: check them here.
        if args.log_level not in LOG_LEVELS:
            top.error(f"log level must be one of {LOG_LEVELS}, got {args.log_level!r} (FUSEDSERVE_LOG_LEVEL?)")
        if args.log_format not in FORMATS:
            top.error(f"log format must be one of {FORMATS}, got {args.log_format!r} (FUSEDSERVE_LOG_FORMAT?)")
        try:
            settings = settings_from_args(args)
        except ValidationError as exc:  # a bad flag or FUSEDSERVE_* value: usage and why, exit 2
            top.error(str(exc))
        if settings.tracing:
            from fusedserve.service.tracing import unavailable

            if why := unavailable():
                top.error(why)
        serve(args, settings)
    elif args.command == "precompile":
        try:
            settings = settings_from_args(args)
        except ValidationError as exc:
            top.error(str(exc))
        from fusedserve.models import aot

        configure("info", "text")
        aot.run(args, settings)
    elif args.command == "import":
        from fusedserve.models.importing import command

        raise SystemExit(command.run(args))
