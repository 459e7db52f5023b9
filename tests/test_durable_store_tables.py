"""The Durable Streams service's pure parts as tables: the ``ds_*`` scripts' replies decoded
into their types, the protocol's spelling of paths, offsets and JSON messages, and the
refusals' codes, statuses and headers. No Redis, no sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import broker
from broker.durable_store import CreateRequest, Meta, errors, protocol
from broker.durable_store.protocol import DEFAULT_TYPE as DEFAULT
from broker.durable_store.replies import (
    Appended,
    Closed,
    ClosedAgain,
    ConfigConflict,
    Duplicate,
    EpochNotAtZero,
    Full,
    Gone,
    Kept,
    Missing,
    Page,
    PastTail,
    QuotaRefused,
    RateRefused,
    Removed,
    SequenceGap,
    SoftDeleted,
    SourceDeleted,
    SourceMissing,
    StaleProducer,
    StreamMade,
    StreamSeqBehind,
    TooDeep,
    TypeMismatch,
    decode_append,
    decode_create,
    decode_delete,
    decode_fork_ref,
    decode_read,
)
from broker.errors import BadRequest, BrokerError, NotFound
from broker.frames import ORIGIN, Cursor
from broker.metrics import Metrics
from broker.scripts import INCLUDE, NAMES, expand, script_source
from broker.settings import Settings

TAIL = Cursor.after("1700000000000-3")


@pytest.mark.parametrize(
    ("reply", "decoded"),
    [
        (["created", "0-0", "", "text/plain"], StreamMade(True, ORIGIN, False, "text/plain")),
        (
            ["exists", "1700000000000-3", "1", "Text/Plain; x=1"],
            StreamMade(False, TAIL, True, "Text/Plain; x=1"),
        ),
        (["exists", "1700000000000-3", None], StreamMade(False, TAIL, False, "")),  # no ctr
        (["conflict", "ttl"], ConfigConflict("ttl")),
        (["conflict", "deleted"], ConfigConflict("deleted")),
        (["rate", "250"], RateRefused(250)),
        (["quota", "streams", "10"], QuotaRefused("streams", 10)),
        (["quota", "bytes", "4096"], QuotaRefused("bytes", 4096)),
        (["source_missing"], SourceMissing()),
        (["source_deleted"], SourceDeleted()),
        (["past_tail"], PastTail()),
        (["too_deep", "16"], TooDeep(16)),
    ],
)
def test_ds_create_replies_decode_to_their_types(reply: list[Any], decoded: object) -> None:
    assert decode_create(reply) == decoded


@pytest.mark.parametrize(
    ("reply", "decoded"),
    [
        (["ok", "1700000000000-3", ""], Appended(TAIL, False)),
        (["ok", "1700000000000-3", "1"], Appended(TAIL, True)),
        (["duplicate", "1700000000000-3", "7", "1"], Duplicate(TAIL, 7, True)),
        (["duplicate", "1700000000000-3", "7", ""], Duplicate(TAIL, 7, False)),
        (["closed_again", "1700000000000-3"], ClosedAgain(TAIL)),
        (["closed", "1700000000000-3"], Closed(TAIL)),
        (["missing"], Missing()),
        (["gone"], Gone()),
        (["content_type", "text/plain"], TypeMismatch("text/plain")),
        (["stale_epoch", "4"], StaleProducer(4)),
        (["epoch_seq"], EpochNotAtZero()),
        (["gap", "3", "5"], SequenceGap(3, 5)),
        (["stream_seq", "b"], StreamSeqBehind("b")),
        (["full", "1000"], Full(1000)),
        (["rate", "1000"], RateRefused(1000)),
        (["quota", "bytes", "64"], QuotaRefused("bytes", 64)),
        # Integers past 64 bits are not at stake: epochs and seqs stop at 2^53-1.
        (["gap", str(2**53 - 1), "0"], SequenceGap(2**53 - 1, 0)),
    ],
)
def test_ds_append_replies_decode_to_their_types(reply: list[Any], decoded: object) -> None:
    assert decode_append(reply) == decoded


@pytest.mark.parametrize(
    ("reply", "decoded"),
    [
        (["missing"], Missing()),
        (["gone"], Gone()),
        (["soft"], SoftDeleted()),
        (["deleted", ""], Removed("")),
        (["deleted", "source/path"], Removed("source/path")),
    ],
)
def test_ds_delete_replies_decode_to_their_types(reply: list[Any], decoded: object) -> None:
    assert decode_delete(reply) == decoded


@pytest.mark.parametrize(
    ("reply", "decoded"),
    [(["kept"], Kept()), (["deleted", ""], Removed("")), (["deleted", "a"], Removed("a"))],
)
def test_ds_fork_ref_replies_decode_to_their_types(reply: list[Any], decoded: object) -> None:
    assert decode_fork_ref(reply) == decoded


@pytest.mark.parametrize(
    ("reply", "decoded"),
    [
        ([[], b"", [], b"tail"], Page(None, "", [], "tail")),
        (
            [[b"text/plain", b"1-0", None], b"1-0", [b"\xff", b""], b"full"],
            Page(["text/plain", "1-0", None], "1-0", [b"\xff", b""], "full"),
        ),
        ([[None, None], b"", [], b"tail"], Page([None, None], "", [], "tail")),
        ([[], b"9-1", [b"a"], b"more"], Page(None, "9-1", [b"a"], "more")),
        ([[], b"9-1", [b"a"], b"ended"], Page(None, "9-1", [b"a"], "ended")),
        ([[], b"", [], b"text"], Page(None, "", [], "text")),
    ],
)
def test_ds_read_replies_decode_to_a_page(reply: list[Any], decoded: Page) -> None:
    assert decode_read(reply) == decoded


def test_a_ds_read_word_it_does_not_answer_is_a_broker_error() -> None:
    with pytest.raises(BrokerError, match="unexpected reply 'later' of ds_read"):
        decode_read([[], b"", [], b"later"])


@pytest.mark.parametrize(
    ("decode", "reply"),
    [
        (decode_create, ["ok", "0-0", ""]),  # ds_append's word, not ds_create's
        (decode_create, ["quota", "appends", "1"]),
        (decode_append, ["created", "0-0", "", ""]),
        (decode_delete, ["kept"]),
        (decode_fork_ref, ["soft"]),
    ],
)
def test_a_word_a_script_does_not_answer_is_a_broker_error(decode: Any, reply: list[Any]) -> None:
    with pytest.raises(BrokerError) as caught:
        decode(reply)
    assert caught.value.status == 500
    assert repr(reply[0]) in caught.value.message


@pytest.mark.parametrize(
    ("entry_id", "offset"),
    [
        ("0-0", "0000000000000000_0000000000000000"),
        ("1700000000000-3", "0001700000000000_0000000000000003"),
        ("9999999999999999-9999999999999999", "9999999999999999_9999999999999999"),
    ],
)
def test_an_offset_spells_its_entry_id_both_ways(entry_id: str, offset: str) -> None:
    assert protocol.offset_of(Cursor.after(entry_id)) == offset
    assert protocol.cursor_of(offset) == Cursor.after(entry_id)


@pytest.mark.parametrize(
    "offset", ["", "-1", "now", "1700000000000-3", "0001700000000000-0000000000000003", "x" * 99]
)
def test_a_malformed_offset_is_a_400(offset: str) -> None:
    with pytest.raises(BadRequest) as caught:
        protocol.cursor_of(offset)
    assert caught.value.code == "bad_offset"


@pytest.mark.parametrize(
    ("offset", "cursor"),
    [
        ("now", None),
        ("-1", ORIGIN),
        ("0001700000000000_0000000000000003", TAIL),
    ],
)
def test_a_read_starts_at_its_offset(offset: str, cursor: Cursor | None) -> None:
    assert protocol.start_cursor(offset) == cursor


@pytest.mark.parametrize(
    ("path", "found"),
    [
        ("notes", True),
        ("a/b/c", True),
        ("ünï ?#%", True),
        ("x" * 1_024, True),
        ("x" * 1_025, False),
        ("", False),
        ("a\nb", False),
        ("a\x7fb", False),
        ("__ds", False),
        ("__ds/subscriptions", False),
        ("__dsx", True),
    ],
)
def test_which_paths_a_stream_may_have(path: str, found: bool) -> None:
    if found:
        assert protocol.checked_path(path) == path
    else:
        with pytest.raises(NotFound):
            protocol.checked_path(path)


@pytest.mark.parametrize(
    ("value", "media"),
    [
        (None, ""),
        ("", ""),
        ("Text/Plain; charset=utf-8", "text/plain"),
        (" application/JSON ", "application/json"),
    ],
)
def test_a_content_type_compares_by_its_media_type(value: str | None, media: str) -> None:
    assert protocol.media_type(value) == media


@pytest.mark.parametrize(
    ("body", "allow_empty", "kept"),
    [
        (b'{"a": 1}', False, b'{"a":1}'),
        (b'[{"a": 1}, 2, "x"]', False, b'{"a":1},2,"x"'),
        (b"[[1, 2]]", False, b"[1,2]"),  # one level flattened
        (b"[]", True, b""),
        # Integers past 64 bits are kept exact (orjson alone would round them to a float).
        (b"[123456789012345678901234567890]", False, b"123456789012345678901234567890"),
        (
            b'{"n": -99999999999999999999, "s": "\xc3\xa9"}',
            False,
            b'{"n":-99999999999999999999,"s":"\xc3\xa9"}',
        ),
        (b'{"n": 9223372036854775807}', False, b'{"n":9223372036854775807}'),
        (b'{"f": 1.2345678901234567890}', False, b'{"f":1.2345678901234567}'),
    ],
)
def test_json_messages_are_kept_compact(body: bytes, allow_empty: bool, kept: bytes) -> None:
    assert protocol.json_messages(body, allow_empty=allow_empty) == kept


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"[]", "empty_append"),
        (b"{", "bad_json"),
        (b"NaN", "bad_json"),
        (b"[" * 200, "json_too_deep"),
    ],
)
def test_a_json_body_that_appends_nothing_is_a_400(body: bytes, code: str) -> None:
    with pytest.raises(BadRequest) as caught:
        protocol.json_messages(body, allow_empty=False)
    assert caught.value.code == code


@pytest.mark.parametrize(
    ("payload", "count", "json", "part"),
    [
        (b"hello", 2, False, b"he"),
        (b"hello", 5, False, b"hello"),
        (b'{"a":1},2,"x"', 2, True, b'{"a":1},2'),
        (b'{"a":1},2,"x"', 0, True, b""),
    ],
)
def test_a_sub_offset_cuts_bytes_or_values(
    payload: bytes, count: int, json: bool, part: bytes
) -> None:
    assert protocol.prefix(payload, count, json=json) == part


@pytest.mark.parametrize(("payload", "count", "json"), [(b"hi", 3, False), (b"1,2", 3, True)])
def test_a_sub_offset_past_the_append_is_a_400(payload: bytes, count: int, json: bool) -> None:
    with pytest.raises(BadRequest) as caught:
        protocol.prefix(payload, count, json=json)
    assert caught.value.code == "bad_fork"


@pytest.mark.parametrize(
    ("field", "value", "data"),
    [
        (b"b", bytes(range(256)), bytes(range(256))),  # as they are
        (b"b", b"", b""),
        (b"d", bytes(range(256)).decode("latin-1").encode(), bytes(range(256))),  # older streams
        (b"d", "caf\u00c3\u00a9".encode(), "caf\u00e9".encode()),  # UTF-8 text, kept as Latin-1
    ],
)
def test_a_payload_is_its_bytes_in_either_format(field: bytes, value: bytes, data: bytes) -> None:
    assert protocol.payload(field, value) == data


@pytest.mark.parametrize(
    ("error", "status", "code", "headers"),
    [
        (
            errors.closed(TAIL),
            409,
            "stream_closed",
            {"Stream-Next-Offset": "0001700000000000_0000000000000003", "Stream-Closed": "true"},
        ),
        (errors.stale_epoch(4), 403, "stale_epoch", {"Producer-Epoch": "4"}),
        (
            errors.sequence_gap(3, 5),
            409,
            "sequence_gap",
            {"Producer-Expected-Seq": "3", "Producer-Received-Seq": "5"},
        ),
        (errors.full(10), 413, "stream_full", {}),
        (errors.deleted(), 410, "deleted", {}),
        (errors.epoch_not_at_zero(), 400, "bad_producer", {}),
        (errors.stream_seq_behind("b"), 409, "sequence_conflict", {}),
        (errors.type_mismatch("text/plain"), 409, "type_mismatch", {}),
    ],
)
def test_each_refusal_has_its_status_code_and_headers(
    error: BrokerError, status: int, code: str, headers: dict[str, str]
) -> None:
    assert (error.status, error.code, error.headers) == (status, code, headers)


@pytest.mark.parametrize(
    ("reply", "status", "code", "label", "headers"),
    [
        (RateRefused(1), 429, "rate_limited", "rate", {"Retry-After": "1"}),
        (RateRefused(2_500), 429, "rate_limited", "rate", {"Retry-After": "3"}),
        (QuotaRefused("streams", 5), 429, "stream_quota", "streams", {}),
        (QuotaRefused("bytes", 64), 429, "byte_quota", "bytes", {}),
    ],
)
def test_a_quota_refusal_names_its_setting_and_is_counted(
    reply: RateRefused | QuotaRefused, status: int, code: str, label: str, headers: dict[str, str]
) -> None:
    metrics = Metrics()
    settings = Settings(redis_url="unix:///unused")
    error = errors.refusal(reply, settings, metrics)
    assert (error.status, error.code, error.headers) == (status, code, headers)
    assert "BROKER_DS_TENANT_" in error.message
    assert metrics.ds_refusals.labels(label)._value.get() == 1


PART = "local function f() end\nlocal function g() end\n"
PARTS = {"_p": PART}


@pytest.mark.parametrize(
    ("text", "expanded"),
    [
        ("return 1\n", "return 1\n"),
        (
            "--! include _p\nreturn f()\n",
            "local function f() end\nlocal function g() end\nreturn f()\n",
        ),
        ("-- see --! include _p\n", "-- see --! include _p\n"),  # only a line of its own
        ("--! include _p \n", "--! include _p \n"),  # spelled exactly, or left alone
        (
            "--! include _p\n--! include _p\n",
            "local function f() end\nlocal function g() end\n" * 2,
        ),
    ],
)
def test_a_script_includes_a_part_in_place_of_its_line(text: str, expanded: str) -> None:
    assert expand(text, PARTS.__getitem__) == expanded


@pytest.mark.parametrize("name", NAMES)
def test_every_script_is_whole_once_its_parts_are_in_place(name: str) -> None:
    source = script_source(name)
    assert INCLUDE.search(source) is None
    for function in ("clock_ms", "int", "release", "prune", "take_token"):
        assert source.count(f"local function {function}(") <= 1


def test_the_quota_accounting_is_written_once_for_the_scripts_that_share_it() -> None:
    lua = Path(broker.__file__).parent / "lua"
    for name in ("ds_create", "ds_append", "ds_delete"):
        own = (lua / f"{name}.lua").read_text("utf-8")
        assert "--! include _ds_quota\n" in own
        assert "local function release(" not in own
        assert "local function release(" in script_source(name)
    assert "_ds_quota" not in NAMES  # a part, never registered as a script


SOURCE = Meta("text/plain; charset=utf-8", TAIL, False, "i", 60, None, None, False)


@pytest.mark.parametrize(
    ("request_", "source", "made"),
    [
        (CreateRequest(), None, CreateRequest(content_type="application/octet-stream")),
        (CreateRequest(content_type="; x=1"), None, CreateRequest(content_type=DEFAULT)),
        (
            CreateRequest(content_type="Text/Plain", expires_ms=5, expires_at=" 2030-01-01Z "),
            None,
            CreateRequest(content_type="Text/Plain", expires_ms=5, expires_at="2030-01-01Z"),
        ),
        (  # a fork takes its source's type and lifetime
            CreateRequest(),
            SOURCE,
            CreateRequest(content_type="text/plain; charset=utf-8", ttl_s=60),
        ),
        (  # the same media type, written its own way; a lifetime of its own
            CreateRequest(content_type="TEXT/plain", expires_ms=9),
            SOURCE,
            CreateRequest(content_type="TEXT/plain", expires_ms=9),
        ),
    ],
)
def test_a_stream_is_made_with_its_type_and_lifetime(
    request_: CreateRequest, source: Meta | None, made: CreateRequest
) -> None:
    assert request_.made_from(source) == made


def test_a_forks_content_type_is_its_sources() -> None:
    with pytest.raises(BrokerError) as caught:
        CreateRequest(content_type="application/json").made_from(SOURCE)
    assert (caught.value.status, caught.value.code) == (409, "type_mismatch")
