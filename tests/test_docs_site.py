"""The documentation site holds together: the README's links reach pages that exist, every page
is in the site's navigation, the README stays a landing page that starts with the commands CI
runs, and the settings page is what the settings module makes of itself.

Links between the site's pages are checked by ``mkdocs build --strict`` (``.ci/run``); the
README is not part of the site, so its links are checked here.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import unicodedata

import pytest
import yaml

from broker.settings import Settings
from scripts import settings_page
from tests.doc_pages import DOCS, ROOT, blocks, headed, pages, read

LINK = re.compile(r"\]\(([^)\s]+)\)")
README_MOST_LINES = 250


def slug(heading: str) -> str:
    """A heading's anchor, as Python-Markdown's table of contents (and GitHub) make it."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: str) -> set[str]:
    return {slug(heading) for heading, _ in headed(read(page)) if heading}


def test_every_readme_link_reaches_a_file_and_its_anchor() -> None:
    links = [link for link in LINK.findall(read("README.md")) if "://" not in link]
    assert len(links) >= 20, links
    for link in links:
        path, _, anchor = link.partition("#")
        assert (ROOT / path).exists(), f"README links to {path}, which does not exist"
        if anchor:
            assert path.startswith("docs/"), link
            assert path.endswith(".md"), link
            page = path.removeprefix("docs/")
            assert anchor in anchors(page), f"README links to #{anchor}, not a heading of {path}"


def test_the_readme_links_every_page_of_the_site() -> None:
    linked = {link.partition("#")[0] for link in LINK.findall(read("README.md"))}
    missing = [page for page in pages() if f"docs/{page}" not in linked and page != "index.md"]
    assert not missing, f"the README does not link {missing}"


def nav_pages(entries: list[object]) -> list[str]:
    found: list[str] = []
    for entry in entries:
        assert isinstance(entry, dict)
        for value in entry.values():
            found.extend(nav_pages(value) if isinstance(value, list) else [str(value)])
    return found


def test_every_page_is_in_the_navigation_once() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["strict"] is True
    listed = nav_pages(config["nav"])
    assert sorted(listed) == pages()


def test_the_readme_is_a_landing_page_that_starts_with_install_run_and_test() -> None:
    readme = read("README.md")
    assert len(readme.splitlines()) <= README_MOST_LINES
    first = blocks(readme, "sh")[0]
    commands = [shlex.split(line, comments=True) for line in first.splitlines()]
    assert commands == [
        shlex.split("pip install -e '.[test]' -e ./clients/python -c constraints.txt"),
        ["broker", "serve"],
        ["pytest"],
    ]
    assert readme.index(first) < readme.index("\n## "), "the commands come first"
    ci = (ROOT / ".ci/run").read_text()
    assert re.search(r"^pytest$", ci, re.M), ".ci/run runs the README's test command as it is"
    assert re.search(r"^mkdocs build --strict ", ci, re.M)


def test_the_settings_page_is_generated_from_the_settings_module() -> None:
    assert (DOCS / "settings.md").read_text() == settings_page.render(), (
        "docs/settings.md is stale: run python scripts/settings_page.py"
    )


def test_every_setting_is_on_the_settings_page_once() -> None:
    page = read("settings.md")
    for field in dataclasses.fields(Settings):
        rows = re.findall(rf"^\|[^|]*`BROKER_{field.name.upper()}`", page, re.M)
        assert len(rows) == 1, f"BROKER_{field.name.upper()} is on {len(rows)} rows"


EVERY_ROW = tuple(row for group in settings_page.GROUPS for row in group.rows)
HOST_AND_PORT = next(row for row in EVERY_ROW if row.names == ("host", "port"))


@pytest.mark.parametrize(
    ("rows", "complaint"),
    [
        ((*EVERY_ROW, settings_page.Row(("no_such",), "x")), "rows for no field: ['no_such']"),
        ((*EVERY_ROW, settings_page.Row(("port",), "x")), "; ['port']"),
        (tuple(r for r in EVERY_ROW if r is not HOST_AND_PORT), "no row: ['host', 'port']"),
    ],
)
def test_a_setting_without_a_row_or_a_row_without_a_setting_is_refused(
    monkeypatch: pytest.MonkeyPatch, rows: tuple[settings_page.Row, ...], complaint: str
) -> None:
    monkeypatch.setattr(settings_page, "GROUPS", (settings_page.Group("All", rows),))
    with pytest.raises(ValueError, match=re.escape(complaint)):
        settings_page.render()


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("stream_ttl", 86_400.0, "`24h`"),
        ("tombstone_ttl", 604_800.0, "`7d`"),
        ("attach_token_ttl", 900.0, "`15m`"),
        ("session_retry_window", 60.0, "`60s`"),
        ("ds_long_poll_s", 20.0, "`20s`"),
        ("sse_heartbeat_s", 15.0, "`15`"),
        ("append_linger_ms", 40.0, "`40`"),
        ("port", 8000, "`8000`"),
        ("log_level", "INFO", "`INFO`"),
    ],
)
def test_defaults_are_shown_as_a_reader_would_write_them(
    name: str, value: object, shown: str
) -> None:
    assert settings_page.shown(name, value) == shown


def test_the_settings_page_shows_the_modules_defaults_and_ranges() -> None:
    page = read("settings.md")
    assert (
        "| `BROKER_HOST` / `BROKER_PORT` | `127.0.0.1` / `8000` | text / whole number, 0 to "
        in page
    )
    assert "| `BROKER_STREAM_TTL` | `24h` | duration |" in page
    assert "| `BROKER_REDIS_URL` | *(unset: embedded)* | text |" in page


# Every heading of the README and the site with shell or Python blocks is here or in SHOWN_ONLY.
# Run: the test file that runs its blocks verbatim (it names the page and the heading).
RUN = {
    ("README.md", "Try it: a reconnect and a second viewer"): "tests/test_readme.py",
    ("quickstart.md", "Try it: start, cut, reattach, second viewer"): "tests/test_readme.py",
    ("quickstart.md", "Try it: stop, interruption, continue, regenerate"): "tests/test_readme.py",
    ("tools.md", "Try it: a payment that survives a regenerate"): "tests/test_readme.py",
    ("tools.md", "Try it: a payment that waits for a yes"): "tests/test_readme.py",
    ("native.md", "Python client"): "tests/test_readme.py",
    ("native.md", "Mobile clients"): "tests/test_readme.py",
    ("durable-streams.md", "Durable Streams"): "tests/test_readme.py",
    ("durable-streams.md", "Subscriptions"): "tests/test_durable_streams.py",
    ("openai.md", "OpenAI Responses and Chat Completions"): "tests/test_openai_readme.py",
    ("openai.md", "Tool approvals"): "tests/test_openai_approvals.py",
}
COMMANDS = "the install, run and test commands: .ci/run runs the install and the tests as written"
# Shown only: why no test can paste them as they are.
SHOWN_ONLY = {
    ("README.md", "Resumable stream broker"): COMMANDS,
    ("quickstart.md", "Install and run"): COMMANDS,
    ("development.md", "Install and test"): COMMANDS,
    ("development.md", "Commands"): "the developer's commands, .ci/run and the suite among them",
    ("aisdk.md", "AI SDK"): "npm ci and npm start; tests/test_aisdk_browser.py serves that page",
    ("operations/cluster.md", "Redis Cluster"): "needs a Redis Cluster at those addresses",
    ("operations/deployment.md", "The image"): "needs Docker and a Redis",
    ("operations/deployment.md", "The whole stack with Docker Compose"): "needs Docker",
    ("operations/deployment.md", "Every core of one machine: `--workers`"): (
        "serves until stopped; tests/test_workers.py runs broker serve --workers 2"
    ),
    ("operations/metrics.md", "Dashboards with something to show"): (
        "needs the stack; tests/test_loadgen.py runs broker loadgen"
    ),
    ("operations/security.md", "Security: API keys, tenants, attach tokens, limits"): (
        "a key of your own (bk_Vx... stands for it); tests/test_security.py holds the rules"
    ),
    ("operations/security.md", "Attach tokens"): "a key and a token of your own",
    ("providers.md", "Which providers a broker serves"): "needs the providers' keys and servers",
    ("webhooks.md", "Completion webhooks"): "a secret and a receiver of your own",
    ("openai.md", "Agent frameworks"): (
        "a provider's model and tools of your own; tests/test_agent_frameworks.py runs the same "
        "settings against the simulated provider"
    ),
    ("openai.md", "Function tools"): (
        "a provider's model and a run() of your own; tests/test_openai_responses_tools.py runs "
        "the same loop against the simulated provider"
    ),
}
LANGUAGES = ("sh", "bash", "shell", "console", "python", "py")


def with_code() -> set[tuple[str, str]]:
    return {
        (page, heading)
        for page in ("README.md", *pages())
        for heading, text in headed(read(page))
        if any(blocks(text, language) for language in LANGUAGES)
    }


def test_every_shell_and_python_example_is_run_or_says_why_not() -> None:
    found = with_code()
    assert not set(RUN) & set(SHOWN_ONLY)
    unlisted = sorted(found - set(RUN) - set(SHOWN_ONLY))
    assert not unlisted, f"run these examples in a test, or say in SHOWN_ONLY why not: {unlisted}"
    gone = sorted((set(RUN) | set(SHOWN_ONLY)) - found)
    assert not gone, f"these headings hold no example any more: {gone}"
    for (page, heading), test in RUN.items():
        source = (ROOT / test).read_text()
        assert page in source, f"{test} does not read {page}"
        assert heading in source, f"{test} does not read {page}, {heading!r}"
