"""Two agent frameworks pointed at the OpenAI doors of a real broker, whose simulated provider
scripts the model's calls: the OpenAI Agents SDK (Responses) and LangChain's ``ChatOpenAI``
(Chat Completions). Each runs an agent loop with two function tools to its answer (the
framework runs the tools), extracts JSON through its own structured-output API, gets the same
call ids on a retried turn, and meets a connection cut mid-call the way that framework can:
a retry of the same request with the same ``Idempotency-Key`` attaches to the same turn. Each
asks about images with its own message types, and the model is shown them.

No network: the Agents SDK's tracing is off, LangChain's is off unless asked for."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

import httpx
import httpx2  # the openai SDK's own HTTP client
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import ModelBehaviorError
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.tools import BaseTool, StructuredTool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, SecretStr

from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import get_turn, read_sse
from tests.tcp_proxy import CutProxy

set_tracing_disabled(True)  # the Agents SDK would otherwise export traces to OpenAI

SCRIPT = [
    {"name": "get_weather", "args": {"city": "Oslo"}, "after": 2},
    {"name": "get_time", "args": {"zone": "Europe/Oslo"}, "after": 2},
]
QUESTION = "Weather and time in Oslo?"


def simulate(**knobs: Any) -> dict[str, Any]:
    return {"broker": {"params": {"simulate": {"tokens": 6, "tokens_per_s": 0, **knobs}}}}


@pytest.fixture
def broker(broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch) -> RunningBroker:
    for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_API_KEY"):
        monkeypatch.delenv(name, raising=False)  # LangChain traces to LangSmith only when asked
    return broker_factory()


class ToolLog:
    """The tools' runs, as the framework made them."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, dict[str, Any]]] = []

    def weather(self, city: str) -> str:
        self.runs.append(("get_weather", {"city": city}))
        return json.dumps({"sky": "clear", "city": city})

    def time(self, zone: str) -> str:
        self.runs.append(("get_time", {"zone": zone}))
        return "14:05"


class Person(BaseModel):
    name: str
    age: int


PERSON = Person(name="Ada Lovelace", age=36)


class KeyedClient(httpx2.AsyncClient):
    """An HTTP client that sends an ``Idempotency-Key`` made of the request's body (and a
    salt of the application's): a retry of the same request attaches to the same turn, and a
    new request (a new step of the loop, whose input holds the last step's results) starts a
    new one. ``sent`` lists the keys, in order."""

    def __init__(self, salt: str) -> None:
        super().__init__(event_hooks={"request": [self._add_key]}, timeout=20)
        self.salt = salt
        self.sent: list[str] = []

    async def _add_key(self, request: httpx2.Request) -> None:
        if request.method == "POST":
            key = f"{self.salt}-{hashlib.sha256(request.content).hexdigest()[:32]}"
            request.headers["Idempotency-Key"] = key
            self.sent.append(key)


def first_turn_calls(broker: RunningBroker, turn_id: str) -> list[tuple[str, str]]:
    return [(c["call_id"], c["name"]) for c in get_turn(broker.base_url, turn_id)["tool_calls"]]


# --- the OpenAI Agents SDK (Responses) ------------------------------------------------------------


def responses_agent(
    url: str, log: ToolLog, *, client: openai.AsyncOpenAI | None = None, **settings: Any
) -> Agent[Any]:
    sdk = client or openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return Agent(
        name="assistant",
        instructions="Answer with the tools' help.",
        model=OpenAIResponsesModel(model="simulated", openai_client=sdk),
        tools=[
            function_tool(log.weather, name_override="get_weather"),
            function_tool(log.time, name_override="get_time"),
        ],
        model_settings=ModelSettings(**settings),
    )


RUN = RunConfig(tracing_disabled=True)


async def agents_run(agent: Agent[Any], *, streamed: bool = False) -> Any:
    if not streamed:
        return await Runner.run(agent, QUESTION, run_config=RUN)
    result = Runner.run_streamed(agent, QUESTION, run_config=RUN)
    async for _ in result.stream_events():
        pass
    return result


def agents_calls_of(response: Any) -> list[tuple[str, str]]:
    """The (call id, name) of every function call of one model response of a run."""
    return [(i.call_id, i.name) for i in response.output if i.type == "function_call"]


def agents_calls(result: Any) -> list[tuple[str, str]]:
    """The (call id, name) of every function call the run's model responses made."""
    return [call for response in result.raw_responses for call in agents_calls_of(response)]


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_the_agents_sdk_runs_a_loop_with_two_tools_to_its_answer(
    broker: RunningBroker, streamed: bool
) -> None:
    log = ToolLog()
    agent = responses_agent(broker.base_url, log, extra_body=simulate(tool_calls=SCRIPT))
    result = await agents_run(agent, streamed=streamed)
    assert log.runs == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "Europe/Oslo"})]
    # The answer saw both results: the simulator opens it by counting them.
    assert result.final_output.startswith("(2 tool results")
    first, answer = result.raw_responses
    assert agents_calls(result) == first_turn_calls(broker, first.response_id)
    assert [i.type for i in answer.output] == ["message"]


async def test_the_agents_sdk_extracts_json_with_output_type(broker: RunningBroker) -> None:
    agent = Agent(
        name="extractor",
        instructions="Extract the person.",
        model=OpenAIResponsesModel(
            model="simulated",
            openai_client=openai.AsyncOpenAI(
                base_url=f"{broker.base_url}/v1", api_key="unused", max_retries=0
            ),
        ),
        output_type=Person,
        model_settings=ModelSettings(extra_body=simulate(json=PERSON.model_dump())),
    )
    result = await Runner.run(agent, "Ada Lovelace died at 36.", run_config=RUN)
    assert result.final_output == PERSON
    (response,) = result.raw_responses
    assert response.response_id is not None
    text = get_turn(broker.base_url, response.response_id)["canonical"]["text"]
    assert Person.model_validate_json(text) == PERSON


async def test_the_agents_sdk_retries_a_response_cut_mid_call_into_the_same_turn(
    broker: RunningBroker,
) -> None:
    """A non-streamed run whose response is cut while a call's arguments cross the wire: the
    SDK's own retry sends the same request with the same key, attaches to the same turn, and the
    tools run once, with the call ids the broker gave."""
    log = ToolLog()
    with CutProxy(broker.base_url, cut_at=b'"arguments"') as proxy:
        sdk = openai.AsyncOpenAI(
            base_url=f"{proxy.url}/v1",
            api_key="unused",
            max_retries=2,
            http_client=KeyedClient(uuid.uuid4().hex),
        )
        agent = responses_agent(proxy.url, log, client=sdk, extra_body=simulate(tool_calls=SCRIPT))
        result = await agents_run(agent)
        assert proxy.cuts == 1
    # Three requests, two turns: the retry found the turn the cut request had started.
    assert broker.metric("broker_turns_started_total") == 2
    assert broker.metric("broker_turns_deduplicated_total") == 1
    assert log.runs == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "Europe/Oslo"})]
    assert result.final_output.startswith("(2 tool results")
    first = result.raw_responses[0]
    assert agents_calls(result) == first_turn_calls(broker, first.response_id)
    assert get_turn(broker.base_url, first.response_id)["attempt"] == 1


def regenerate(broker: RunningBroker, turn_id: str) -> None:
    """The user's regenerate, through the native API (the OpenAI doors have none)."""
    answer = httpx.post(
        f"{broker.base_url}/v1/turns/{turn_id}/attempts", json={"strategy": "regenerate"}
    )
    assert answer.status_code == 201, answer.text


def streamed_calls(broker: RunningBroker, turn_id: str) -> list[tuple[int, str, str]]:
    """The (attempt, call id, name) of every client call the turn's stream carries."""
    stream_id = get_turn(broker.base_url, turn_id)["stream_id"]
    events = read_sse(broker.base_url, stream_id).events
    return [
        (int(e.data["attempt"]), str(e.data["call_id"]), str(e.data["name"]))
        for e in events
        if e.event == "tool_call" and e.data.get("status") == "client"
    ]


async def test_the_agents_sdk_gets_the_same_call_ids_from_a_regenerated_turn(
    broker: RunningBroker,
) -> None:
    """A turn whose attempt broke right after its call: the SDK refuses the incomplete
    response (it runs no tool); the user regenerates the turn and runs the same request
    again, whose key attaches to the turn: the call comes with the same id, and runs once."""
    log = ToolLog()
    keys = KeyedClient(uuid.uuid4().hex)
    agent = responses_agent(
        broker.base_url,
        log,
        client=openai.AsyncOpenAI(
            base_url=f"{broker.base_url}/v1", api_key="unused", max_retries=0, http_client=keys
        ),
        extra_body=simulate(tool_calls=[SCRIPT[0]], fail_after_tool_calls=1),
    )
    with pytest.raises(ModelBehaviorError, match="incomplete"):
        await agents_run(agent)
    assert log.runs == []
    turn_id = keys.sent[0]
    (before,) = streamed_calls(broker, turn_id)
    regenerate(broker, turn_id)
    result = await agents_run(agent)
    assert keys.sent[1] == turn_id  # the same request: the same turn
    assert log.runs == [("get_weather", {"city": "Oslo"})]
    assert agents_calls(result) == [before[1:]]
    assert streamed_calls(broker, turn_id) == [before, (2, *before[1:])]


# --- LangChain's ChatOpenAI (Chat Completions) ----------------------------------------------------


def chat_model(url: str, **settings: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model="simulated",
        base_url=f"{url}/v1",
        api_key=SecretStr("unused"),
        max_retries=0,
        **{"use_responses_api": False, **settings},
    )


def langchain_tools(log: ToolLog) -> list[BaseTool]:
    return [
        StructuredTool.from_function(log.weather, name="get_weather", description="The weather"),
        StructuredTool.from_function(log.time, name="get_time", description="The time in a zone"),
    ]


def langchain_loop(model: Any, tools: list[BaseTool], conversation: str) -> list[BaseMessage]:
    """LangChain's tool loop: call the model, run the calls it made, send their results, until
    it answers. Each step sends an ``Idempotency-Key`` of its own (the conversation and the
    step), so that a retried step attaches to the turn it started."""
    by_name = {t.name: t for t in tools}
    messages: list[BaseMessage] = [HumanMessage(QUESTION)]
    while True:
        key = f"{conversation}-{len(messages)}"
        reply = model.invoke(messages, extra_headers={"Idempotency-Key": key})
        messages.append(reply)
        if not reply.tool_calls:
            return messages
        for call in reply.tool_calls:
            messages.append(by_name[call["name"]].invoke(call))


def langchain_calls(messages: list[BaseMessage]) -> list[tuple[str, str]]:
    return [
        (call["id"] or "", call["name"])
        for m in messages
        if isinstance(m, AIMessage)
        for call in m.tool_calls
    ]


@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "streaming"])
@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_langchain_runs_a_loop_with_two_tools_to_its_answer(
    broker: RunningBroker, streaming: bool, responses: bool
) -> None:
    """On Chat Completions, as the tests below, and on Responses (``use_responses_api``)."""
    log = ToolLog()
    tools = langchain_tools(log)
    model = chat_model(
        broker.base_url,
        streaming=streaming,
        use_responses_api=responses,
        extra_body=simulate(tool_calls=SCRIPT),
    ).bind_tools(tools)
    conversation = uuid.uuid4().hex
    messages = langchain_loop(model, tools, conversation)
    assert log.runs == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "Europe/Oslo"})]
    assert [type(m).__name__ for m in messages] == [
        "HumanMessage",
        "AIMessage",
        "ToolMessage",
        "ToolMessage",
        "AIMessage",
    ]
    assert messages[-1].text.startswith("(2 tool results")
    assert langchain_calls(messages) == first_turn_calls(broker, f"{conversation}-1")


def test_langchain_extracts_json_with_a_json_schema(broker: RunningBroker) -> None:
    model = chat_model(broker.base_url, extra_body=simulate(json=PERSON.model_dump()))
    extractor = model.with_structured_output(Person, method="json_schema", include_raw=True)
    found: Any = extractor.invoke("Ada Lovelace died at 36.")
    assert found["parsed"] == PERSON
    assert Person.model_validate_json(found["raw"].content) == PERSON


def test_langchain_retries_a_stream_cut_mid_call_into_the_same_turn(
    broker: RunningBroker,
) -> None:
    """A streamed step cut while a call's arguments arrive: LangChain's retry sends the step
    again with its key, which attaches to the turn it started and replays it from its start,
    so the framework assembles each call once, with the broker's ids."""
    log = ToolLog()
    tools = langchain_tools(log)
    with CutProxy(broker.base_url, cut_at=b'"arguments":"{\\"cit') as proxy:
        model = (
            chat_model(proxy.url, streaming=True, extra_body=simulate(tool_calls=SCRIPT))
            .bind_tools(tools)
            .with_retry(
                retry_if_exception_type=(openai.APIConnectionError, httpx2.TransportError),
                stop_after_attempt=2,
                wait_exponential_jitter=False,
            )
        )
        conversation = uuid.uuid4().hex
        messages = langchain_loop(model, tools, conversation)
        assert proxy.cuts == 1
        cut = proxy.bodies()[0]
    assert b'\\"cit' in cut  # the first call had begun,
    assert b'"finish_reason":"tool_calls"' not in cut  # and had not ended
    assert broker.metric("broker_turns_started_total") == 2
    assert broker.metric("broker_turns_deduplicated_total") == 1
    assert log.runs == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "Europe/Oslo"})]
    assert str(messages[-1].content).startswith("(2 tool results")
    assert langchain_calls(messages) == first_turn_calls(broker, f"{conversation}-1")


def test_langchain_gets_the_same_call_ids_from_a_regenerated_turn(broker: RunningBroker) -> None:
    """A step whose attempt broke right after its call ends ``length``: its calls are not to be
    run. The user regenerates the turn and sends the step again with its key, which answers
    with the regenerated attempt: the call comes with the same id."""
    log = ToolLog()
    tools = langchain_tools(log)
    knobs = simulate(tool_calls=[SCRIPT[0]], fail_after_tool_calls=1)
    model = chat_model(broker.base_url, extra_body=knobs).bind_tools(tools)
    turn_id = f"{uuid.uuid4().hex}-1"
    ask: list[BaseMessage] = [HumanMessage(QUESTION)]
    cut = model.invoke(ask, extra_headers={"Idempotency-Key": turn_id})
    assert cut.response_metadata["finish_reason"] == "length"
    regenerate(broker, turn_id)
    again = model.invoke(ask, extra_headers={"Idempotency-Key": turn_id})
    assert again.response_metadata["finish_reason"] == "tool_calls"
    (before, after) = streamed_calls(broker, turn_id)
    assert (before[0], after[0]) == (1, 2)
    assert langchain_calls([cut]) == []  # an interrupted step hands no call to run
    assert langchain_calls([again]) == [before[1:]] == [after[1:]]


# --- the tool options frameworks set ----------------------------------------------------------


async def test_the_agents_sdk_forces_a_named_tool_once_and_one_call_at_a_time(
    broker: RunningBroker,
) -> None:
    """``tool_choice`` naming a tool (the SDK resets it once a tool ran, so the loop ends) and
    ``parallel_tool_calls: false``: the script's call of that tool first, then the other, one
    per step, then the answer."""
    log = ToolLog()
    agent = responses_agent(
        broker.base_url,
        log,
        tool_choice="get_time",
        parallel_tool_calls=False,
        extra_body=simulate(tool_calls=SCRIPT),
    )
    result = await agents_run(agent)
    assert log.runs == [("get_time", {"zone": "Europe/Oslo"}), ("get_weather", {"city": "Oslo"})]
    assert result.final_output.startswith("(1 tool results")
    responses = result.raw_responses
    assert [len(agents_calls_of(r)) for r in responses] == [1, 1, 0]
    for response in responses[:2]:
        assert agents_calls_of(response) == first_turn_calls(broker, str(response.response_id))


def test_langchain_binds_tools_with_a_required_call_one_at_a_time(broker: RunningBroker) -> None:
    """``bind_tools(tool_choice="required", parallel_tool_calls=False)``: each step makes one
    call (the first step must call one), the loop runs both, one per step."""
    log = ToolLog()
    tools = langchain_tools(log)
    model = chat_model(broker.base_url, extra_body=simulate(tool_calls=SCRIPT))
    bound = model.bind_tools(tools, parallel_tool_calls=False)
    first = model.bind_tools(tools, tool_choice="required", parallel_tool_calls=False)
    conversation = uuid.uuid4().hex
    opening = first.invoke(
        [HumanMessage(QUESTION)], extra_headers={"Idempotency-Key": f"{conversation}-r"}
    )
    assert [c["name"] for c in opening.tool_calls] == ["get_weather"]
    messages = langchain_loop(bound, tools, conversation)
    assert log.runs == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "Europe/Oslo"})]
    assert [len(m.tool_calls) for m in messages if isinstance(m, AIMessage)] == [1, 1, 0]
    assert str(messages[-1].content).startswith("(1 tool results")


async def test_a_streamed_run_cut_mid_call_is_run_again_into_the_same_turn(
    broker: RunningBroker,
) -> None:
    """The SDK never retries a stream it has shown events of: a streamed run cut while a
    call's arguments arrive raises. Run again, the same request carries the same key, attaches
    to the turn the cut one started and reads it from its start: the tools run once."""
    log = ToolLog()
    keys = KeyedClient(uuid.uuid4().hex)
    with CutProxy(broker.base_url, cut_at=b"response.function_call_arguments.delta") as proxy:
        sdk = openai.AsyncOpenAI(
            base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, http_client=keys
        )
        agent = responses_agent(proxy.url, log, client=sdk, extra_body=simulate(tool_calls=SCRIPT))
        with pytest.raises(openai.APIConnectionError):
            await agents_run(agent, streamed=True)
        assert (proxy.cuts, log.runs) == (1, [])
        cut = proxy.bodies()[0]
        result = await agents_run(agent, streamed=True)
    assert b"response.function_call_arguments.done" not in cut  # cut mid-arguments
    assert keys.sent[1] == keys.sent[0]  # the same request, the same turn
    assert broker.metric("broker_turns_started_total") == 2
    assert log.runs == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "Europe/Oslo"})]
    assert result.final_output.startswith("(2 tool results")
    assert agents_calls(result) == first_turn_calls(broker, keys.sent[0])


# --- an image question, through each framework's own message types ------------------------------

PNG = (  # a 1x1 PNG, as a data URL
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGA"
    "WjR9awAAAABJRU5ErkJggg=="
)
PHOTO = "https://images.example.com/fjord.jpg"  # never fetched: the model is given the URL


async def test_the_agents_sdk_asks_about_images(broker: RunningBroker) -> None:
    log = ToolLog()
    agent = responses_agent(broker.base_url, log, extra_body=simulate())
    question: Any = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is in these pictures?"},
                {"type": "input_image", "image_url": PNG, "detail": "low"},
                {"type": "input_image", "image_url": PHOTO, "detail": "auto"},
            ],
        }
    ]
    result = await Runner.run(agent, question, run_config=RUN)
    # The simulated model opens its answer by naming the images it was shown.
    assert result.final_output.startswith("(shown 2 images: image/png, images.example.com) ")
    (response,) = result.raw_responses
    assert response.response_id is not None
    turn = get_turn(broker.base_url, response.response_id)
    assert turn["canonical"]["text"] == result.final_output
    assert log.runs == []


def test_langchain_asks_about_an_image(broker: RunningBroker) -> None:
    model = chat_model(broker.base_url, extra_body=simulate())
    question = HumanMessage(
        content=[
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": PHOTO, "detail": "high"}},
        ]
    )
    reply = model.invoke([question])
    assert reply.text.startswith("(shown 1 image: images.example.com) ")
