"""A run's results: a summary per figure, the printed table, a comparison with an earlier run."""

from __future__ import annotations

from typing import Any

from benchmarks.figures import BY_NAME, FIGURES, Figure, summarize

NOISY_CORES = 0.25  # other processes using more than this during a repeat disturb its figures


def _number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100 or unit == "deltas":
        return f"{value:,.0f}"
    if unit in ("B", "MiB"):
        return f"{value:,.1f}"
    return f"{value:,.2f}"


def _target(figure: Figure) -> str:
    if figure.target is None:
        return ""
    sign = ">=" if figure.better == "higher" else "<="
    if figure.target == 0 and figure.better == "lower":
        sign = "="
    return f"{sign} {figure.target:,g}"


def figures(samples: dict[str, list[float]], noisy: set[str]) -> dict[str, dict[str, Any]]:
    """Every figure of the catalogue with its summary (``median`` None when not measured)."""
    out: dict[str, dict[str, Any]] = {}
    for figure in FIGURES:
        summary = summarize(samples.get(figure.name, []))
        entry: dict[str, Any] = {
            "unit": figure.unit,
            "description": figure.description,
            "better": figure.better,
            "median": summary.median if summary else None,
            "min": summary.low if summary else None,
            "max": summary.high if summary else None,
            "samples": list(summary.samples) if summary else [],
            "target": figure.target,
            "meets": figure.meets(summary.median) if summary else None,
            "ceiling": figure.ceiling,
            "reference": figure.reference,
            "reference_note": figure.reference_note or None,
            "noisy": figure.workload in noisy,
        }
        out[figure.name] = entry
    for name, entry in out.items():
        ceiling = BY_NAME[name].ceiling
        entry["ceiling_median"] = out[ceiling]["median"] if ceiling else None
    return out


def _topology(report: dict[str, Any]) -> str:
    """How the run's Redis was laid out, and whether the brokers' writes waited for replicas;
    results from before clusters (or replicas) were measured say nothing of them."""
    topology = str(report.get("topology", "single"))
    if topology == "single":
        shown = "one server"
    else:
        primaries, _, replicas = topology.removeprefix("cluster-").partition("x")
        shown = f"a Redis Cluster of {primaries} primaries"
        if replicas:
            shown += f", {replicas} replica{'s' if replicas != '1' else ''} each"
    acks = int(report.get("replica_acks", 0))
    if acks:
        shown += f", writes waiting for {acks} replica ack{'s' if acks > 1 else ''}"
    return shown


def render(report: dict[str, Any]) -> str:
    """The table printed at the end of a run."""
    machine, software = report["machine"], report["software"]
    lines = [
        f"broker {software['broker']} at {software['commit']}, {report['profile']} sizes, "
        f"{report['repeat']} repeat(s), {report['started_at']}",
        f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
        f"Linux {machine['kernel']}; {software['python']}; {software['redis']}, "
        f"{_topology(report)}",
        "",
    ]
    header = (
        f"{'figure':<40} {'median':>10} {'min-max':>21} {'target':>10} {'':>4} "
        f"{'ceiling':>9} {'reference':>18}"
    )
    lines += [header, "-" * len(header)]
    workload = ""
    for name, entry in report["figures"].items():
        figure = BY_NAME[name]
        if figure.workload != workload and workload:
            lines.append("")
        workload = figure.workload
        unit = entry["unit"]
        low_high = (
            f"{_number(entry['min'], unit)}-{_number(entry['max'], unit)}"
            if entry["median"] is not None
            else "-"
        )
        verdict = {True: "ok", False: "MISS", None: ""}[entry["meets"]]
        if entry["median"] is None and figure.target is not None:
            verdict = "n/a"
        mark = "~" if entry["noisy"] else " "
        reference = ""
        if entry["reference"] is not None:
            reference = f"{_number(entry['reference'], unit)} {entry['reference_note'] or ''}"
        ceiling = _number(entry["ceiling_median"], "ops/s") if entry["ceiling"] else ""
        lines.append(
            f"{name:<40} {_number(entry['median'], unit):>10}{mark}{low_high:>20} "
            f"{_target(figure):>10} {verdict:>4} {ceiling:>9} {reference:>18}"
        )
    lines.append("")
    notes = [
        "ceiling: the median of the raw-Redis figure bounding this one (same run); reference: "
        "as quoted in the issue for this kind of machine (raw Redis, or the resumable-stream "
        "Node package), not measured here.",
    ]
    if any(entry["noisy"] for entry in report["figures"].values()):
        notes.append(
            f"~: other processes used more than {NOISY_CORES} cores during some repeat of this "
            "workload; the figure may be disturbed (see workloads.*.repeats[].cpu_cores)."
        )
    errors = {name: w["error"] for name, w in report["workloads"].items() if w.get("error")}
    for name, error in errors.items():
        notes.append(f"{name} FAILED: {error}")
    return "\n".join(line.rstrip() for line in lines + notes) + "\n"


def compare(report: dict[str, Any], old: dict[str, Any]) -> str:
    """Median against median, figure by figure, with the change in the good direction."""
    lines = [
        f"compared with {old['software']['commit']} ({old['started_at']}, {old['profile']} sizes, "
        f"{_topology(old)}; this run: {_topology(report)})",
        f"{'figure':<40} {'before':>10} {'after':>10}  change",
    ]
    for name, entry in report["figures"].items():
        before = old.get("figures", {}).get(name, {}).get("median")
        after = entry["median"]
        change = ""
        if before and after is not None:
            ratio = after / before - 1
            better = ratio > 0 if entry["better"] == "higher" else ratio < 0
            verdict = ("better" if better else "worse") if abs(ratio) > 0.05 else ""
            change = f"{100 * ratio:+.0f}% {verdict}"
        unit = entry["unit"]
        lines.append(f"{name:<40} {_number(before, unit):>10} {_number(after, unit):>10}  {change}")
    return "\n".join(lines) + "\n"
