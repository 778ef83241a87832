"""`ponytail serve [MODEL]`: app.yaml's Serve application, started in the foreground.

One flag per field of the app's arguments (deployments/args.py AppArgs: help text and default come
from there, values are validated there), plus where Serve listens (--host, --port), which Ray
cluster to use (--address) and --replicas (min = max). Ctrl-C (or SIGTERM) stops it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from .errors import ConfigError, PonytailError
from .utils.units import parse_bytes

_SERVE_EXTRA = "ponytail serve needs Ray Serve: pip install -e '.[serve]'"


def add_serve_parser(commands: Any) -> None:
    """Register `serve` on the `ponytail` subcommands."""
    try:
        from deployments.args import AppArgs
    except ImportError as exc:  # a base install without the serve extra: say so when asked
        serve = commands.add_parser("serve", help="serve a model with an OpenAI-compatible API")
        serve.set_defaults(run=lambda args, missing=exc: _missing(missing))  # `exc` is gone after the block
        return
    serve = commands.add_parser(
        "serve",
        help="serve a model with an OpenAI-compatible API (Ray Serve)",
        description="Start the Ponytail Serve application (the one deployments/app.yaml starts) in the "
                    "foreground; Ctrl-C stops it. Unset flags keep the defaults shown.",
    )
    model = AppArgs.model_fields["model"]
    serve.add_argument("model", nargs="?", metavar="MODEL", help=_help(model.description, None))
    serve.add_argument("--host", default="127.0.0.1", help="address the HTTP proxy binds; 0.0.0.0 accepts "
                       "other machines (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    serve.add_argument("--address", help="Ray cluster to run on: 'auto' for the one `ray start` runs here, "
                       "or HOST:PORT (default: $RAY_ADDRESS, else a Ray of its own, stopped on exit)")
    serve.add_argument("--name", default="ponytail", help="Serve application name (default: ponytail)")
    serve.add_argument("--replicas", metavar="N", help="engine replicas: sets --min-replicas and "
                       "--max-replicas both to N")
    for name, field in AppArgs.model_fields.items():
        if name == "model":
            continue
        flag = "--" + name.replace("_", "-")
        if field.annotation in (bool, bool | None):  # --compile-model / --no-compile-model; unset: auto
            serve.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=_help(field.description, field.default))
        else:
            serve.add_argument(flag, metavar=_metavar(name, field.annotation), default=argparse.SUPPRESS,
                               help=_help(field.description, field.default))
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    settings = app_args(args)
    # Before Ray starts: a bad name or revision fails here, not in every replica.
    _check_model(settings.model, settings.revision, settings.trust_remote_code)
    import ray
    from ray import serve

    from deployments.app import build

    attached = args.address is not None or bool(os.environ.get("RAY_ADDRESS"))
    ray.init(address=args.address)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, docker stop: the same clean stop as Ctrl-C
    deployed = False
    try:
        running = serve.status()  # empty when this cluster runs no Serve yet
        if args.name in running.applications:  # serve.run would replace it, and we would delete it
            raise ConfigError(f"--name={args.name!r}: the cluster already runs an application of that "
                              "name; allowed: another --name, or stop that one first")
        serve.start(http_options={"host": args.host, "port": args.port})
        where = (f"http://{args.host}:{args.port}/v1" if not running.proxies else
                 "the HTTP address of the Serve already running there (--host/--port apply only to a "
                 "Serve this command starts)")
        try:
            deployed = True  # from here on, stopping removes the application, even half-deployed
            serve.run(build(settings), name=args.name, route_prefix="/", blocking=False)
        except Exception as exc:  # Serve's deploy failure: replica tracebacks included
            print(f"ponytail: error: the application did not start: {exc}", file=sys.stderr)
            return 1
        print(f"ponytail: serving {settings.served_name()!r} at {where} (OpenAI API; app "
              f"{args.name!r}); Ctrl-C stops it", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("ponytail: stopping", flush=True)
    finally:
        # Ctrl-C reaches the whole foreground group: a second one must not cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if attached:  # not our cluster: take only our application off it
            if deployed:
                serve.delete(args.name)
        else:
            serve.shutdown()
            ray.shutdown()
    print("ponytail: stopped", flush=True)
    return 0


def app_args(args: argparse.Namespace):
    """AppArgs from the parsed flags: only those given, so the model's defaults stay the defaults."""
    from pydantic import ValidationError

    from deployments.args import AppArgs

    values = {name: value for name, value in vars(args).items() if name in AppArgs.model_fields}
    if values.get("model") is None:
        values.pop("model", None)
    if args.replicas is not None:
        given = [f for f in ("min_replicas", "max_replicas") if f in values]
        if given:
            raise ConfigError(f"--replicas={args.replicas} sets --min-replicas and --max-replicas; "
                              f"allowed: --replicas alone, or {' and '.join(_flag(f) for f in given)} without it")
        values["min_replicas"] = values["max_replicas"] = args.replicas
    try:
        settings = AppArgs.model_validate(values)
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(error) for error in exc.errors())) from None
    if settings.kv_cache_memory is not None:  # else only the replicas would find out, at start
        try:
            parse_bytes(settings.kv_cache_memory, "kv_cache_memory")
        except ConfigError as exc:
            raise ConfigError(f"--kv-cache-memory: {exc}") from None
    return settings


def _describe(error: dict) -> str:
    message = error["msg"].removeprefix("Value error, ")
    if not error["loc"]:  # a check across fields (min/max replicas): its message names them
        return message
    flag = _flag(str(error["loc"][0]))
    if error["type"] == "value_error":  # our own checks already name the field and the value
        return f"{flag}: {message}"
    return f"{flag}={error['input']!r}: {message}"


def _check_model(model: str | None, revision: str | None, trust_remote_code: bool) -> None:
    """Convert the default model once, or find a hub id at `revision` in the hub cache (downloading
    it unless HF_HUB_OFFLINE=1), so the replicas start from files already there."""
    from .models.hub import check_hub_model
    from .models.loader import default_checkpoint, model_source_at

    source = model_source_at(model, revision)
    if source is None:
        default_checkpoint()
    elif isinstance(source, str):
        check_hub_model(source, revision, trust_remote_code)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _metavar(name: str, annotation: object) -> str:
    if name.endswith("_s") and not name.endswith("_per_s"):
        return "SECONDS"
    return {int: "N", int | None: "N", float: "X", float | None: "X"}.get(annotation, "VALUE")


def _help(description: str | None, default: object) -> str:
    shown = "unset" if default is None else str(default).lower() if isinstance(default, bool) else default
    return f"{description or ''} (default: {shown})".replace("%", "%%")  # argparse formats help with %


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _missing(exc: ImportError) -> int:
    raise PonytailError(f"{_SERVE_EXTRA} ({exc})")
