"""What an engine request's typed sampling sets, as a dict: for tests that check what the API made
of a request's fields."""

import dataclasses
import json

from ponytail import SamplingParams

DEFAULTS = SamplingParams()


def sampling_set(request) -> dict:
    """The SamplingParams fields of request.sampling that differ from SamplingParams' defaults, with
    structured_outputs as the dict it was given as (a schema parsed back from its canonical text)."""
    out = {}
    for field in dataclasses.fields(SamplingParams):
        value = getattr(request.sampling, field.name)
        if value == getattr(DEFAULTS, field.name):
            continue
        if field.name == "structured_outputs":
            value = {key: json.loads(given) if key == "json" else given
                     for key, given in dataclasses.asdict(value).items() if given is not None}
        out[field.name] = value
    return out
