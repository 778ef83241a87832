"""`ponytail serve [MODEL]`: app.yaml's Serve application, started in the foreground.

The `ponytail` command finds this subcommand through the entry point group `ponytail.commands`
(pyproject.toml), so the library never imports the app. One flag per field of the app's arguments
(app/args.py AppArgs) and per engine argument (ponytail.config.EngineConfig, flat, as `vllm serve`
takes them; `--tuning JSON` for TuningConfig's): help texts and defaults come from those
definitions and values are validated there. Also where Serve listens (--host, --port), which Ray
cluster to use (--address) and --replicas (min = max). Ctrl-C (or SIGTERM) stops it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
import typing
from typing import Any

from ponytail import ConfigError, EngineConfig, PonytailError, prefetch_model
from ponytail.config import engine_fields

_SERVE_EXTRA = "ponytail serve needs Ray Serve: pip install -e '.[serve]'"


def add_serve_parser(commands: Any) -> None:
    """Register `serve` on the `ponytail` subcommands (the `ponytail.commands` entry point)."""
    try:
        from deployments.app.args import AppArgs
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
    app = serve.add_argument_group("the app (deployments/app.yaml's args)")
    for name, field in AppArgs.model_fields.items():
        if name not in ("model", "engine"):
            default = field.default_factory() if field.default_factory is not None else field.default
            _add_flag(app, name, field.annotation, default, field.description)
    engine = serve.add_argument_group("the engine (ponytail.LLM's arguments, docs/configuration.md)")
    for section, field, doc in engine_fields():
        if section != "tuning":
            _add_flag(engine, field.name, field.type, _field_default(field), doc)
    engine.add_argument("--tuning", metavar="JSON", default=argparse.SUPPRESS, type=_json,
                        help="TuningConfig's fields as a JSON object (docs/configuration.md; users never need them)")
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    settings = app_args(args)
    # Before Ray starts: a bad name or revision fails here, not in every replica.
    prefetch_model(settings.model, settings.engine.get("revision"), settings.engine.get("trust_remote_code", False))
    import ray
    from ray import serve

    from deployments.app.builder import build
    from deployments.app.stream_closer import controller_options

    attached = args.address is not None or bool(os.environ.get("RAY_ADDRESS"))
    ray.init(address=args.address)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, docker stop: the same clean stop as Ctrl-C
    deployed = False
    try:
        running = serve.status()  # empty when this cluster runs no Serve yet
        if args.name in running.applications:  # serve.run would replace it, and we would delete it
            raise ConfigError(f"--name={args.name!r}: the cluster already runs an application of that "
                              "name; allowed: another --name, or stop that one first")
        serve.start(http_options={"host": args.host, "port": args.port}, controller_options=controller_options())
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
        if deployed:  # the app first, with the proxies still up: its replicas finish their streams for
            # shutdown_timeout_s, and the proxies end the ones still open with an error event
            print(f"ponytail: open requests finish for up to {settings.shutdown_timeout_s:g} s", flush=True)
            serve.delete(args.name)
        if not attached:  # our own cluster: stopping Ray stops Serve with it (serve.shutdown would kill the
            # proxies at once, cutting the streams, were the app still there)
            ray.shutdown()
    print("ponytail: stopped", flush=True)
    return 0


def app_args(args: argparse.Namespace):
    """AppArgs from the parsed flags: only those given, so the defaults stay the defaults."""
    from pydantic import ValidationError

    from deployments.app.args import AppArgs

    kinds = {field.name: _value_type(field.type) for section, field, _ in engine_fields() if section != "tuning"}
    engine_names = set(kinds) | {"tuning"}
    flags = vars(args)
    given = {name: value for name, value in flags.items() if name in AppArgs.model_fields}
    engine = {name: _typed(name, value, kinds.get(name)) for name, value in flags.items() if name in engine_names}
    if given.get("model") is None:
        given.pop("model", None)
    if args.replicas is not None:
        clash = [f for f in ("min_replicas", "max_replicas") if f in given]
        if clash:
            raise ConfigError(f"--replicas={args.replicas} sets --min-replicas and --max-replicas; "
                              f"allowed: --replicas alone, or {' and '.join(_flag(f) for f in clash)} without it")
        given["min_replicas"] = given["max_replicas"] = args.replicas
    try:
        EngineConfig.from_kwargs(**engine)  # the engine's own message, naming the flag
    except ConfigError as exc:
        name = str(exc).split("=", 1)[0].strip()
        raise ConfigError(f"{_flag(name)}: {exc}" if name in engine_names else str(exc)) from None
    try:
        return AppArgs.model_validate({**given, "engine": engine})
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(error) for error in exc.errors())) from None


def _add_flag(group, name: str, annotation: Any, default: Any, description: str | None) -> None:
    flag = _flag(name)
    kind = _value_type(annotation)
    if kind is bool:  # --compile-model / --no-compile-model; unset: the default
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=_help(description, default))
    elif kind is dict:
        group.add_argument(flag, metavar="JSON", default=argparse.SUPPRESS, help=_help(description, default))
    elif kind is list:
        group.add_argument(flag, metavar="VALUE", nargs="*", default=argparse.SUPPRESS,
                           help=_help(description, default))
    else:
        group.add_argument(flag, metavar=_metavar(name, kind), default=argparse.SUPPRESS,
                           help=_help(description, default))


def _value_type(annotation: Any) -> Any:
    """bool, int, float, dict, list or str: what a flag's text becomes (int | str, Literal[...]: str)."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {**vars(typing), "Any": Any})  # a postponed dataclass annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if typing.get_origin(annotation) is typing.Literal:
        return str
    for kind in (bool, dict, list):
        if any(a is kind or typing.get_origin(a) is kind for a in args):
            return kind
    return args[0] if len(args) == 1 and args[0] in (int, float) else str


def _typed(name: str, value: Any, kind: Any) -> Any:
    """An engine flag's text as its field's type (the app's flags are typed by pydantic)."""
    if kind not in (int, float) or not isinstance(value, str):
        return value
    try:
        return kind(value)
    except ValueError:
        allowed = "an integer" if kind is int else "a number"
        raise ConfigError(f"{_flag(name)}={value!r}: allowed: {allowed}") from None


def _field_default(field: dataclasses.Field) -> Any:
    return None if field.default is dataclasses.MISSING else field.default


def _json(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def _describe(error: dict) -> str:
    message = error["msg"].removeprefix("Value error, ")
    if not error["loc"]:  # a check across fields (min/max replicas): its message names them
        return message
    flag = _flag(str(error["loc"][0]))
    if error["type"] == "value_error":  # our own checks already name the field and the value
        return f"{flag}: {message}"
    return f"{flag}={error['input']!r}: {message}"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _metavar(name: str, kind: Any) -> str:
    if name.endswith("_s") and not name.endswith("_per_s"):
        return "SECONDS"
    return {int: "N", float: "X"}.get(kind, "VALUE")


def _help(description: str | None, default: object) -> str:
    shown = "unset" if default is None else str(default).lower() if isinstance(default, bool) else default
    return f"{description or ''} (default: {shown})".replace("%", "%%")  # argparse formats help with %


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _missing(exc: ImportError) -> int:
    raise PonytailError(f"{_SERVE_EXTRA} ({exc})")
