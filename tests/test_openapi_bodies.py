"""/openapi.json documents every request body the API takes, where clients and testers look for it."""

import warnings

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from deployments.api import anthropic_protocol, openai_requests, responses_protocol
from deployments.api.server import build_app
from deployments.api.openapi_bodies import publish_request_models, request_body

BODIES = {"/tokenize": openai_requests.TokenizeRequest, "/detokenize": openai_requests.DetokenizeRequest,
          "/v1/completions": openai_requests.CompletionRequest,
          "/v1/chat/completions": openai_requests.ChatCompletionRequest,
          "/v1/responses": responses_protocol.ResponsesRequest, "/v1/messages": anthropic_protocol.MessagesRequest,
          "/v1/messages/count_tokens": anthropic_protocol.CountTokensRequest}


def refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def test_every_post_route_names_its_body_and_every_reference_resolves():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of duplicate operation ids: none may be left
        document = TestClient(build_app(backend=None), client=("127.0.0.1", 50000)).get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    posted = {path: ops["post"] for path, ops in document["paths"].items() if "post" in ops}
    for path, model in BODIES.items():
        body = posted.pop(path)["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model.__name__}"}
        assert set(schemas[model.__name__]["properties"]) == set(model.model_json_schema()["properties"])
    assert list(posted) == ["/v1/responses/{response_id}/{action}"]  # answers 404 whatever it is sent
    assert "stream" in schemas["ChatCompletionRequest"]["properties"]
    for ref in set(refs(document)):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref


def test_two_request_models_may_not_publish_different_schemas_under_one_name():
    def clashing(field_type):
        class Part(BaseModel):
            value: field_type

        class Body(BaseModel):
            part: Part
        return Body

    app = FastAPI()
    first, second = clashing(int), clashing(str)

    @app.post("/a", openapi_extra=request_body(first))
    async def a() -> None: ...

    publish_request_models(app, [first, second])
    with pytest.raises(ValueError, match="two request models publish different schemas named 'Part'"):
        app.openapi()
