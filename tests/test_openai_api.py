"""The OpenAI-compatible API (deployments/api/) over a fake backend, without Ray.

The app runs under uvicorn in a background thread on 127.0.0.1; the official `openai` client
drives the happy paths, plain HTTP (httpx2, the HTTP library the openai client ships with) the
error shapes and disconnects.
"""

import asyncio
import json
import threading

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
try:
    import httpx2 as httpx  # the HTTP library openai>=3 depends on
except ImportError:  # pragma: no cover - older openai clients use httpx
    import httpx

from deployments.app.local_server import serve_on_loopback
from deployments.api import BackendUnavailable, build_app
from deployments.api.engine_requests import COMPLETION_DEFAULT_MAX_TOKENS, to_draft
from deployments.api.openai_requests import ChatCompletionRequest, CompletionRequest
from deployments.api.protocol import GenerateDelta, GenerateRequest, ModelInfo
import dataclasses

from ponytail import ConfigError, ContextLengthError
from request_fields import sampling_set

MODEL = "fake-model"
MAX_MODEL_LEN = 512
WAIT_S = 5.0  # the longest any test waits for the server


class FakeBackend:
    """Deterministic deltas (" t0", "", " t2", ...), one token each; records requests and aborts.

    `fail` is raised at `fail_at`: "call" (backend.stream itself), "first" (the first delta) or
    "later" (after two deltas). A prompt + max_tokens over MAX_MODEL_LEN raises the engine's
    ConfigError on the first delta, as the real replica does.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.fail: BaseException | None = None
        self.fail_at = "call"
        self.delay_s = 0.0
        self.requests = []
        self.aborts = []
        self.aborted = threading.Event()

    async def model_info(self) -> ModelInfo:
        return ModelInfo(model_id=MODEL, max_model_len=MAX_MODEL_LEN, block_size=16, device="cpu", device_uuid=None)

    def stream(self, request):
        self.requests.append(request)
        if self.fail is not None and self.fail_at == "call":
            raise self.fail
        return self._deltas(request)

    async def _deltas(self, request):
        params = dataclasses.replace(request.sampling)
        if request.messages is not None:
            prompt_tokens = sum(len(m["content"].split()) + 4 for m in request.messages)
        else:
            prompt_tokens = len(request.prompt) if isinstance(request.prompt, list) else len(request.prompt.split())
        if request.max_tokens_to_context:  # as the replica: what the prompt leaves of the context
            if prompt_tokens >= MAX_MODEL_LEN:
                raise ContextLengthError(f"prompt has {prompt_tokens} tokens, which leaves no room for an answer; "
                                         f"allowed: at most {MAX_MODEL_LEN - 1} (max_model_len={MAX_MODEL_LEN})",
                                         prompt_tokens, 1, MAX_MODEL_LEN)
            params.max_tokens = min(params.max_tokens, MAX_MODEL_LEN - prompt_tokens)
        need = prompt_tokens + params.max_tokens
        if need > MAX_MODEL_LEN:
            raise ContextLengthError(f"prompt ({prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = {need} "
                                     f"exceeds max_model_len={MAX_MODEL_LEN}", prompt_tokens, params.max_tokens,
                                     MAX_MODEL_LEN)
        if self.fail is not None and self.fail_at == "first":
            raise self.fail
        for i in range(params.max_tokens):
            if self.fail is not None and self.fail_at == "later" and i == 2:
                raise self.fail
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            done = i + 1 == params.max_tokens
            yield GenerateDelta(request_id=request.request_id, text="" if i % 3 == 1 else f" t{i}",
                                token_ids=[100 + i], finished=done, finish_reason="length" if done else None,
                                prompt_tokens=prompt_tokens, completion_tokens=i + 1, cached_tokens=prompt_tokens - 1)

    async def abort(self, request_id: str) -> None:
        self.aborts.append(request_id)
        self.aborted.set()


class RayTaskErrorLike(Exception):
    """Like ray.exceptions.RayTaskError: the original error in `.cause`, a traceback in str()."""

    def __init__(self, cause: BaseException):
        super().__init__(f"ray::EngineReplica.generate()\nTraceback (most recent call last):\n  ...\n{cause!r}")
        self.cause = cause


@pytest.fixture(scope="module")
def server():
    backend = FakeBackend()
    with serve_on_loopback(build_app(backend)) as url:
        yield backend, url


@pytest.fixture
def backend(server):
    server[0].reset()
    return server[0]


@pytest.fixture
def client(server, backend):
    with openai.OpenAI(base_url=f"{server[1]}/v1", api_key="x", max_retries=0, timeout=WAIT_S) as c:
        yield c


@pytest.fixture
def http(server, backend):
    with httpx.Client(base_url=server[1], timeout=WAIT_S) as c:
        yield c


def expected_text(max_tokens: int) -> str:
    return "".join("" if i % 3 == 1 else f" t{i}" for i in range(max_tokens))


# ------------------------------------------------------------------------------ happy paths
def test_health_and_models(client, http):
    assert http.get("/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model" and models.data[0].owned_by == "ponytail"
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_stream_matches_non_stream(client, backend):
    full = client.completions.create(model=MODEL, prompt="one two three", max_tokens=7, temperature=0)
    assert full.object == "text_completion" and full.id.startswith("cmpl-") and full.model == MODEL
    assert full.choices[0].text == expected_text(7) and full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (3, 7, 10)
    assert full.usage.prompt_tokens_details.cached_tokens == 2  # what the replica found in its prefix cache
    assert full.usage.completion_tokens_details is None  # no reasoning split: nothing counted, no 0 made up
    assert backend.requests[0].request_id == full.id and backend.requests[0].prompt == "one two three"
    assert sampling_set(backend.requests[0]) == {"max_tokens": 7, "temperature": 0.0}

    chunks = list(client.completions.create(model=MODEL, prompt="one two three", max_tokens=7, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 10
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 2
    assert not backend.aborts


def test_continuous_usage_stats_put_each_choices_usage_so_far_in_every_chunk(client, backend):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt="one two three", max_tokens=5, stream=True,
                                            stream_options=options))
    with_text = [c for c in chunks if c.choices and c.choices[0].text]
    assert [c.usage.completion_tokens for c in with_text] == [1, 3, 4]  # the fake's token 2 has no text
    assert all(c.usage.prompt_tokens == 3 and c.usage.prompt_tokens_details.cached_tokens == 2 for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 8
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, stream=True, stream_options=options))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0  # the opening
    assert [c.usage.completion_tokens for c in chat if c.choices and c.choices[0].finish_reason] == [4]
    assert all(c.usage is not None and c.usage.prompt_tokens == 5 for c in chat)
    plain = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]  # the last only
    alone = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, stream=True,
                                                stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in alone)  # as in vLLM: only together with include_usage


def test_chat_stream_matches_non_stream(client, backend):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5, seed=3,
                                          stop=["END"], extra_body={"top_k": 4, "repetition_penalty": 1.1})
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content == expected_text(5)
    assert full.usage.completion_tokens == 5 and full.usage.total_tokens == full.usage.prompt_tokens + 5
    request = backend.requests[0]
    assert request.messages == messages and request.prompt is None and request.request_id == full.id
    assert sampling_set(request) == {"max_tokens": 5, "seed": 3, "stop": ["END"], "top_k": 4, "repetition_penalty": 1.1}

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5, stream=True)
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None  # no include_usage


def test_chat_without_max_tokens_runs_to_the_end_of_the_context_and_no_model(http, backend):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "user": "u",
                                                "some_future_field": {"x": 1}, "min_tokens": 100})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - r.json()["usage"]["prompt_tokens"]
    request = backend.requests[0]
    # the bound (what the router sizes it by); the replica lowers it to what the prompt leaves
    assert sampling_set(request) == {"max_tokens": MAX_MODEL_LEN, "min_tokens": 100} and request.max_tokens_to_context
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.json()["usage"]["completion_tokens"] == 3 and not backend.requests[1].max_tokens_to_context
    r = http.post("/v1/completions", json={"prompt": "hi"})
    assert r.json()["usage"]["completion_tokens"] == COMPLETION_DEFAULT_MAX_TOKENS  # OpenAI's 16 for completions


def test_a_draft_holds_the_fields_the_request_set():
    completion = to_draft(CompletionRequest.model_validate({"prompt": [1, 2, 3]}))
    assert completion.request.prompt == [1, 2, 3] and completion.sampling == {"max_tokens": COMPLETION_DEFAULT_MAX_TOKENS}
    assert completion.request.request_id.startswith("cmpl-")
    chat = to_draft(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "max_tokens": 9, "max_completion_tokens": 4, "top_p": 0.5}), request_id="chatcmpl-x")
    assert chat.request.messages == [{"role": "user", "content": "a\nb"}] and chat.request.request_id == "chatcmpl-x"
    assert chat.sampling == {"max_tokens": 4, "top_p": 0.5} and not chat.request.max_tokens_to_context
    unset = to_draft(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}]}))
    assert unset.sampling == {} and unset.request.max_tokens_to_context  # the API adds the bound, the replica the rest


def test_sampling_params_are_built_once_over_the_models_defaults():
    """finish() builds the request's SamplingParams: the model's generation_config values under the
    fields the request set (vLLM's --generation-config auto); a bad value names its field."""
    draft = to_draft(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}],
                                                           "temperature": 0.9, "max_tokens": 4}))
    request = draft.finish({"temperature": 0.3, "top_p": 0.8})
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.max_tokens) == (0.9, 0.8, 4)
    info = ModelInfo(model_id=MODEL, max_model_len=MAX_MODEL_LEN, block_size=16, device="cpu", device_uuid=None,
                     sampling_defaults={"top_k": 20})
    assert info.sampling_params(max_tokens=3).top_k == 20  # what a handle caller builds
    with pytest.raises(ConfigError, match="top_k=-5 is invalid"):
        to_draft(CompletionRequest.model_validate({"prompt": "a", "top_k": -5})).finish({})
    with pytest.raises(ConfigError, match=r"sampling=\{'max_tokens': 4\} is not supported; allowed: a "
                                          r"ponytail.SamplingParams"):
        GenerateRequest(prompt="a", sampling={"max_tokens": 4})


# ------------------------------------------------------------------------------ errors
def assert_error(response, status: int, param: str | None, *in_message: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error" if status < 500 else
                             "service_unavailable_error" if status == 503 else "server_error")
    assert error["param"] == param
    for text in in_message:
        assert text in error["message"], error["message"]
    assert "Traceback" not in response.text
    return error


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body, param, in_message", [
    ("/v1/completions", {}, "prompt", ["prompt", "required"]),
    ("/v1/chat/completions", {"model": MODEL}, "messages", ["messages", "required"]),
    ("/v1/chat/completions", {"messages": []}, "messages", ["messages"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens", ["max_tokens", "integer", "'ten'"]),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream", ["stream"]),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt", ["prompt", "token ids"]),
    ("/v1/completions", {"prompt": []}, "prompt", ["prompt=[] is empty"]),
    ("/v1/completions", {"prompt": [[1, 2], "b"]}, "prompt", ["prompt", "list of strings or of token-id lists"]),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop", ["stop"]),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", ["logprobs=21", "[0, 20]"]),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs", ["logprobs", "integer"]),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     ["top_logprobs=21", "[0, 20]"]),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs",
     ["top_logprobs=2 needs logprobs=true"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", ["messages[0].content", "images"]),
    # values SamplingParams refuses: its message, which names the field
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens", ["max_tokens=-1", ">= 1"]),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature",
     ["temperature: Input should be greater than or equal to 0 (got -1)"]),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, "top_p", ["top_p: Input should be less than or equal to 1 (got 2)"]),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", ["n=0", "allowed: an integer in [1, 16] (max_n)"]),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of", ["best_of=2", "[n=3, 128]"]),
    ("/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}, "best_of",
     ["best_of > 1 is not allowed with stream=true"]),
    ("/v1/chat/completions", {**CHAT, "best_of": 3, "stream": True}, "best_of", ["best_of", "stream=true"]),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n", ["n=17 is more than this server allows: at most 16 (max_n)"]),
    ("/v1/completions", {"prompt": "hi", "best_of": 17}, "best_of",
     ["best_of=17 is more than this server allows: at most 16 (max_n)"]),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens",
     ["max_completion_tokens=0"]),
    ("/v1/chat/completions", {**CHAT, "top_k": -5}, "top_k", ["top_k=-5"]),
])
def test_bad_request_names_the_field(http, backend, path, body, param, in_message):
    assert_error(http.post(path, json=body), 400, param, *in_message)
    assert backend.requests == []  # refused before reaching the engine


def test_malformed_json(http, backend):
    r = http.post("/v1/completions", content=b'{"prompt": "hi",', headers={"content-type": "application/json"})
    assert_error(r, 400, None, "not valid JSON")
    assert_error(http.post("/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"}),
                 400, "body", "object")


def test_prompt_too_long_from_the_engine(http, client, backend):
    """A max_tokens over the context is refused by the ingress; prompt + max_tokens over it by the
    engine (ContextLengthError): both with OpenAI's code and the field at fault."""
    for stream in (False, True):
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10**9, "stream": stream})
        error = assert_error(r, 400, "max_tokens", "max_tokens=1000000000 is more than the model's context allows: "
                             "at most 512 (max_model_len=512)")
        assert error["code"] == "context_length_exceeded"
    assert backend.requests == []
    with pytest.raises(openai.BadRequestError, match="max_model_len") as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=MAX_MODEL_LEN)
    assert caught.value.body["param"] == "max_tokens" and caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="max_model_len") as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a " * 600}])
    assert caught.value.body["param"] == "messages" and caught.value.body["code"] == "context_length_exceeded"
    r = http.post("/v1/completions", json={"prompt": "a " * 600, "max_tokens": 1})
    error = assert_error(r, 400, "prompt", "prompt (600 tokens) + max_tokens (1) = 601 exceeds max_model_len=512")
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("wrap", [
    lambda e: e,
    RayTaskErrorLike,
    lambda e: type("RayTaskError(ConfigError)", (RayTaskErrorLike, type(e)), {})(e),  # Ray's as_instanceof_cause
])
def test_wrapped_config_error_is_a_400(http, backend, wrap):
    backend.fail, backend.fail_at = wrap(ConfigError("prompt='' is empty; give at least one token")), "first"
    error = assert_error(http.post("/v1/completions", json={"prompt": "hi"}), 400, "prompt")
    assert error["message"] == "prompt='' is empty; give at least one token"


def test_unknown_model_is_a_404(http, client, backend):
    error = assert_error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404, "model",
                         "gpt-4", MODEL)
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT["messages"])
    assert_error(http.get("/v1/models/gpt-4"), 404, "model")
    assert backend.requests == []


@pytest.mark.parametrize("fail_at", ["call", "first"])
def test_backend_unavailable_is_a_503(http, backend, fail_at):
    backend.fail, backend.fail_at = BackendUnavailable("all engine replicas are busy"), fail_at
    for body in ({"prompt": "hi"}, {"prompt": "hi", "stream": True}):
        r = http.post("/v1/completions", json=body)
        assert_error(r, 503, None, "busy")
        assert r.headers["retry-after"] == "1"
    backend.fail = RayTaskErrorLike(BackendUnavailable("no replica"))
    assert_error(http.post("/v1/chat/completions", json=CHAT), 503, None, "no replica")


@pytest.mark.parametrize("fail_at", ["call", "first"])
def test_internal_error_is_a_500_without_details(http, backend, fail_at):
    backend.fail = RuntimeError("secret detail\nTraceback (most recent call last):")
    backend.fail_at = fail_at
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {**CHAT, "stream": True})):
        error = assert_error(http.post(path, json=body), 500, None, "internal server error")
        assert "secret" not in error["message"]
    assert_error(http.get("/no/such/path"), 404, None)


def test_error_after_the_stream_started(http, client, backend):
    backend.fail, backend.fail_at = RuntimeError("secret detail"), "later"
    with http.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 9, "stream": True}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "secret" not in error["message"]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]] == [" t0"]  # empty deltas send nothing
    assert backend.aborts == [backend.requests[0].request_id]  # aborted before the error event was sent

    stream = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], stream=True)
    with pytest.raises(openai.APIError, match="internal server error"):
        list(stream)
    assert backend.aborts == [r.request_id for r in backend.requests]


# ------------------------------------------------------------------------------ disconnects
def wait_for_abort(backend) -> list[str]:
    assert backend.aborted.wait(WAIT_S), "backend.abort was not called"
    return backend.aborts


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", CHAT)])
def test_client_disconnect_mid_stream_aborts(http, backend, path, body):
    backend.delay_s = 0.05  # 400 tokens would take 20 s
    with http.stream("POST", path, json={**body, "max_tokens": 400, "stream": True}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))
    request_id = json.loads(first[6:])["id"]  # leaving the block closed the connection
    assert wait_for_abort(backend) == [request_id] == [backend.requests[0].request_id]


def test_client_disconnect_while_waiting_aborts(server, backend):
    backend.delay_s = 0.05
    with httpx.Client(base_url=server[1], timeout=0.3) as short:
        with pytest.raises(httpx.ReadTimeout):
            short.post("/v1/completions", json={"prompt": "hi", "max_tokens": 400})
    assert wait_for_abort(backend) == [backend.requests[0].request_id]


def test_prompt_lists_become_one_engine_request_each():
    from deployments.api.engine_requests import to_drafts

    def prompts(prompt):
        return [(d.request.prompt, d.request.request_id) for d in to_drafts(CompletionRequest.model_validate(
            {"prompt": prompt, "max_tokens": 3}), "x")]

    assert prompts([[1, 2, 3]]) == [([1, 2, 3], "cmpl-x")]  # lm-eval's batch of one
    assert prompts(["a"]) == [("a", "cmpl-x")]
    assert prompts([1, 2]) == [([1, 2], "cmpl-x")]
    assert prompts(["a", "b"]) == [("a", "cmpl-x-0"), ("b", "cmpl-x-1")]
    assert prompts([[1], [2, 3]]) == [([1], "cmpl-x-0"), ([2, 3], "cmpl-x-1")]
