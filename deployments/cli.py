"""The ``specserve serve`` and ``specserve demo`` commands. Registered with the core CLI
through the ``specserve.commands`` entry point, because they import the service packages
(the core package never does).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specserve.cli import (
    UsageError,
    add_model_flags,
    add_sampling_flags,
    product_stdout,
    quiet_libraries,
    request_from_args,
    stream_to,
    summary_line,
)
from specserve.ports import free_port


def cmd_demo(args: argparse.Namespace) -> int:
    """Start the service on a local Ray cluster, stream one generation through the gRPC
    SDK, print the summary, stop."""
    request_from_args(args, args.prompt)  # validated here; the server validates again
    out = product_stdout()
    quiet_libraries()
    from deployments.local import start_local
    from specserve.client import Client

    port = args.port
    if port == 0:
        port = free_port()
    print("[specserve] starting a local Ray cluster with the Router, Drafter and Target "
          "deployments (built-in pair, embedded Redis) ...", file=sys.stderr)
    t0 = time.perf_counter()
    service = start_local({}, port=port)
    print(f"[specserve] serving gRPC on {service.grpc_address} after "
          f"{time.perf_counter() - t0:.0f}s; generating through the SDK:", file=sys.stderr)
    try:
        t1 = time.perf_counter()
        with Client(service.grpc_address, timeout=300) as client:
            stats, finish = stream_to(out, client, args)
        out.write("\n")
        print(summary_line({**stats, "finish_reason": finish}, time.perf_counter() - t1),
              file=sys.stderr)
    finally:
        service.stop()
    out.flush()
    return 0


def _serve_config(args: argparse.Namespace) -> dict:
    """The AppConfig dict: --config, then the flags fill what it leaves out."""
    config: dict = {}
    if args.config:
        import yaml

        try:
            config = yaml.safe_load(Path(args.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UsageError(f"--config {args.config}: {e}") from None
        if not isinstance(config, dict):
            raise UsageError(f"--config {args.config}: expected a mapping (AppConfig)")
    models = config.setdefault("models", {})
    if isinstance(models, dict):
        models.setdefault("target", args.target)
        models.setdefault("drafter", None if args.drafter == "none" else args.drafter)
    if args.tp is not None:
        config.setdefault("target", {})["tp_size"] = args.tp
    security = config.setdefault("security", {})
    if isinstance(security, dict):
        for flag, key in (("api_keys_file", "api_keys_file"), ("tls_cert", "tls_cert"),
                          ("tls_key", "tls_key")):
            if getattr(args, flag, None):
                security[key] = getattr(args, flag)
        if getattr(args, "require_api_key", False):
            security["require_api_key"] = True
    return config


def _check_security_files(cfg) -> None:
    """Key and certificate files must be readable before anything starts."""
    from specserve.auth import KeyStore

    sec = cfg.security
    for flag, path in (("--tls-cert", sec.tls_cert), ("--tls-key", sec.tls_key)):
        if path and not Path(path).is_file():
            raise UsageError(f"{flag} {path}: no such file")
    try:
        keys = KeyStore(sec.api_keys_file, sec.api_keys_env)
    except (OSError, ValueError) as e:
        raise UsageError(f"--api-keys-file {sec.api_keys_file}: {e}") from None
    if sec.require_api_key and not keys.enabled:
        raise UsageError(f"--require-api-key: no keys (--api-keys-file or ${sec.api_keys_env})")


def cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from pydantic import ValidationError

    from deployments.app import validate_app_config
    from specserve.api import describe_validation_error

    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    if not 0 < args.http_port < 65536 or args.http_port == args.port:
        raise UsageError(f"--http-port must be in 1..65535 and differ from --port, got "
                         f"{args.http_port}")
    try:  # before Ray starts: a bad config leaves nothing running
        cfg = validate_app_config(_serve_config(args))
    except ValidationError as e:
        raise UsageError(f"config: {describe_validation_error(e)}") from None
    except (ValueError, OSError) as e:
        raise UsageError(f"--tp: {e}") from None
    _check_security_files(cfg)
    out = product_stdout()
    quiet_libraries()
    from deployments.local import APP_NAME, start_local

    print(f"[specserve] starting Ray and the deployments (target {cfg.models.target}, "
          f"drafter {cfg.models.drafter}) ...", file=sys.stderr)
    service = start_local(cfg, port=args.port, num_cpus=args.num_cpus,
                          http_port=args.http_port)
    # After ray.init: Ray installs its own SIGTERM handler (which aborts); ours replaces it
    # so that SIGTERM, like Ctrl-C, shuts Serve and the local cluster down cleanly.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    tls = "TLS" if cfg.security.tls_cert else "plaintext"
    import os

    env = cfg.security.api_keys_env
    auth = ("API keys" if cfg.security.api_keys_file or (env and os.environ.get(env))
            else "no API keys: open")
    print(f"[specserve] serving gRPC ({tls}, {auth}) on {service.grpc_address} (application "
          f"'{APP_NAME}', journal {service.redis_url or 'off'}); OpenAI-compatible HTTP API "
          f"on {service.http_address}/v1; Ctrl-C to stop", file=sys.stderr)
    print(service.grpc_address, file=out, flush=True)
    try:
        stop.wait()
    finally:
        print("[specserve] shutting down", file=sys.stderr)
        service.stop()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``demo`` and ``serve`` to the ``specserve`` command."""
    d = sub.add_parser("demo", help="start the service locally, generate through it, stop")
    d.add_argument("prompt", help="prompt text")
    add_sampling_flags(d)
    d.add_argument("--port", type=int, default=0, help="gRPC port (default: a free one)")
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("serve", help="run the distributed service on a local Ray cluster")
    s.add_argument("--port", type=int, default=9000, help="gRPC port (default 9000)")
    s.add_argument("--http-port", type=int, default=8000,
                   help="port of the OpenAI-compatible HTTP API (default 8000)")
    add_model_flags(s)
    s.add_argument("--config", help="YAML/JSON AppConfig (deployments/config.py); flags "
                                    "fill what it leaves out")
    s.add_argument("--num-cpus", type=float, default=None, help="CPUs Ray may use")
    s.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor-parallel ranks per target replica (AppConfig target.tp_size; "
                        "default 1); must divide the target's attention heads")
    s.add_argument("--api-keys-file", metavar="PATH", help="API keys ('name: key' lines or a "
                   "JSON/YAML mapping; re-read when it changes); without it and without "
                   "$SPECSERVE_API_KEYS the API is open (docs/security.md)")
    s.add_argument("--require-api-key", action="store_true",
                   help="refuse to start without API keys")
    s.add_argument("--tls-cert", metavar="PEM", help="TLS certificate (chain) of the public "
                   "port; with --tls-key the port speaks TLS only")
    s.add_argument("--tls-key", metavar="PEM", help="TLS private key of the public port")
    s.set_defaults(func=cmd_serve)
