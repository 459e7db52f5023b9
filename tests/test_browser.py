"""End-to-end tests of the demo page in a real Chromium, against a real broker.

Playwright's sync API drives Debian's Chromium (never a downloaded browser); the module is
skipped when /usr/bin/chromium is missing. One browser serves the whole module, one context
(fresh storage) each test; a second context is a second device (no shared storage).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import (
    Browser,
    BrowserContext,
    ConsoleMessage,
    Page,
    Request,
    expect,
)

from tests.chromium import CHROMIUM, launched
from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import ToolEndpoint, bearer, missing_tool, read_sse

# The clients' side: CI's passes on other servers leave it out (see .ci/run).
pytestmark = pytest.mark.client_side

if not CHROMIUM.exists():
    missing_tool(f"{CHROMIUM} is not installed (apt-get install chromium)", module=True)

SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "demo.png"
PROMPT = "Tell me about tunnels"
WAIT_MS = 20_000
KEY = "key-acme-0123456789abcdef"
SECURED = {"api_keys": f"acme={KEY}", "attach_secret": "a" * 40}
# Runs before any page script, outside the page's CSP: records what the policy blocked.
RECORD_VIOLATIONS = """
window.__violations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__violations.push(`${e.violatedDirective} ${e.blockedURI}`);
});
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launched() as browser:
        yield browser


def new_context(browser: Browser) -> BrowserContext:
    context = browser.new_context(viewport={"width": 900, "height": 820})
    context.set_default_timeout(WAIT_MS)
    context.add_init_script(RECORD_VIOLATIONS)
    return context


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = new_context(browser)
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.fixture
def other_device(browser: Browser) -> Iterator[BrowserContext]:
    """A second browser with storage of its own: nothing of the first page's tab reaches it."""
    context = new_context(browser)
    try:
        yield context
    finally:
        context.close()


def full_answer(broker: RunningBroker, seed: str, tokens: int, auth: str | None = None) -> str:
    """The uninterrupted answer for the page's prompt, read over plain HTTP at full speed."""
    body: dict[str, Any] = {
        "conversation_id": "reference",
        "messages": [{"role": "user", "content": PROMPT}],
        "params": {"simulate": {"seed": seed, "tokens": tokens, "tokens_per_s": 0}},
    }
    turn = httpx.post(
        f"{broker.base_url}/v1/turns", json=body, headers=bearer(auth), timeout=10
    ).json()
    read = read_sse(broker.base_url, turn["stream_id"], auth=auth)
    assert read.events[-1].event == "end"
    assert read.events[-1].data["status"] == "complete"
    return "".join(e.data["text"] for e in read.events if e.event == "delta")


def send(
    page: Page,
    broker: RunningBroker,
    *,
    seed: str,
    tokens: int,
    pace: float,
    break_after: int | None = None,
    navigate: bool = True,
) -> None:
    if navigate:
        page.goto(broker.base_url + "/")
    page.get_by_label("Message").fill(PROMPT)
    page.get_by_label("Tokens", exact=True).fill(str(tokens))
    page.get_by_label("Tokens per second").fill(str(pace))
    page.get_by_label("Seed").fill(seed)
    page.get_by_label("Break after N deltas").fill("" if break_after is None else str(break_after))
    page.get_by_test_id("send").click()


def answer(page: Page) -> str:
    return page.get_by_test_id("answer").text_content() or ""


def wait_for_words(page: Page, count: int) -> None:
    page.wait_for_function(
        """n => (document.querySelector('[data-testid="answer"]').textContent.match(/\\S+/g)
                  || []).length >= n""",
        arg=count,
        timeout=WAIT_MS,
    )


def test_drop_connection_and_second_tab_show_the_same_answer(
    broker_factory: BrokerFactory, page: Page
) -> None:
    broker = broker_factory()
    expected = full_answer(broker, "drop", 40)
    send(page, broker, seed="drop", tokens=40, pace=12)
    status = page.get_by_test_id("status")
    expect(status).to_have_text("streaming")
    wait_for_words(page, 3)

    # A second tab attaches to the same turn and shows the same text live.
    with page.context.expect_page() as opened:
        page.get_by_test_id("second-tab").click()
    second = opened.value
    expect(second.get_by_test_id("status")).to_have_text("streaming")

    page.get_by_test_id("drop").click()
    expect(page.get_by_test_id("reconnects")).not_to_have_text("0")
    expect(status).to_have_text("complete")
    assert answer(page) == expected
    expect(second.get_by_test_id("status")).to_have_text("complete")
    assert answer(second) == expected
    expect(page.get_by_test_id("stop")).to_be_disabled()


def test_reload_mid_answer_resumes(broker_factory: BrokerFactory, page: Page) -> None:
    broker = broker_factory()
    expected = full_answer(broker, "reload", 40)
    send(page, broker, seed="reload", tokens=40, pace=12)
    wait_for_words(page, 4)
    page.reload()
    # The reloaded page reads on from the offset it kept, not from the start.
    expect(page.get_by_test_id("offset")).to_have_text(re.compile(r"^\d{16}-\d+$"))
    assert answer(page).strip(), "the text read before the reload is shown again"
    expect(page.get_by_test_id("status")).to_have_text("complete")
    assert answer(page) == expected


def test_stop_ends_cancelled(broker_factory: BrokerFactory, page: Page) -> None:
    broker = broker_factory()
    expected = full_answer(broker, "stop", 300)
    send(page, broker, seed="stop", tokens=300, pace=10)
    wait_for_words(page, 2)
    page.get_by_test_id("stop").click()
    expect(page.get_by_test_id("status")).to_have_text("cancelled")
    text = answer(page)
    assert text
    assert expected.startswith(text)
    assert len(text) < len(expected)
    expect(page.get_by_test_id("recovery")).to_be_hidden()


def test_interrupted_answer_continues_or_regenerates(
    broker_factory: BrokerFactory, page: Page
) -> None:
    broker = broker_factory()
    expected = full_answer(broker, "cut", 30)
    status = page.get_by_test_id("status")
    recovery = page.get_by_test_id("recovery")

    # Continue: the partial text plus the rest is the full answer.
    send(page, broker, seed="cut", tokens=30, pace=40, break_after=10)
    expect(status).to_have_text("interrupted")
    expect(recovery).to_be_visible()
    expect(page.get_by_test_id("answer")).to_have_class(re.compile(r"\bpartial\b"))
    partial = answer(page)
    assert partial
    assert expected.startswith(partial)
    assert partial != expected
    if os.environ.get("BROKER_UPDATE_SCREENSHOT"):  # the README's and docs' picture, on demand
        page.screenshot(path=str(SCREENSHOT), full_page=True)

    page.get_by_test_id("continue").click()
    expect(status).to_have_text("complete")
    expect(page.get_by_test_id("attempt")).to_have_text("2")
    assert page.get_by_test_id("prefix").text_content() == partial
    assert answer(page) == expected
    expect(recovery).to_be_hidden()

    # Regenerate: a fresh answer replaces the partial one (the simulator is deterministic, so
    # the fresh answer is the full one, carrying nothing over).
    send(page, broker, seed="cut", tokens=30, pace=40, break_after=10)
    expect(status).to_have_text("interrupted")
    assert answer(page) == partial
    page.get_by_test_id("regenerate").click()
    expect(status).to_have_text("complete")
    expect(page.get_by_test_id("attempt")).to_have_text("2")
    assert page.get_by_test_id("prefix").text_content() == ""
    assert answer(page) == expected
    turn_id = page.get_by_test_id("turn-id").text_content()
    turn = httpx.get(f"{broker.base_url}/v1/turns/{turn_id}", timeout=10).json()
    assert [a["strategy"] for a in turn["attempts"]] == ["initial", "regenerate"]


# --- credentials, share links, the page's policy ---------------------------------------------


def violations(page: Page) -> list[str]:
    found: list[str] = page.evaluate("window.__violations")
    return found


def watch_console(page: Page) -> list[str]:
    """Collects the page's console errors (Chromium reports CSP refusals there too)."""
    errors: list[str] = []

    def record(message: ConsoleMessage) -> None:
        if message.type == "error":
            errors.append(message.text)

    page.on("console", record)
    return errors


def watch_streams(page: Page) -> list[Request]:
    reads: list[Request] = []
    page.on("request", lambda r: reads.append(r) if "/v1/streams/" in r.url else None)
    return reads


def test_a_secured_broker_asks_for_a_key_and_a_share_link_opens_a_viewer(
    broker_factory: BrokerFactory, page: Page, other_device: BrowserContext
) -> None:
    broker = broker_factory(**SECURED)
    expected = full_answer(broker, "key", 40, auth=KEY)
    console = watch_console(page)
    owner_reads = watch_streams(page)

    # Without a key the broker answers 401 and the page asks for one.
    send(page, broker, seed="key", tokens=40, pace=12)
    expect(page.get_by_test_id("error")).to_contain_text("401")
    expect(page.get_by_test_id("credentials")).to_have_attribute("open", "")
    expect(page.get_by_test_id("key-note")).to_contain_text("needs an API key")
    expect(page.get_by_test_id("status")).to_have_text("idle")

    page.get_by_test_id("api-key").fill(KEY)
    page.get_by_test_id("save-key").click()
    expect(page.get_by_test_id("key-summary")).to_have_text("API key (set)")
    assert page.evaluate("sessionStorage.getItem('broker:api-key')") == KEY
    send(page, broker, seed="key", tokens=40, pace=12, navigate=False)
    expect(page.get_by_test_id("status")).to_have_text("streaming")
    expect(page.get_by_test_id("error")).to_have_text("")
    wait_for_words(page, 3)

    # Mid-answer, the owner mints a read-only link; another device follows the same turn live.
    page.get_by_test_id("share").click()
    link = page.get_by_test_id("share-link")
    expect(link).to_be_visible()
    url = link.get_attribute("href") or ""
    assert url.startswith(f"{broker.base_url}/#")
    assert re.search(r"[#&]token=[\w.-]+", url)
    assert page.get_by_test_id("share-url").input_value() == url
    viewer = other_device.new_page()
    reads = watch_streams(viewer)
    viewer.goto(url)
    expect(viewer.get_by_test_id("viewer-note")).to_be_visible()
    expect(viewer.get_by_test_id("composer")).to_be_hidden()
    expect(viewer.get_by_test_id("stop")).to_be_hidden()
    expect(viewer.get_by_test_id("share")).to_be_hidden()
    expect(viewer.get_by_test_id("status")).to_have_text("complete")
    assert answer(viewer) == expected
    # The viewer read with the token alone: the other device has no key to send.
    assert reads
    for read in reads:
        assert "token=" in read.url
        assert "authorization" not in read.headers
    assert viewer.evaluate("sessionStorage.getItem('broker:api-key')") is None

    expect(page.get_by_test_id("status")).to_have_text("complete")
    assert answer(page) == expected
    assert owner_reads
    for read in owner_reads:  # the owner's page reads with its key, and no token
        assert read.headers.get("authorization") == f"Bearer {KEY}"
        assert "token=" not in read.url
    assert not [e for e in console if "401" not in e], console  # only the refused first send
    assert violations(page) == []
    assert violations(viewer) == []


def test_a_share_link_with_a_bad_token_is_refused(
    broker_factory: BrokerFactory, page: Page
) -> None:
    broker = broker_factory(**SECURED)
    turn = httpx.post(
        f"{broker.base_url}/v1/turns",
        json={"conversation_id": "c", "messages": [{"role": "user", "content": PROMPT}]},
        headers=bearer(KEY),
        timeout=10,
    ).json()
    page.goto(f"{broker.base_url}/#turn={turn['turn_id']}&stream={turn['stream_id']}&token=a.b.c")
    expect(page.get_by_test_id("viewer-note")).to_be_visible()
    expect(page.get_by_test_id("error")).to_contain_text("read-only link was refused")
    expect(page.get_by_test_id("error")).to_contain_text("bad_token")
    assert answer(page) == ""


def test_the_demo_page_breaks_none_of_its_policy(
    broker: RunningBroker, page: Page, other_device: BrowserContext
) -> None:
    console = watch_console(page)
    expected = full_answer(broker, "csp", 12)
    send(page, broker, seed="csp", tokens=12, pace=0)
    expect(page.get_by_test_id("status")).to_have_text("complete")
    assert answer(page) == expected
    # On an open broker sharing works as well (minting needs no key there).
    page.get_by_test_id("share").click()
    expect(page.get_by_test_id("share-link")).to_be_visible()
    url = page.get_by_test_id("share-link").get_attribute("href") or ""
    assert "token=" in url
    page.get_by_test_id("key-summary").click()
    expect(page.get_by_test_id("api-key")).to_be_visible()
    viewer = other_device.new_page()
    viewer_console = watch_console(viewer)
    viewer.goto(url)
    expect(viewer.get_by_test_id("status")).to_have_text("complete")
    assert answer(viewer) == expected
    assert violations(page) == []
    assert violations(viewer) == []
    csp = [e for e in console + viewer_console if "Content Security Policy" in e]
    assert csp == []
    assert console == []
    assert viewer_console == []

    # The watch itself works: markup with an inline style is refused, and both records see it.
    with page.expect_console_message(lambda m: "Content Security Policy" in m.text):
        page.evaluate("""document.body.insertAdjacentHTML(
            "beforeend", '<p style="color: red">inline</p>')""")
    page.wait_for_function("window.__violations.length > 0")
    assert any(v.startswith("style-src") for v in violations(page)), violations(page)


def test_every_tab_shows_allow_and_deny_one_decides_and_both_see_the_answer(
    broker_factory: BrokerFactory, page: Page, tmp_path: Path
) -> None:
    """A payment that waits for a person: two tabs show the request with Allow and Deny; one
    allows; both see the decision and the answer, and the payment ran once."""
    payments = ToolEndpoint("/pay", lambda n: {"payment_id": f"pay_{n}"})
    tool = {
        "name": "send_payment",
        "class": "unkeyed_write",
        "endpoint": payments.url,
        "timeout_s": 5,
        "approval": "always",
    }
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps({"tools": [tool]}))
    try:
        broker = broker_factory(tools=str(tools))
        page.goto(broker.base_url + "/")
        calls = [{"name": "send_payment", "args": {"to": "bob", "amount": 500}, "after": 3}]
        page.get_by_label("Tool calls").fill(json.dumps(calls))
        send(page, broker, seed="approval", tokens=10, pace=0, navigate=False)
        status = page.get_by_test_id("status")
        expect(status).to_have_text("awaiting_approval")
        approval = page.get_by_test_id("approval")
        expect(approval).to_have_attribute("data-state", "pending")
        expect(approval).to_contain_text("send_payment")
        expect(approval.get_by_test_id("allow")).to_be_visible()
        expect(approval.get_by_test_id("deny")).to_be_visible()

        with page.context.expect_page() as opened:
            page.get_by_test_id("second-tab").click()
        second = opened.value
        other = second.get_by_test_id("approval")
        expect(other).to_have_attribute("data-state", "pending")
        expect(second.get_by_test_id("status")).to_have_text("awaiting_approval")
        assert payments.requests == [], "nothing ran before a person said yes"

        other.get_by_test_id("allow").click()
        for tab in (page, second):
            row = tab.get_by_test_id("approval")
            expect(row).to_have_attribute("data-state", "approve")
            expect(row.get_by_test_id("approval-decision")).to_have_text("allowed (person)")
            expect(row.get_by_test_id("allow")).to_have_count(0)
            expect(tab.get_by_test_id("status")).to_have_text("complete")
        turn_id = page.get_by_test_id("turn-id").text_content()
        turn = httpx.get(f"{broker.base_url}/v1/turns/{turn_id}", timeout=10).json()
        assert turn["status"] == "complete"
        assert answer(page) == answer(second) == turn["canonical"]["text"]
        assert len(payments.requests) == 1, "the payment ran once"
        assert page.get_by_test_id("error").text_content() == ""
    finally:
        payments.close()
