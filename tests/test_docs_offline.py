"""``/docs`` works with no network: Swagger UI comes from the installed package.

The page names only this broker's own files; Chromium, with every request to another host
refused, renders the document's operations, and nothing it asked for left the broker.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Route

from tests.chromium import CHROMIUM, launched
from tests.conftest import RunningBroker, start_broker
from tests.helpers import missing_tool

# The clients' side: CI's passes on other servers leave it out (see .ci/run).
pytestmark = pytest.mark.client_side

KEY = "key-docs-0123456789abcdef"


@pytest.fixture(scope="module")
def broker(redis_url: str) -> Iterator[RunningBroker]:
    # Secured, as a deployed broker is: the page and the document need no credentials.
    running = start_broker(redis_url, api_keys=f"docs={KEY}")
    try:
        yield running
    finally:
        running.stop()


def test_the_docs_page_loads_only_the_brokers_own_files(broker: RunningBroker) -> None:
    page = httpx.get(f"{broker.base_url}/docs", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    urls += re.findall(r"""url: ["']([^"']+)["']""", page.text)
    assert "/openapi.json" in urls
    assert len(urls) >= 4, urls
    for url in urls:
        assert url.startswith("/"), url
        assert not url.startswith("//"), url
        asset = httpx.get(f"{broker.base_url}{url}", timeout=10)
        assert asset.status_code == 200, url
    assert "validatorUrl" in page.text  # off: the badge would send the document's URL away
    assert not re.search(r"https?://(?!127\.0\.0\.1)", page.text.replace("http://www.w3.org", ""))
    script = httpx.get(f"{broker.base_url}/docs/assets/swagger-ui-bundle.js", timeout=10)
    assert "javascript" in script.headers["content-type"]
    assert len(script.content) > 100_000  # Swagger UI itself, not a stub


def test_swagger_ui_renders_the_document_with_every_other_host_refused(
    broker: RunningBroker,
) -> None:
    if not CHROMIUM.exists():
        missing_tool(f"{CHROMIUM} is not installed (apt-get install chromium)")
    own = urlsplit(broker.base_url).netloc
    refused: list[str] = []

    def only_the_broker(route: Route) -> None:
        url = route.request.url
        if url.startswith(("data:", "blob:")) or urlsplit(url).netloc == own:
            route.continue_()
        else:
            refused.append(url)
            route.abort()

    with launched() as browser:
        context = browser.new_context()
        context.route("**/*", only_the_broker)
        page = context.new_page()
        page.goto(f"{broker.base_url}/docs")
        path = page.locator('[data-path="/v1/streams/{stream_id}"]').first
        path.wait_for(timeout=20_000)
        assert page.locator(".opblock").count() >= 12
        assert "Resumable stream broker" in page.locator(".info .title").inner_text()
        context.close()
    assert refused == []
