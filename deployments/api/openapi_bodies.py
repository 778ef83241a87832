"""Request bodies in the API's OpenAPI document (/openapi.json, /docs).

The handlers read and check their bodies themselves, so that a bad one gets an error in its own API's
shape naming the parameter (OpenAI's or Anthropic's), not FastAPI's 422; FastAPI therefore never sees
the pydantic models they parse, and the document had no request bodies at all. Each route names its
model here (`request_body`), and `publish_request_models` puts the models, and the models they nest,
under components/schemas, where client generators, /docs and schema-driven testers (schemathesis)
look for them, as vLLM's document has them.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: a required JSON body of `model`'s schema."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def publish_request_models(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Adds each model's JSON schema (and its nested models') to `app`'s OpenAPI components when the
    document is first built. Two nested models of one name must be the same schema: a clash is an
    error at that first build, not a document that describes one of them wrongly."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            definition = model.model_json_schema(ref_template=REF)
            for name, nested in {**definition.pop("$defs", {}), model.__name__: definition}.items():
                if schemas.setdefault(name, nested) != nested:
                    raise ValueError(f"two request models publish different schemas named {name!r}")
        return document

    app.openapi = openapi
