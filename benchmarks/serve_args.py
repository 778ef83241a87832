"""The app's arguments as the benchmarks' command lines take them: flat, LLM's names beside the
app's (`max_num_seqs=8;router=prefix`), nested as the app takes them (LLM's under `engine`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ponytail.config import TuningConfig, field_owners

TUNING = {field.name for field in dataclasses.fields(TuningConfig)}


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """`flat` with LLM's argument names (ponytail.config's fields) moved under `engine`, and
    TuningConfig's under `engine`'s `tuning`."""
    args = dict(flat)
    engine = dict(args.pop("engine", {}) or {})
    for name in [name for name in args if name in field_owners()]:
        engine[name] = args.pop(name)
    tuning = {name: args.pop(name) for name in list(args) if name in TUNING}
    if tuning:
        engine["tuning"] = {**engine.get("tuning", {}), **tuning}
    return {**args, "engine": engine} if engine else args


def engine_names() -> set[str]:
    """The engine's argument names a benchmark takes flat: LLM's and TuningConfig's."""
    return set(field_owners()) | TUNING


def known(name: str, app_fields) -> bool:
    """Whether a flat name is an app arg or an engine argument."""
    return name in app_fields or name in engine_names()
