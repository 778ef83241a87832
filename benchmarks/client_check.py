"""Third-party OpenAI clients against a running server, called the way their users call them.

- the openai SDK: chat (whole, streamed), structured output (`chat.completions.parse`), the
  Responses API (`responses.create`, `responses.stream`);
- LangChain's ChatOpenAI: chat and the Responses API (`use_responses_api=True`), invoke, stream
  and `with_structured_output`;
- the OpenAI Agents SDK: `Runner.run`, `Runner.run_streamed`, and a function tool under
  `tool_choice="required"` (any model can be made to call it; "auto" needs a template with a
  tool-call format);
- the anthropic SDK (Anthropic's Messages API): `messages.create`, `messages.stream`,
  `messages.count_tokens`, and a tool under `tool_choice={"type": "tool"}`;
- LangChain's ChatAnthropic: invoke, stream and `with_structured_output` (a forced tool call);
- LiteLLM (`hosted_vllm/` models: how LiteLLM users reach a vLLM-compatible server): completion,
  streamed completion, and a forced tool call;
- Pydantic AI (`OpenAIChatModel` on an `OpenAIProvider`): an agent's run, a streamed run, and a
  pydantic output type (a forced call of its output tool);
- instructor (`from_openai`): a pydantic response model through a named tool and through
  `response_format` json_schema;
- LlamaIndex's `OpenAILike`: complete, chat, streamed chat and `structured_predict`.

Each check prints ok, FAILED (with the error) or skipped (the client is not installed); the exit
status is 1 when a check of an installed client failed. Requirements (not Ponytail dependencies):
`pip install openai langchain-openai openai-agents anthropic langchain-anthropic`; LiteLLM
(`pip install litellm`) pins an older openai than the Agents SDK, and pip takes long to resolve the
others beside them: give each of `litellm`, `"pydantic-ai-slim[openai]" instructor` and
`llama-index-llms-openai-like` a venv of its own.

    serve run deployments/app.yaml &
    python benchmarks/client_check.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time
import traceback

from pydantic import BaseModel, Field

ASK = "What is the capital of France? Answer in one short sentence."
CITY_ASK = "Paris is in which country? Reply with the city and the country."


class City(BaseModel):
    """A city and its country."""

    city: str = Field(description="the city's name")
    country: str = Field(description="the country it is in")


def openai_checks(base: str, model: str):
    import openai

    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    chat = dict(model=model, messages=[{"role": "user", "content": ASK}], temperature=0, max_tokens=32)
    yield "chat", lambda: client.chat.completions.create(**chat).choices[0].message.content
    yield "chat stream", lambda: "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        stream=True, **chat) if c.choices)
    yield "chat parse", lambda: client.chat.completions.parse(response_format=City, **chat).choices[0].message.parsed
    yield "responses create", lambda: client.responses.create(model=model, input=ASK, temperature=0,
                                                             max_output_tokens=32).output_text

    def stream():
        with client.responses.stream(model=model, input=ASK, temperature=0, max_output_tokens=32) as events:
            kinds = [event.type for event in events]
            return f"{len(kinds)} events, last {kinds[-1]}: {events.get_final_response().output_text!r}"
    yield "responses stream", stream


def langchain_checks(base: str, model: str):
    from langchain_openai import ChatOpenAI

    for api, responses in (("chat", False), ("responses", True)):
        llm = ChatOpenAI(base_url=base, api_key="unused", model=model, temperature=0, max_tokens=32,
                         use_responses_api=responses)
        yield f"{api} invoke", lambda llm=llm: llm.invoke(ASK).text
        yield f"{api} stream", lambda llm=llm: "".join(chunk.text for chunk in llm.stream(ASK))
        yield f"{api} structured", lambda llm=llm: llm.with_structured_output(City, method="json_schema").invoke(
            CITY_ASK)


def agents_checks(base: str, model: str):
    import openai
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    async def in_agent(use, **kwargs):
        """use(agent) with a client of its own, closed in the event loop that made it (closed later,
        by the garbage collector, it would reach for a loop asyncio.run has closed)."""
        async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
            return await use(Agent(name="check", instructions="Answer in one short sentence.",
                                   model=OpenAIResponsesModel(model=model, openai_client=client), **kwargs))

    async def final_output(agent, question=ASK):
        return (await Runner.run(agent, question)).final_output

    async def streamed(agent):
        result = Runner.run_streamed(agent, ASK)
        count = len([event async for event in result.stream_events()])
        return f"{count} events: {result.final_output!r}"

    settings = ModelSettings(temperature=0, max_tokens=32)
    yield "run", lambda: asyncio.run(in_agent(final_output, model_settings=settings))
    yield "run streamed", lambda: asyncio.run(in_agent(streamed, model_settings=settings))
    tool = dict(tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                model_settings=ModelSettings(temperature=0, max_tokens=48, tool_choice="required"))
    yield "function tool", lambda: asyncio.run(in_agent(lambda a: final_output(a, "Weather in Paris?"), **tool))

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def anthropic_checks(base: str, model: str):
    import anthropic

    client = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key="unused", max_retries=0)
    ask = dict(model=model, max_tokens=32, messages=[{"role": "user", "content": ASK}], extra_body={"temperature": 0})
    yield "messages create", lambda: client.messages.create(**ask).content[0].text

    def stream():
        with client.messages.stream(**ask) as events:
            kinds = [event.type for event in events]
            final = events.get_final_message()
            return f"{len(kinds)} events, stop {final.stop_reason}: {final.content[0].text!r}"
    yield "messages stream", stream
    yield "count tokens", lambda: client.messages.count_tokens(model=model, messages=ask["messages"]).input_tokens

    def tool():
        message = client.messages.create(**{**ask, "max_tokens": 48}, tools=[WEATHER],
                                         tool_choice={"type": "tool", "name": "get_weather"})
        call = message.content[-1]
        return f"{message.stop_reason}: {call.name}({call.input})"
    yield "tool", tool


def langchain_anthropic_checks(base: str, model: str):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(base_url=base.removesuffix("/v1"), api_key="unused", model=model, max_tokens=48,
                        model_kwargs={"extra_body": {"temperature": 0}})
    yield "invoke", lambda: llm.invoke(ASK).text
    yield "stream", lambda: "".join(chunk.text for chunk in llm.stream(ASK))
    yield "structured", lambda: llm.with_structured_output(City).invoke(CITY_ASK)


def litellm_checks(base: str, model: str):
    import litellm

    ask = dict(model=f"hosted_vllm/{model}", api_base=base, api_key="unused", temperature=0, max_tokens=32,
               messages=[{"role": "user", "content": ASK}])
    yield "completion", lambda: litellm.completion(**ask).choices[0].message.content
    yield "stream", lambda: "".join(c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **ask))
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]

    def tool():
        call = litellm.completion(**{**ask, "max_tokens": 48}, tools=tools, tool_choice="required").choices[
            0].message.tool_calls[0].function
        return f"{call.name}({call.arguments})"
    yield "tool", tool


def pydantic_ai_checks(base: str, model: str):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    chat_model = OpenAIChatModel(model, provider=OpenAIProvider(base_url=base, api_key="unused"))
    settings = {"temperature": 0, "max_tokens": 48}
    yield "run", lambda: Agent(chat_model, model_settings=settings).run_sync(ASK).output

    async def streamed():
        async with Agent(chat_model, model_settings=settings).run_stream(ASK) as result:
            return "".join([delta async for delta in result.stream_text(delta=True)])
    yield "run stream", lambda: asyncio.run(streamed())
    # A pydantic output type: by default a forced call of its output tool, arguments checked by pydantic.
    yield "structured", lambda: Agent(chat_model, output_type=City, model_settings=settings).run_sync(CITY_ASK).output


def instructor_checks(base: str, model: str):
    import instructor
    import openai

    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
    ask = dict(model=model, temperature=0, max_tokens=64, max_retries=0, response_model=City,
               messages=[{"role": "user", "content": CITY_ASK}])
    # TOOLS (instructor's default: a named tool_choice) and JSON_SCHEMA (response_format json_schema) hold
    # the output to the schema. Mode.JSON (json_object plus the schema in the prompt) is left out: any
    # JSON object is valid output there, and the 135M default model does not follow the prompt's schema.
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client, mode=mode)
        yield mode.name.lower(), lambda patched=patched: patched.chat.completions.create(**ask)


def llama_index_checks(base: str, model: str):
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import PromptTemplate
    from llama_index.llms.openai_like import OpenAILike

    # is_function_calling_model: structured_predict through a tool. Without it llama-index 0.14 sends
    # tool_choice="required" and no tools, which vLLM and OpenAI answer with a 400, as Ponytail does.
    llm = OpenAILike(model=model, api_base=base, api_key="unused", is_chat_model=True, is_function_calling_model=True,
                     temperature=0, max_tokens=48, max_retries=0)
    yield "complete", lambda: llm.complete(ASK).text
    question = [ChatMessage(role="user", content=ASK)]
    yield "chat", lambda: llm.chat(question).message.content
    yield "stream chat", lambda: "".join(r.delta or "" for r in llm.stream_chat(question))
    yield "structured", lambda: llm.structured_predict(City, PromptTemplate(CITY_ASK))


CLIENTS = [("openai", "openai", openai_checks), ("langchain", "langchain_openai", langchain_checks),
           ("agents", "agents", agents_checks), ("anthropic", "anthropic", anthropic_checks),
           ("langchain-anthropic", "langchain_anthropic", langchain_anthropic_checks),
           ("litellm", "litellm", litellm_checks), ("pydantic-ai", "pydantic_ai", pydantic_ai_checks),
           ("instructor", "instructor", instructor_checks),
           ("llama-index", "llama_index.llms.openai_like", llama_index_checks)]


def installed(module: str) -> bool:
    """Whether `module` (dotted: its parents too) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    parser.add_argument("--model", help="the served name (default: the first of /v1/models)")
    args = parser.parse_args(argv)
    base = args.base_url.rstrip("/") + "/v1"
    model = args.model
    if model is None:
        import openai

        model = openai.OpenAI(base_url=base, api_key="unused").models.list().data[0].id
    failed = 0
    for name, module, checks in CLIENTS:
        if not installed(module):
            print(f"{name}: skipped ({module} is not installed)")
            continue
        for check, run in checks(base, model):
            started = time.perf_counter()
            try:
                result = run()
            except Exception as exc:  # a client's failure is the finding: report it and go on
                failed += 1
                print(f"{name} {check}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                traceback.print_exc(limit=2, file=sys.stderr)
                continue
            print(f"{name} {check}: ok ({time.perf_counter() - started:.2f} s) {result!r:.120}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
