"""The Ray Serve application: engine replicas, their routers, the ingress, the app's arguments and
metrics. `serve run deployments/app.yaml` imports `deployments.app:build`.

Imports: ray, deployments.api, ponytail's public names and ponytail.config.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """`build` imports Ray Serve: loaded when asked for, so `deployments.app.args` (the CLI's
    flags) imports without it."""
    if name == "build":
        from .builder import build

        return build
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
