"""The transformers versions Ponytail is tested with; anything else fails at import, clearly."""

from __future__ import annotations

import importlib.metadata

from packaging.specifiers import SpecifierSet

# Keep in step with pyproject.toml: the range CI and the GPU machine actually run.
TRANSFORMERS_RANGE = ">=5.24,<5.25"


def check_transformers() -> None:
    try:
        found = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"ponytail needs transformers{TRANSFORMERS_RANGE}, which is not installed: "
                          f"pip install 'transformers{TRANSFORMERS_RANGE}'") from None
    if found not in SpecifierSet(TRANSFORMERS_RANGE):
        raise ImportError(f"ponytail is tested with transformers{TRANSFORMERS_RANGE} (its plug-in hooks into "
                          f"transformers' cache and attention internals), but transformers {found} is installed: "
                          f"pip install 'transformers{TRANSFORMERS_RANGE}'")
