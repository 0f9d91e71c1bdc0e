"""The official `openai` and `anthropic` clients against the API layer, through a mock HTTP transport:
what the SDKs send parses, and what we answer (JSON and event streams) is what the SDKs read back as
the text, tool calls, stop reasons and usage of the generation. Then the turn goes back to the
gateway in the next request, the way agents send it, and is recognised as the turn it recorded.

Only the wire format is checked here; the gateway against a real vLLM is tested end to end elsewhere.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from rollstream.services.gateway.apis.anthropic_messages import (
    count_tokens_response,
    messages_response,
    messages_sse,
    parse_count_tokens,
    parse_messages,
    thinking_signature,
)
from rollstream.services.gateway.apis.canonical import (
    ChatRequest,
    FinishReason,
    Generation,
    StreamEnd,
    StreamEvent,
    assistant_message,
    message_key,
    split_turn,
)
from rollstream.services.gateway.apis.errors import anthropic_error, openai_error
from rollstream.services.gateway.apis.openai_chat import (
    chat_completion_response,
    chat_completion_sse,
    parse_chat_completions,
)
from rollstream.services.gateway.apis.openai_responses import parse_responses
from rollstream.services.gateway.apis.openai_responses_output import responses_response, responses_sse
from rollstream.services.gateway.apis.streaming import ToolCallStreamParser, TurnStreamParser
from rollstream.shared.errors import RollstreamError

TURN = 3
SAMPLED = ('I will check both cities.\n'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
           '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>')
AFTER_A_CALL = ('Looking first.\n'
                '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
                'Then I will compare.')
PARIS_AND_ZURICH = [("call_3_0", "get_weather", {"city": "Paris", "unit": "celsius"}),
                    ("call_3_1", "get_weather", {"city": "Zürich"})]
PLAIN = "It is sunny in Paris."
REASONED = ('<think>\nThe user wants Paris. I should call the tool.\n</think>\n\n'
            'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
REASONING = "The user wants Paris. I should call the tool."
PARSERS = {"/v1/chat/completions": parse_chat_completions, "/v1/responses": parse_responses,
           "/v1/messages": parse_messages, "/v1/messages/count_tokens": parse_count_tokens}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                  "required": ["city"]}


def generation(text: str, finish: FinishReason = "stop", stop_sequence: str | None = None) -> Generation:
    reasoning, content, calls = split_turn(text, TURN)
    return Generation(content, calls, finish, prompt_tokens=57, completion_tokens=21,
                      stop_sequence=stop_sequence, reasoning=reasoning)


def recorded(text: str) -> dict[str, Any]:
    """The assistant message the gateway records for a sampled turn."""
    reasoning, content, calls = split_turn(text, TURN)
    return assistant_message(content, calls, reasoning)


def recorded_key(text: str) -> tuple:
    return message_key(recorded(text))


async def stream_events(text: str, finish: FinishReason = "stop", stop_sequence: str | None = None,
                        piece: int = 4) -> AsyncIterator[StreamEvent]:
    """The events the core feeds the SSE builders while sampling `text`, a few characters a token."""
    parser = TurnStreamParser(TURN)
    for start in range(0, len(text), piece):
        for event in parser.feed(text[start:start + piece]):
            yield event
    for event in parser.finish():
        yield event
    yield StreamEnd(finish, prompt_tokens=57, completion_tokens=21, stop_sequence=stop_sequence)


async def failing_events() -> AsyncIterator[StreamEvent]:
    for event in ToolCallStreamParser(TURN).feed("Partial answer"):
        yield event
    raise ConnectionError("vLLM server went away")


def sse_text(stream: AsyncIterator[str]) -> str:
    async def join() -> str:
        return "".join([chunk async for chunk in stream])
    return asyncio.run(join())


class Gateway:
    """Stands in for the gateway's HTTP layer: every request the SDK sends is parsed by the API layer
    (kept in `requests`), and answered with what `answer(request)` returns: a JSON body, or the
    text of an event stream. A request the parser refuses gets the API's error body."""

    def __init__(self, answer: Callable[[ChatRequest], dict[str, Any] | str]) -> None:
        self.answer = answer
        self.requests: list[ChatRequest] = []
        self.transport = httpx2.MockTransport(self.handle)

    def handle(self, http_request: httpx2.Request) -> httpx2.Response:
        path = http_request.url.path
        try:
            request = PARSERS[path](json.loads(http_request.content))
        except RollstreamError as e:
            error_body = anthropic_error(e.status, e.message) if path.startswith("/v1/messages") \
                else openai_error(e.status, e.message, e.param, e.kind)
            return httpx2.Response(e.status, json=error_body)
        self.requests.append(request)
        answer = self.answer(request)
        if isinstance(answer, str):
            return httpx2.Response(200, text=answer, headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json=answer)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(api_key="unused", base_url="http://gateway/v1", max_retries=0,
                             http_client=httpx2.Client(transport=self.transport))

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(api_key="unused", base_url="http://gateway", max_retries=0,
                                   http_client=httpx2.Client(transport=self.transport))


# --- OpenAI Chat Completions ----------------------------------------------------------------------

CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather.",
                                                "parameters": WEATHER_SCHEMA}}]
CHAT_MESSAGES = [{"role": "system", "content": "You are a weather agent."},
                 {"role": "user", "content": "Weather in Paris and Zürich?"}]


def chat_gateway(text: str, finish: FinishReason = "stop") -> Gateway:
    def answer(request: ChatRequest) -> dict[str, Any] | str:
        if request.stream:
            return sse_text(chat_completion_sse(stream_events(text, finish), model=request.model,
                                                response_id="chatcmpl-1", created=1700000000,
                                                include_usage=request.include_usage,
                                                freeform_tools=request.freeform_tools))
        return chat_completion_response(generation(text, finish), model=request.model,
                                        response_id="chatcmpl-1", created=1700000000,
                                        freeform_tools=request.freeform_tools)
    return Gateway(answer)


def test_openai_chat_completion_with_tool_calls_and_the_next_turn():
    gateway = chat_gateway(SAMPLED)
    client = gateway.openai()
    completion = client.chat.completions.create(model="policy", messages=CHAT_MESSAGES, tools=CHAT_TOOLS,
                                                max_completion_tokens=300, temperature=0.8, stop=["</done>"])
    choice = completion.choices[0]
    assert choice.message.content == "I will check both cities."
    assert [(call.id, call.function.name, json.loads(call.function.arguments))
            for call in choice.message.tool_calls] == PARIS_AND_ZURICH
    assert choice.finish_reason == "tool_calls"
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (57, 21, 78)
    first = gateway.requests[0]
    assert (first.messages, first.tools, first.max_tokens, first.temperature, first.stop) == \
        (CHAT_MESSAGES, CHAT_TOOLS, 300, 0.8, ["</done>"])

    # the usual agent loop: the SDK's message object appended as it is, then one result per call
    client.chat.completions.create(model="policy", tools=CHAT_TOOLS, messages=[
        *CHAT_MESSAGES, choice.message,
        *({"role": "tool", "tool_call_id": call.id, "content": "20C"} for call in choice.message.tool_calls)])
    echoed = gateway.requests[1].messages
    assert message_key(echoed[2]) == recorded_key(SAMPLED)
    assert [(m["role"], m["name"]) for m in echoed[3:]] == [("tool", "get_weather")] * 2


def test_openai_chat_turn_sent_back_as_a_plain_dict_with_reformatted_arguments():
    gateway = chat_gateway(SAMPLED)
    client = gateway.openai()
    message = client.chat.completions.create(model="policy", messages=CHAT_MESSAGES, tools=CHAT_TOOLS) \
        .choices[0].message
    resent = {"role": "assistant", "content": message.content + "\n", "tool_calls": [
        {"id": f"client-{i}", "type": "function",
         "function": {"name": call.function.name,
                      "arguments": json.dumps(json.loads(call.function.arguments), indent=2, sort_keys=True)}}
        for i, call in enumerate(message.tool_calls)]}
    client.chat.completions.create(model="policy", tools=CHAT_TOOLS, messages=[*CHAT_MESSAGES, resent])
    assert message_key(gateway.requests[1].messages[2]) == recorded_key(SAMPLED)


def test_openai_chat_stream_read_chunk_by_chunk():
    client = chat_gateway(SAMPLED).openai()
    chunks = list(client.chat.completions.create(model="policy", messages=CHAT_MESSAGES, tools=CHAT_TOOLS,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
    assert content == "I will check both cities."
    assert [call.index for call in calls] == [0, 1]
    assert [(call.id, call.function.name, json.loads(call.function.arguments)) for call in calls] == \
        PARIS_AND_ZURICH
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish_reasons == ["tool_calls"]
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (57, 21)


def test_openai_chat_stream_without_usage_has_no_usage_chunk():
    chunks = list(chat_gateway(PLAIN).openai().chat.completions.create(model="policy", messages=CHAT_MESSAGES,
                                                                       stream=True))
    assert all(c.choices and c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == PLAIN
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_chat_stream_helper_accumulates_the_final_completion():
    client = chat_gateway(SAMPLED).openai()
    with client.chat.completions.stream(model="policy", messages=CHAT_MESSAGES, tools=CHAT_TOOLS) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "I will check both cities."
    assert [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Zürich"})]
    assert final.choices[0].finish_reason == "tool_calls"


def test_openai_chat_cut_off_turn_says_length():
    client = chat_gateway(PLAIN, finish="length").openai()
    completion = client.chat.completions.create(model="policy", messages=CHAT_MESSAGES)
    assert completion.choices[0].finish_reason == "length"


def test_openai_chat_bad_request_raises_the_sdk_error_with_our_message():
    client = chat_gateway(PLAIN).openai()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="policy", messages=CHAT_MESSAGES, n=3)
    assert caught.value.status_code == 400
    assert caught.value.body["message"].startswith("n must be 1 (got 3)")
    assert caught.value.body["param"] == "n"


def test_openai_chat_reasoning_comes_back_as_reasoning_content_and_round_trips():
    gateway = chat_gateway(REASONED)
    client = gateway.openai()
    message = client.chat.completions.create(model="policy", messages=CHAT_MESSAGES, tools=CHAT_TOOLS,
                                             reasoning_effort="high").choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == ("Checking.", REASONING)
    assert gateway.requests[0].thinking is True
    chunks = list(client.chat.completions.create(model="policy", messages=CHAT_MESSAGES, tools=CHAT_TOOLS,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == "Checking."

    client.chat.completions.create(model="policy", tools=CHAT_TOOLS, messages=[
        *CHAT_MESSAGES, message,
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "20C"}])
    echoed = gateway.requests[-1].messages[2]
    assert message_key(echoed) == recorded_key(REASONED)
    assert echoed["reasoning_content"] == REASONING


def test_openai_chat_failure_inside_the_stream_raises_in_the_sdk():
    gateway = Gateway(lambda request: sse_text(chat_completion_sse(failing_events(), model="policy",
                                                                   response_id="chatcmpl-1", created=0)))
    with pytest.raises(openai.APIError, match="generation failed: ConnectionError: vLLM server went away"):
        list(gateway.openai().chat.completions.create(model="policy", messages=CHAT_MESSAGES, stream=True))


# --- OpenAI Responses -----------------------------------------------------------------------------

RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather.",
                    "parameters": WEATHER_SCHEMA, "strict": False}]


def responses_gateway(text: str, finish: FinishReason = "stop") -> Gateway:
    def answer(request: ChatRequest) -> dict[str, Any] | str:
        if request.stream:
            return sse_text(responses_sse(stream_events(text, finish), request, response_id="resp_1",
                                          created=1700000000))
        return responses_response(generation(text, finish), request, response_id="resp_1", created=1700000000)
    return Gateway(answer)


def function_calls(output: list) -> list[tuple[str, str, dict]]:
    return [(item.call_id, item.name, json.loads(item.arguments))
            for item in output if item.type == "function_call"]


def test_openai_responses_with_function_calls_and_the_next_turn():
    gateway = responses_gateway(SAMPLED)
    client = gateway.openai()
    response = client.responses.create(model="policy", instructions="You are a weather agent.",
                                       input="Weather in Paris and Zürich?", tools=RESPONSES_TOOLS,
                                       max_output_tokens=300)
    assert response.output_text == "I will check both cities."
    assert function_calls(response.output) == PARIS_AND_ZURICH
    assert (response.status, response.usage.input_tokens, response.usage.output_tokens,
            response.usage.total_tokens) == ("completed", 57, 21, 78)
    assert gateway.requests[0].messages == CHAT_MESSAGES

    # the documented loop: the output items appended to the input, then one output per call
    history = [{"role": "user", "content": "Weather in Paris and Zürich?"}, *response.output,
               *({"type": "function_call_output", "call_id": call_id, "output": "20C"}
                 for call_id, _, _ in function_calls(response.output))]
    client.responses.create(model="policy", instructions="You are a weather agent.", input=history,
                            tools=RESPONSES_TOOLS)
    echoed = gateway.requests[1].messages
    assert message_key(echoed[2]) == recorded_key(SAMPLED)
    assert [(m["role"], m["tool_call_id"], m["name"]) for m in echoed[3:]] == \
        [("tool", "call_3_0", "get_weather"), ("tool", "call_3_1", "get_weather")]


@pytest.mark.parametrize("text", [SAMPLED, AFTER_A_CALL, PLAIN])
def test_openai_responses_stream_gives_the_final_response_and_the_turn_round_trips(text):
    gateway = responses_gateway(text)
    client = gateway.openai()
    with client.responses.stream(model="policy", input="Weather?", tools=RESPONSES_TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    _, content, calls = split_turn(text, TURN)
    assert final.output_text == content
    assert function_calls(final.output) == [(call.id, call.name, call.arguments) for call in calls]
    assert (final.status, final.usage.input_tokens, final.usage.output_tokens) == ("completed", 57, 21)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == content

    client.responses.create(model="policy", input=[{"role": "user", "content": "Weather?"}, *final.output])
    assert message_key(gateway.requests[1].messages[1]) == recorded_key(text)


def test_openai_responses_stream_event_sequence():
    client = responses_gateway(SAMPLED).openai()
    with client.responses.stream(model="policy", input="Weather?", tools=RESPONSES_TOOLS) as stream:
        types = [event.type for event in stream]
    deduplicated = [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]
    assert deduplicated == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]


def test_openai_responses_cut_off_turn_is_incomplete():
    client = responses_gateway(PLAIN, finish="length").openai()
    response = client.responses.create(model="policy", input="Weather?")
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    with client.responses.stream(model="policy", input="Weather?") as stream:
        last = list(stream)[-1]
    assert (last.type, last.response.status) == ("response.incomplete", "incomplete")
    assert last.response.output_text == PLAIN


def test_openai_responses_previous_response_id_is_refused_with_the_reason():
    with pytest.raises(openai.BadRequestError, match="send the whole conversation in `input`"):
        responses_gateway(PLAIN).openai().responses.create(model="policy", input="And now?",
                                                           previous_response_id="resp_0")


def test_openai_responses_failure_inside_the_stream_ends_it_as_failed():
    gateway = Gateway(lambda request: sse_text(responses_sse(failing_events(), request, response_id="resp_1",
                                                             created=0)))
    with gateway.openai().responses.stream(model="policy", input="Weather?") as stream:
        last = list(stream)[-1]
    assert (last.type, last.response.status) == ("response.failed", "failed")
    assert last.response.error.message == "generation failed: ConnectionError: vLLM server went away"


AGENTS_NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.", "strict": False,
     "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}}]}
DELEGATED = ('<think>\nThe tests are slow: delegate them.\n</think>\n\nDelegating.\n'
             '<tool_call>{"name": "multi_agent_v1.spawn_agent", '
             '"arguments": {"task": "run the tests"}}</tool_call>')


def test_openai_responses_reasoning_and_a_namespaced_call_round_trip_as_codex_sends_them():
    gateway = responses_gateway(DELEGATED)
    client = gateway.openai()
    request = dict(model="policy", input=[{"role": "developer", "content": "Be brief."},
                                          {"role": "user", "content": "Split the work."}],
                   tools=[AGENTS_NAMESPACE, {"type": "web_search"}], reasoning={"summary": "auto"},
                   include=["reasoning.encrypted_content"], store=False, parallel_tool_calls=True)
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    reasoning, message, call = final.output
    assert reasoning.type == "reasoning"
    assert [part.text for part in reasoning.summary] == [part.text for part in reasoning.content] == \
        ["The tests are slow: delegate them."]
    assert reasoning.encrypted_content
    assert (message.type, final.output_text) == ("message", "Delegating.")
    assert (call.type, call.name, call.namespace, json.loads(call.arguments)) == \
        ("function_call", "spawn_agent", "multi_agent_v1", {"task": "run the tests"})
    assert final.metadata == {"rollstream_ignored_tools": "web_search"}
    for kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
        assert "".join(e.delta for e in events if e.type == kind) == "The tests are slow: delegate them."
    assert [event.sequence_number for event in events] == list(range(len(events)))
    whole = client.responses.create(**request)
    assert (whole.output[0], whole.output_text) == (reasoning, "Delegating.")
    assert (whole.output[2].name, whole.output[2].namespace, whole.output[2].arguments) == \
        (call.name, call.namespace, call.arguments)

    # Codex sends the reasoning item back without its reasoning_text (it keeps the summary and the
    # encrypted copy), the call with its namespace, then the call's output.
    sent_back = {"type": "reasoning", "id": reasoning.id, "encrypted_content": reasoning.encrypted_content,
                 "summary": [part.model_dump() for part in reasoning.summary]}
    client.responses.create(**{**request, "input": [
        *request["input"], sent_back, message, call,
        {"type": "function_call_output", "call_id": call.call_id, "output": "agent a1 started"}]})
    echoed = gateway.requests[-1].messages
    assert message_key(echoed[2]) == recorded_key(DELEGATED)
    assert echoed[2]["reasoning_content"] == "The tests are slow: delegate them."
    assert (echoed[3]["role"], echoed[3]["name"]) == ("tool", "multi_agent_v1.spawn_agent")


PATCH = "*** Begin Patch\n*** Update File: calc.py\n-    return a - b\n+    return a + b\n*** End Patch"
PATCHED = ("Patching.\n"
           f'<tool_call>{json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}})}</tool_call>')
PATCH_GRAMMAR = {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)+/'}


def test_openai_responses_custom_tool_is_a_function_of_its_input_and_its_call_round_trips():
    gateway = responses_gateway(PATCHED)
    client = gateway.openai()
    request = dict(model="policy", input="Fix add.", tools=[
        {"type": "custom", "name": "apply_patch", "description": "Edit files.", "format": PATCH_GRAMMAR}])
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (shown,) = gateway.requests[0].tools
    assert shown["function"]["name"] == "apply_patch"
    assert shown["function"]["parameters"]["required"] == ["input"]
    shown_input = shown["function"]["parameters"]["properties"]["input"]
    assert PATCH_GRAMMAR["definition"] in shown_input["description"]
    message, call = final.output
    assert (call.type, call.name, call.input) == ("custom_tool_call", "apply_patch", PATCH)
    assert "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta") == PATCH
    assert client.responses.create(**request).output[1] == call

    # Codex sends the call back as it got it, then the patch tool's output
    client.responses.create(**{**request, "input": [
        {"role": "user", "content": "Fix add."}, message, call,
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Success."}]})
    echoed = gateway.requests[-1].messages
    assert message_key(echoed[1]) == recorded_key(PATCHED)
    assert (echoed[2]["role"], echoed[2]["name"], echoed[2]["content"]) == ("tool", "apply_patch", "Success.")


def test_openai_chat_custom_tool_call_comes_back_as_a_custom_call_and_round_trips():
    gateway = chat_gateway(PATCHED)
    client = gateway.openai()
    tools = [{"type": "custom", "custom": {"name": "apply_patch", "description": "Edit files.",
                                           "format": {"type": "text"}}}]
    messages = [{"role": "user", "content": "Fix add."}]
    completion = client.chat.completions.create(model="policy", messages=messages, tools=tools)
    message = completion.choices[0].message
    (call,) = message.tool_calls
    assert (call.type, call.custom.name, call.custom.input) == ("custom", "apply_patch", PATCH)
    chunks = list(client.chat.completions.create(model="policy", messages=messages, tools=tools, stream=True))
    (streamed,) = [delta for chunk in chunks for delta in chunk.choices[0].delta.tool_calls or ()]
    assert (streamed.type, streamed.custom) == ("custom", {"name": "apply_patch", "input": PATCH})

    client.chat.completions.create(model="policy", tools=tools, messages=[
        *messages, message, {"role": "tool", "tool_call_id": call.id, "content": "Success."}])
    echoed = gateway.requests[-1].messages
    assert message_key(echoed[1]) == recorded_key(PATCHED)
    assert echoed[2]["name"] == "apply_patch"


# --- Anthropic Messages ---------------------------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Current weather.", "input_schema": WEATHER_SCHEMA}]
ANTHROPIC_MESSAGES = [{"role": "user", "content": "Weather in Paris and Zürich?"}]


def anthropic_gateway(text: str, finish: FinishReason = "stop", stop_sequence: str | None = None) -> Gateway:
    def answer(request: ChatRequest) -> dict[str, Any] | str:
        if request.max_tokens is None:
            return count_tokens_response(57)
        if request.stream:
            return sse_text(messages_sse(stream_events(text, finish, stop_sequence), model=request.model,
                                         message_id="msg_1", prompt_tokens=57))
        return messages_response(generation(text, finish, stop_sequence), model=request.model,
                                 message_id="msg_1")
    return Gateway(answer)


def tool_uses(content: list) -> list[tuple[str, str, dict]]:
    return [(block.id, block.name, block.input) for block in content if block.type == "tool_use"]


def test_anthropic_message_with_tool_use_and_the_next_turn():
    gateway = anthropic_gateway(SAMPLED)
    client = gateway.anthropic()
    message = client.messages.create(model="policy", max_tokens=300, system="You are a weather agent.",
                                     messages=ANTHROPIC_MESSAGES, tools=ANTHROPIC_TOOLS,
                                     tool_choice={"type": "auto"}, stop_sequences=["</done>"])
    assert [block.text for block in message.content if block.type == "text"] == ["I will check both cities."]
    assert tool_uses(message.content) == PARIS_AND_ZURICH
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (57, 21)
    first = gateway.requests[0]
    assert (first.messages, first.tools, first.max_tokens, first.stop) == (CHAT_MESSAGES, CHAT_TOOLS, 300,
                                                                           ["</done>"])

    # the documented loop: the message's content sent back, then a user turn of tool results
    results = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block_id, "content": "20C"}
                                           for block_id, _, _ in tool_uses(message.content)]}
    client.messages.create(model="policy", max_tokens=300, system="You are a weather agent.",
                           tools=ANTHROPIC_TOOLS, messages=[*ANTHROPIC_MESSAGES, message.to_param(), results])
    echoed = gateway.requests[1].messages
    assert message_key(echoed[2]) == recorded_key(SAMPLED)
    assert [(m["role"], m["name"]) for m in echoed[3:]] == [("tool", "get_weather")] * 2


@pytest.mark.parametrize("text", [SAMPLED, AFTER_A_CALL, PLAIN])
def test_anthropic_stream_gives_the_final_message_and_the_turn_round_trips(text):
    gateway = anthropic_gateway(text)
    client = gateway.anthropic()
    with client.messages.stream(model="policy", max_tokens=300, messages=ANTHROPIC_MESSAGES,
                                tools=ANTHROPIC_TOOLS) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    _, content, calls = split_turn(text, TURN)
    assert streamed_text == "".join(block.text for block in final.content if block.type == "text") == content
    assert tool_uses(final.content) == [(call.id, call.name, call.arguments) for call in calls]
    assert final.stop_reason == ("tool_use" if calls else "end_turn")
    assert (final.usage.input_tokens, final.usage.output_tokens) == (57, 21)

    client.messages.create(model="policy", max_tokens=300, messages=[*ANTHROPIC_MESSAGES, final.to_param()])
    assert message_key(gateway.requests[1].messages[1]) == recorded_key(text)


def test_anthropic_stream_event_sequence():
    client = anthropic_gateway(SAMPLED).anthropic()
    with client.messages.stream(model="policy", max_tokens=300, messages=ANTHROPIC_MESSAGES,
                                tools=ANTHROPIC_TOOLS) as stream:
        events = [(event.type, getattr(event, "index", None)) for event in stream
                  if event.type not in ("text", "input_json")]  # the helper's own derived events
    deduplicated = [e for i, e in enumerate(events) if i == 0 or events[i - 1] != e]
    assert deduplicated == [
        ("message_start", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None),
    ]


@pytest.mark.parametrize("finish, stop_sequence, stop_reason", [
    ("length", None, "max_tokens"), ("stop", "</done>", "stop_sequence"), ("stop", None, "end_turn")])
def test_anthropic_stop_reasons_streamed_and_not(finish, stop_sequence, stop_reason):
    client = anthropic_gateway(PLAIN, finish, stop_sequence).anthropic()
    message = client.messages.create(model="policy", max_tokens=300, messages=ANTHROPIC_MESSAGES,
                                     stop_sequences=["</done>"])
    with client.messages.stream(model="policy", max_tokens=300, messages=ANTHROPIC_MESSAGES) as stream:
        final = stream.get_final_message()
    for result in (message, final):
        assert (result.stop_reason, result.stop_sequence) == (stop_reason, stop_sequence)


def test_anthropic_thinking_streams_as_a_signed_thinking_block_and_round_trips():
    gateway = anthropic_gateway(REASONED)
    client = gateway.anthropic()
    with client.messages.stream(model="policy", max_tokens=32000, messages=ANTHROPIC_MESSAGES,
                                tools=ANTHROPIC_TOOLS, thinking={"type": "adaptive"}) as stream:
        streamed_thinking = "".join(event.thinking for event in stream if event.type == "thinking")
        final = stream.get_final_message()
    assert streamed_thinking == REASONING
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert (final.content[0].thinking, final.content[0].signature) == \
        (REASONING, thinking_signature(REASONING))
    whole = client.messages.create(model="policy", max_tokens=300, messages=ANTHROPIC_MESSAGES,
                                   tools=ANTHROPIC_TOOLS, thinking={"type": "adaptive"})
    assert [block.to_dict(exclude_none=True) for block in whole.content] == \
        [block.to_dict(exclude_none=True) for block in final.content]

    results = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": final.content[2].id,
                                            "content": "20C"}]}
    client.messages.create(model="policy", max_tokens=300, tools=ANTHROPIC_TOOLS,
                           messages=[*ANTHROPIC_MESSAGES, final.to_param(), results])
    echoed = gateway.requests[-1].messages[1]
    assert message_key(echoed) == recorded_key(REASONED)
    assert echoed["reasoning_content"] == REASONING


def test_anthropic_count_tokens():
    gateway = anthropic_gateway(PLAIN)
    counted = gateway.anthropic().messages.count_tokens(model="policy", messages=ANTHROPIC_MESSAGES,
                                                        tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == 57
    assert gateway.requests[0].tools == CHAT_TOOLS


def test_anthropic_bad_request_raises_the_sdk_error_with_our_message():
    client = anthropic_gateway(PLAIN).anthropic()
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="policy", max_tokens=300, messages=[{"role": "user", "content": [
            {"type": "image",
             "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert caught.value.status_code == 400
    assert caught.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "content block type 'image' in a user turn is not supported by this gateway; "
                   "only text and tool_result blocks are"}}


def test_anthropic_failure_inside_the_stream_raises_in_the_sdk():
    gateway = Gateway(lambda request: sse_text(messages_sse(failing_events(), model="policy",
                                                            message_id="msg_1", prompt_tokens=57)))
    client = gateway.anthropic()
    with pytest.raises(anthropic.APIStatusError) as caught, \
            client.messages.stream(model="policy", max_tokens=300, messages=ANTHROPIC_MESSAGES) as stream:
        stream.get_final_message()
    assert caught.value.body == {"type": "error", "error": {
        "type": "api_error", "message": "generation failed: ConnectionError: vLLM server went away"}}


def test_anthropic_client_tools_are_shown_with_the_schemas_anthropic_defines():
    gateway = anthropic_gateway(
        '<tool_call>{"name": "bash", "arguments": {"command": "pytest -q"}}</tool_call>')
    message = gateway.anthropic().messages.create(
        model="policy", max_tokens=300, messages=[{"role": "user", "content": "Run the tests."}],
        tools=[{"type": "bash_20250124", "name": "bash"},
               {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
               {"type": "web_search_20250305", "name": "web_search"}])
    request = gateway.requests[0]
    bash, editor = (tool["function"] for tool in request.tools)
    assert (bash["name"], list(bash["parameters"]["properties"])) == ("bash", ["command", "restart"])
    assert editor["name"] == "str_replace_based_edit_tool"
    assert editor["parameters"]["properties"]["command"]["enum"] == \
        ["view", "create", "str_replace", "insert"]
    assert editor["parameters"]["required"] == ["command", "path"]
    assert request.ignored_tools == ["web_search_20250305"]
    assert tool_uses(message.content) == [("call_3_0", "bash", {"command": "pytest -q"})]

    older = parse_messages({"model": "policy", "max_tokens": 10,
                            "messages": [{"role": "user", "content": "Hi"}],
                            "tools": [{"type": "text_editor_20250124", "name": "str_replace_editor"}]})
    assert "undo_edit" in older.tools[0]["function"]["parameters"]["properties"]["command"]["enum"]
