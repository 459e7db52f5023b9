"""The Grafana dashboards and Prometheus rules under grafana/, tested as code.

Every dashboard loads with its fixed uid and parses as PromQL; every metric and label value a
dashboard or rule names is one a real broker exports; promtool accepts the rules, their unit tests
and the live /metrics text; and forced retries and exhaustions move exactly the counters the
dashboards and alerts read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import BrokerFactory, RunningBroker
from tests.helpers import missing_tool, wait_final

GRAFANA = Path(__file__).resolve().parent.parent / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
RULES = GRAFANA / "rules" / "broker.rules.yml"
RULE_TESTS = GRAFANA / "rules" / "broker.rules.test.yml"
PROMETHEUS_CONFIG = GRAFANA / "prometheus.yml"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "broker.yaml"

UIDS = ("broker-overview", "broker-retries", "broker-tools", "broker-redis")
DATASOURCE_UID = "prometheus"
PANEL_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Labels Prometheus attaches at scrape time; they are never in the broker's own output.
TARGET_LABELS = frozenset({"job", "instance"})
# Series that are not the broker's: the scrape health Prometheus records itself.
NOT_EXPORTED = frozenset({"up"})
# Grafana's built-in interval variables, as Grafana would expand them.
BUILTIN_RANGES = re.compile(r"\$(?:__rate_interval|__interval|__range)\b|\$\{__[a-z_]+\}")
# Any other template variable ($name or ${name}); only label values may hold them.
VARIABLE = re.compile(r"\$\{?[A-Za-z_]\w*\}?")
PLACEHOLDER = "__grafana_variable__"
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")
ALTERNATION = re.compile(r"^\w+(?:\|\w+)*$")

Exposed = dict[str, dict[str, set[str]]]


# --- reading the files --------------------------------------------------------------------


def load_dashboard(uid: str) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads((DASHBOARDS / f"{uid}.json").read_text())
    return dashboard


def load_yaml(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    return document


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def graph_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    return (p for p in all_panels(dashboard) if p["type"] != "row")


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL with Grafana variables) for every panel target and variable query."""
    for panel in graph_panels(dashboard):
        for target in panel["targets"]:
            yield f"{dashboard['uid']} / {panel['title']} / {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        match = LABEL_VALUES.match(text)
        assert match, f"{dashboard['uid']} variable {variable['name']}: {text!r}"
        yield f"{dashboard['uid']} / ${variable['name']}", match["selector"]


def all_dashboard_queries() -> list[tuple[str, str]]:
    return [query for uid in UIDS for query in dashboard_queries(load_dashboard(uid))]


def rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(RULES)["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "alert" in rule]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def rule_queries() -> list[tuple[str, str]]:
    return [(rule.get("alert") or rule["record"], rule["expr"]) for rule in rules()]


# --- PromQL ---------------------------------------------------------------------------------


def expand(expr: str) -> str:
    """The query as Prometheus would receive it from Grafana (variables filled in)."""
    return VARIABLE.sub(PLACEHOLDER, BUILTIN_RANGES.sub("5m", expr))


def selectors(expr: str) -> tuple[list[promql_parser.VectorSelector], list[str]]:
    """Every vector selector of ``expr``, and the names of those under a range (``[5m]``)."""
    found: list[promql_parser.VectorSelector] = []
    ranged: list[str] = []

    def visit(node: promql_parser.Expr) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
        elif isinstance(node, promql_parser.MatrixSelector):
            ranged.append(node.vector_selector.name or "")
        return True

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return found, ranged


# --- the broker's /metrics -----------------------------------------------------------------


def scrape(broker: RunningBroker) -> str:
    response = httpx.get(f"{broker.base_url}/metrics", timeout=5)
    assert response.status_code == 200
    return response.text


def exposed(text: str) -> Exposed:
    """Sample name (with its _total, _bucket, _info ... suffix) -> label -> values seen."""
    names: Exposed = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = names.setdefault(sample.name, {})
            for label, value in sample.labels.items():
                labels.setdefault(label, set()).add(value)
    return names


def sample_key(name: str, labels: dict[str, str]) -> str:
    inside = ",".join(f'{key}="{labels[key]}"' for key in sorted(labels))
    return f"{name}{{{inside}}}" if inside else name


def counters(broker: RunningBroker) -> dict[str, float]:
    return {
        sample_key(sample.name, sample.labels): sample.value
        for family in text_string_to_metric_families(scrape(broker))
        if family.type == "counter"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


# --- dashboards -----------------------------------------------------------------------------


def test_the_dashboard_folder_holds_exactly_the_four_dashboards() -> None:
    assert sorted(p.stem for p in DASHBOARDS.glob("*.json")) == sorted(UIDS)


@pytest.mark.parametrize("uid", UIDS)
def test_a_dashboard_loads_with_its_fixed_uid_and_unique_panel_ids(uid: str) -> None:
    dashboard = load_dashboard(uid)
    assert dashboard["uid"] == uid
    assert dashboard["title"].startswith("Broker / ")
    assert "broker" in dashboard["tags"]
    ids = [panel["id"] for panel in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {uid}: {ids}"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables["datasource"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    assert source["current"]["value"] == DATASOURCE_UID
    for panel in all_panels(dashboard):
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, f"{uid} / {panel['title']} is too wide"
    for panel in graph_panels(dashboard):
        where = f"{uid} / {panel['title']}"
        assert len(panel["description"]) >= 80, f"{where}: say what it means and what to do"
        assert panel["datasource"] == PANEL_DATASOURCE, where
        assert panel["targets"], f"{where} has no query"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), where
        for target in panel["targets"]:
            assert target["datasource"] == PANEL_DATASOURCE, where


# The dashboard JSON model versions Grafana 10 and 11 write and read; the pinned Grafana of
# compose.yaml (11.4) migrates anything older on load, silently changing what was tested.
SCHEMA_VERSIONS = range(38, 41)
PANEL_TYPES = frozenset({"row", "timeseries", "stat", "gauge", "bargauge", "table", "text"})
GRAFANA_BUILTIN_SOURCE = {"type": "grafana", "uid": "-- Grafana --"}


@pytest.mark.parametrize("uid", UIDS)
def test_a_dashboard_is_a_grafana_json_model_of_known_parts(uid: str) -> None:
    """What Grafana checks when it loads a file, which no Grafana here can do: the schema
    version, panel types it ships, every data source reference (panels, targets, variables,
    annotations) resolved through the ``datasource`` variable or Grafana's own."""
    dashboard = load_dashboard(uid)
    assert dashboard["schemaVersion"] in SCHEMA_VERSIONS, dashboard["schemaVersion"]
    schema_versions = {load_dashboard(other)["schemaVersion"] for other in UIDS}
    assert len(schema_versions) == 1, "the dashboards were saved by different Grafanas"
    assert isinstance(dashboard["version"], int)
    for panel in all_panels(dashboard):
        assert panel["type"] in PANEL_TYPES, f"{uid} / {panel['title']}: {panel['type']}"
        assert isinstance(panel["id"], int)
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}
    for panel in graph_panels(dashboard):
        for target in panel["targets"]:
            assert target["expr"].strip(), f"{uid} / {panel['title']}: an empty query"
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"] == PANEL_DATASOURCE, f"{uid} ${variable['name']}"
    for annotation in dashboard["annotations"]["list"]:
        assert annotation["datasource"] in (GRAFANA_BUILTIN_SOURCE, PANEL_DATASOURCE)


# Panels that show why calls failed: each splits by the upstream error's code.
BY_CODE = {
    "broker_retries_total": "Retries by upstream error",
    "broker_attempts_exhausted_total": "Attempts exhausted by upstream error",
    "broker_interruptions_total": "Interruptions by upstream error",
}


def test_retries_exhaustions_and_interruptions_are_split_by_upstream_error_code() -> None:
    """Issue 34, finding 11: a dashboard must tell rate limiting (upstream_rate_limited) from
    an outage (upstream_unavailable), so these panels group by ``code``."""
    panels = {panel["title"]: panel for panel in graph_panels(load_dashboard("broker-retries"))}
    for metric, title in BY_CODE.items():
        assert title in panels, f"broker-retries has no panel {title!r}"
        (target,) = panels[title]["targets"]
        expr = target["expr"]
        grouped = re.match(r"^sum by \((?P<labels>[^)]*)\) \((?:rate|increase)\(", expr)
        assert grouped, f"{title}: {expr}"
        assert "code" in [label.strip() for label in grouped["labels"].split(",")], title
        assert metric in expr, title
        assert "{{code}}" in target["legendFormat"], title
        assert "upstream_rate_limited" in panels[title]["description"], title


def test_the_dashboards_link_to_each_other() -> None:
    for uid in UIDS:
        links = load_dashboard(uid)["links"]
        assert any(link["type"] == "dashboards" and "broker" in link["tags"] for link in links)


def test_every_dashboard_query_parses_as_promql() -> None:
    for where, expr in all_dashboard_queries():
        try:
            promql_parser.parse(expand(expr))
        except ValueError as exc:
            pytest.fail(f"{where}: {expr!r} does not parse: {exc}")


def test_dashboard_ranges_follow_grafana_and_counters_are_never_graphed_raw() -> None:
    for where, expr in all_dashboard_queries():
        for window in re.findall(r"\[([^\]]*)\]", expr):
            assert window in ("$__rate_interval", "$__range"), f"{where}: [{window}]"
        found, ranged = selectors(expand(expr))
        for selector in found:
            name = selector.name or ""
            if name.endswith(("_total", "_bucket")):
                assert name in ranged, f"{where}: {name} outside rate()/increase()"
        if "_bucket" in expr:
            assert expr.startswith("histogram_quantile("), f"{where}: buckets without quantile"


# --- rules ----------------------------------------------------------------------------------


def test_every_rule_parses_and_every_alert_is_labelled_and_annotated() -> None:
    for name, expr in rule_queries():
        try:
            promql_parser.parse(expr)
        except ValueError as exc:
            pytest.fail(f"{name}: {expr!r} does not parse: {exc}")
    for name in recorded_names():
        assert re.fullmatch(r"broker:[a-z_]+:[a-z0-9_]+", name), f"{name}: level:metric:ops"
    for rule in alerts():
        assert rule["alert"].startswith("Broker")
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert set(rule["annotations"]) >= {"summary", "description"}, rule["alert"]


def test_the_rules_use_only_recording_rules_that_exist() -> None:
    recorded = recorded_names()
    for where, expr in [*rule_queries(), *all_dashboard_queries()]:
        found, _ = selectors(expand(expr))
        for selector in found:
            name = selector.name or ""
            if ":" in name:
                assert name in recorded, f"{where}: {name} is not a recording rule"


def test_the_ratio_alerts_are_guarded_by_traffic() -> None:
    for rule in alerts():
        if "ratio" in rule["expr"]:
            assert re.search(r"\band\b.*:rate5m > ", rule["expr"]), rule["alert"]


def test_every_alert_has_cases_that_fire_and_cases_that_do_not() -> None:
    cases = [
        case for test in load_yaml(RULE_TESTS)["tests"] for case in test.get("alert_rule_test", [])
    ]
    for rule in alerts():
        name = rule["alert"]
        outcomes = {bool(case.get("exp_alerts")) for case in cases if case["alertname"] == name}
        assert outcomes == {True, False}, f"{name}: needs a firing and a silent case"
    tested = " ".join(
        case["expr"]
        for test in load_yaml(RULE_TESTS)["tests"]
        for case in test.get("promql_expr_test", [])
    )
    for name in recorded_names():
        assert name in tested, f"recording rule {name} has no promql_expr_test"


# --- provisioning ---------------------------------------------------------------------------


def test_grafana_provisioning_points_at_prometheus_and_the_dashboards() -> None:
    sources = load_yaml(DATASOURCES)["datasources"]
    assert [(s["uid"], s["type"], s["url"]) for s in sources] == [
        (DATASOURCE_UID, "prometheus", "http://prometheus:9090")
    ]
    providers = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert [(p["type"], p["options"]["path"]) for p in providers] == [
        ("file", "/var/lib/grafana/dashboards")
    ]
    config = load_yaml(PROMETHEUS_CONFIG)
    assert [job["job_name"] for job in config["scrape_configs"]] == ["broker"]
    assert config["rule_files"] == ["rules/broker.rules.yml"]


# --- against a real broker ------------------------------------------------------------------


def test_every_metric_and_label_value_queried_is_exported(broker: RunningBroker) -> None:
    names = exposed(scrape(broker))
    recorded = recorded_names()
    problems: list[str] = []
    for where, expr in [*all_dashboard_queries(), *rule_queries()]:
        found, _ = selectors(expand(expr))
        for selector in found:
            name = selector.name or ""
            if name in NOT_EXPORTED or name in recorded:
                continue
            if name not in names:
                problems.append(f"{where}: the broker does not export {name}")
                continue
            labels = names[name]
            for matcher in selector.matchers.matchers:
                if matcher.name in TARGET_LABELS:
                    continue
                if matcher.name not in labels:
                    problems.append(f"{where}: {name} has no label {matcher.name}")
                    continue
                if PLACEHOLDER in matcher.value:
                    continue
                if matcher.op in (promql_parser.MatchOp.Equal, promql_parser.MatchOp.NotEqual):
                    wanted = [matcher.value]
                elif ALTERNATION.match(matcher.value):
                    wanted = matcher.value.split("|")
                else:
                    continue
                problems += [
                    f"{where}: {name} never has {matcher.name}={value!r}"
                    for value in wanted
                    if value not in labels[matcher.name]
                ]
    assert not problems, "\n".join(problems)


def test_every_exported_metric_is_on_a_dashboard(broker: RunningBroker) -> None:
    """A metric added to the broker gets a panel, or this test says which one lacks it."""
    shown = {
        selector.name
        for _, expr in all_dashboard_queries()
        for selector in selectors(expand(expr))[0]
    }
    exported = {
        name
        for name in exposed(scrape(broker))
        if not name.endswith(("_created", "_sum", "_count"))
    }
    assert sorted(exported - shown) == [], "exported but on no dashboard"


@pytest.fixture(scope="session")
def promtool() -> str:
    path = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not path:
        missing_tool("promtool not found: set PROMTOOL or put it on PATH (.ci/run installs it)")
    return path


def run_promtool(promtool: str, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        [promtool, *args], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


def test_promtool_checks_the_rules_and_the_prometheus_config(promtool: str) -> None:
    run_promtool(promtool, "check", "rules", str(RULES))
    run_promtool(promtool, "check", "config", str(PROMETHEUS_CONFIG))
    # compose.host.yaml's, and CI's one-second variant (its rules are written by the test).
    run_promtool(promtool, "check", "config", str(GRAFANA / "prometheus.host.yml"))


def test_promtool_rule_unit_tests_pass(promtool: str) -> None:
    output = run_promtool(promtool, "test", "rules", str(RULE_TESTS))
    assert "SUCCESS" in output


def test_promtool_accepts_the_live_metrics(promtool: str, broker: RunningBroker) -> None:
    output = run_promtool(promtool, "check", "metrics", stdin=scrape(broker))
    assert output.strip() == "", f"promtool lint findings:\n{output}"


# --- forced retries and exhaustions ---------------------------------------------------------

UPSTREAM = 'broker_upstream_requests_total{model="simulated",outcome="%s",provider="simulated"}'
ATTEMPTS = 'broker_attempts_total{outcome="%s",strategy="initial"}'
STARTED = "broker_turns_started_total"
# The simulated provider's retryable failure is a 503.
RETRIES = 'broker_retries_total{code="upstream_unavailable",reason="upstream_error"}'


def run_turn(broker: RunningBroker, turn_id: str, session: str, fail_before_first: int) -> str:
    body = {
        "conversation_id": "grafana",
        "turn_id": turn_id,
        "session_id": session,
        "messages": [{"role": "user", "content": turn_id}],
        "params": {
            "simulate": {"fail_before_first": fail_before_first, "tokens": 3, "tokens_per_s": 0}
        },
    }
    response = httpx.post(f"{broker.base_url}/v1/turns", json=body, timeout=10)
    assert response.status_code == 201, response.text
    turn = wait_final(broker.base_url, turn_id)
    return f"{turn['status']}/{turn['attempts'][0]['reason']}"


def moved(broker: RunningBroker, before: dict[str, float], expected: dict[str, float]) -> None:
    """Wait for the counters to settle (metrics follow the final status closely), then compare
    every counter that changed with ``expected``."""
    deadline = time.monotonic() + 10
    while True:
        after = counters(broker)
        delta = {key: after[key] - before.get(key, 0) for key in after}
        changed = {key: value for key, value in delta.items() if value}
        if changed == expected or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert changed == expected


def test_forced_retries_and_exhaustions_move_exactly_their_counters(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory(
        max_attempts_per_turn=2,
        session_retry_budget=1,
        retry_backoff_min_ms=1,
        retry_backoff_max_ms=3,
    )
    # One failure before the first delta: retried silently, within both limits.
    before = counters(broker)
    assert run_turn(broker, "g1", "alice", fail_before_first=1) == "complete/None"
    moved(
        broker,
        before,
        {
            STARTED: 1,
            UPSTREAM % "retryable_error": 1,
            UPSTREAM % "ok": 1,
            RETRIES: 1,
            'broker_turns_finished_total{status="complete"}': 1,
            ATTEMPTS % "complete": 1,
        },
    )

    # Failing for longer than the per-turn cap: one retry, then the cap (scope "turn").
    before = counters(broker)
    assert run_turn(broker, "g2", "bob", fail_before_first=9) == "failed/attempts_exhausted"
    moved(
        broker,
        before,
        {
            STARTED: 1,
            UPSTREAM % "retryable_error": 2,
            RETRIES: 1,
            'broker_retry_budget_exhausted_total{scope="turn"}': 1,
            'broker_attempts_exhausted_total{code="upstream_unavailable"}': 1,
            'broker_turns_finished_total{status="failed"}': 1,
            ATTEMPTS % "failed": 1,
        },
    )

    # alice spent her session's budget of one retry on g1: the next retry is refused.
    before = counters(broker)
    assert run_turn(broker, "g3", "alice", fail_before_first=1) == "failed/retry_budget_exhausted"
    moved(
        broker,
        before,
        {
            STARTED: 1,
            UPSTREAM % "retryable_error": 1,
            'broker_retry_budget_exhausted_total{scope="session"}': 1,
            'broker_turns_finished_total{status="failed"}': 1,
            ATTEMPTS % "failed": 1,
        },
    )
