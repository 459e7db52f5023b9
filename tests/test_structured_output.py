"""The structured-output check (broker/structured_output.py) and the OpenAI doors' formats
(broker/dialects/openai/formats.py), as pure tables."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from broker.dialects.openai.formats import chat_format, responses_format
from broker.dialects.openai.requests import ParamError
from broker.structured_output import (
    JsonSchemaFormat,
    chat_response_format,
    format_kind,
    output_problem,
    schema_instruction,
)
from broker.turns import TurnRequest

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "tunnels": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["city", "tunnels"],
    "additionalProperties": False,
}
FORM: dict[str, Any] = {"type": "json_schema", "name": "tunnels", "schema": SCHEMA}

OUTPUTS: list[tuple[Any, str, str | None]] = [
    ("text", "anything at all", None),
    ("json", '{"a": 1}', None),
    ("json", "[1, 2]", None),
    ("json", "Sure! {", "the answer is not valid JSON"),
    (FORM, '{"city": "Bern", "tunnels": [1, 2]}', None),
    (FORM, '{"city": "Bern"', "the answer is not valid JSON"),
    (FORM, '{"city": "Bern"}', "schema 'tunnels' at $: 'tunnels' is a required property"),
    (FORM, '{"city": "Bern", "tunnels": [1, "x"]}', "at $.tunnels[1]: 'x' is not of type"),
    (FORM, '{"city": 3, "tunnels": []}', "at $.city: 3 is not of type 'string'"),
    (FORM, '{"city": "B", "tunnels": [], "x": 1}', "at $: Additional properties"),
    (FORM, "[]", "at $: [] is not of type 'object'"),
    ({**FORM, "schema": {"$ref": "#/nowhere"}}, "{}", "'tunnels' could not be applied"),
    ({**FORM, "schema": {"$ref": "#"}}, "{}", "could not be applied: maximum recursion"),
]


@pytest.mark.parametrize(("response_format", "text", "problem"), OUTPUTS)
def test_an_answer_is_checked_against_its_format(
    response_format: Any, text: str, problem: str | None
) -> None:
    found = output_problem(response_format, text)
    if problem is None:
        assert found is None
    else:
        assert problem in str(found)


def test_the_native_form_is_validated_and_its_schema_meta_checked() -> None:
    base: dict[str, Any] = {"conversation_id": "c", "messages": [{"role": "user", "content": "x"}]}
    good: list[Any] = ["text", "json", FORM, {**FORM, "strict": True, "description": "d"}]
    for value in good:
        request = TurnRequest.model_validate({**base, "response_format": value})
        dumped = request.model_dump()["response_format"]
        assert dumped == value or {**dumped, **value} == dumped
    bad: list[Any] = [
        "xml",
        {**FORM, "schema": {"type": "nope"}},
        {**FORM, "schema": {"properties": 3}},
        {**FORM, "schema": {"$schema": 3}},
        {**FORM, "schema": {"properties": {"a": {"$ref": "https://example.com/a.json"}}}},
        {**FORM, "name": "has space"},
        {**FORM, "extra": 1},
        {"type": "json_schema", "name": "n"},
        {"type": "json_object"},
    ]
    for value in bad:
        with pytest.raises(ValidationError) as caught:
            TurnRequest.model_validate({**base, "response_format": value})
        assert all(e["loc"][0] == "response_format" for e in caught.value.errors())
    dumped = TurnRequest.model_validate({**base, "response_format": FORM}).model_dump()
    assert dumped["response_format"] == {**FORM, "strict": None, "description": None}
    assert format_kind(JsonSchemaFormat.model_validate(FORM)) == "json_schema"
    assert [format_kind(v) for v in ("text", "json", FORM)] == ["text", "json", "json_schema"]


def test_what_the_adapters_send_for_each_format() -> None:
    assert chat_response_format("text") is None
    assert chat_response_format("json") == {"type": "json_object"}
    assert chat_response_format({**FORM, "strict": True, "description": None}) == {
        "type": "json_schema",
        "json_schema": {"name": "tunnels", "schema": SCHEMA, "strict": True},
    }
    assert schema_instruction("json") == ""
    sentence = schema_instruction({**FORM, "description": "tunnels of a city"})
    assert "named tunnels (tunnels of a city)" in sentence
    assert '"required":["city","tunnels"]' in sentence


OPENAI: dict[str, Any] = {"name": "tunnels", "schema": SCHEMA, "strict": True}
NATIVE: dict[str, Any] = {
    "type": "json_schema",
    "name": "tunnels",
    "schema": SCHEMA,
    "strict": True,
}


def test_the_responses_text_format_maps_onto_the_native_form() -> None:
    assert responses_format(None) == ("text", None)
    assert responses_format({}) == ("text", None)
    assert responses_format({"format": {"type": "text"}}) == ("text", {"format": {"type": "text"}})
    sent = {"format": {"type": "json_object"}}
    assert responses_format(sent) == ("json", sent)
    sent = {"format": {"type": "json_schema", **OPENAI, "description": "d"}}
    assert responses_format(sent) == ({**NATIVE, "description": "d"}, sent)


def test_the_chat_response_format_maps_onto_the_native_form() -> None:
    assert chat_format(None) == "text"
    assert chat_format({"type": "text"}) == "text"
    assert chat_format({"type": "json_object"}) == "json"
    assert chat_format({"type": "json_schema", "json_schema": OPENAI}) == NATIVE


REFUSED: list[tuple[Any, str, str]] = [
    ({"verbosity": "low"}, "text", "text.verbosity"),
    ({"format": "json"}, "text.format", "must be an object"),
    ({"format": {"type": "xml"}}, "text.format", "text.format.type must be one of"),
    ({"format": {"type": "json_object", "schema": {}}}, "text.format", "text.format.schema"),
    ({"format": {"type": "json_schema", "schema": SCHEMA}}, "text.format", "text.format.name"),
    ({"format": {"type": "json_schema", "name": "n"}}, "text.format", "text.format.schema"),
    (
        {"format": {"type": "json_schema", "name": "n", "schema": {"type": 3}}},
        "text.format",
        "not a valid JSON Schema",
    ),
    (
        {"format": {"type": "json_schema", **OPENAI, "strict": "yes"}},
        "text.format",
        "text.format.strict must be a bool",
    ),
]


@pytest.mark.parametrize(("text", "param", "message"), REFUSED)
def test_a_bad_text_format_is_a_400_naming_it(text: Any, param: str, message: str) -> None:
    with pytest.raises(ParamError) as caught:
        responses_format(text)
    assert caught.value.param == param
    assert message in caught.value.message


CHAT_REFUSED: list[tuple[Any, str]] = [
    ({"type": "xml"}, "response_format.type must be one of"),
    ({"type": "json_object", "json_schema": OPENAI}, "response_format.json_schema"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "n"}}, "json_schema.schema"),
    ({"type": "json_schema", "json_schema": {**OPENAI, "x": 1}}, "json_schema.x"),
    (
        {"type": "json_schema", "json_schema": {**OPENAI, "schema": {"required": "a"}}},
        "not a valid JSON Schema",
    ),
]


@pytest.mark.parametrize(("response_format", "message"), CHAT_REFUSED)
def test_a_bad_response_format_is_a_400_naming_it(response_format: Any, message: str) -> None:
    with pytest.raises(ParamError) as caught:
        chat_format(response_format)
    assert caught.value.param == "response_format"
    assert message in caught.value.message
