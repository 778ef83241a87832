"""The docs a user reads first: docs/configuration.md is what the definitions say (generated from the
engine's field docstrings and the app's argument descriptions, so the two cannot drift), README is short."""

from pathlib import Path

import pytest

pytest.importorskip("pydantic")

from deployments.app.config_docs import render  # noqa: E402
from ponytail.config import engine_fields  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_md_is_generated_from_the_definitions():
    assert (ROOT / "docs" / "configuration.md").read_text() == render(), (
        "docs/configuration.md is stale: python -m deployments.app.config_docs > docs/configuration.md")


def test_every_engine_field_is_documented_where_it_is_defined():
    undocumented = [f"{section}.{field.name}" for section, field, doc in engine_fields() if not doc]
    assert not undocumented, f"fields without a docstring under them: {undocumented}"


def test_readme_reads_in_five_minutes():
    """About 150 lines, no line over 120 characters outside code blocks."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 170, f"README.md has {len(lines)} lines"
    in_code, long = False, []
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and len(line) > 120:
            long.append(f"README.md:{number}: {len(line)} characters")
    assert not long, "\n".join(long)
