"""``--profile DIR``: sample the broker with py-spy while a workload runs, and summarise.

py-spy is not a dependency (``pip install py-spy``). It samples without pausing the broker
(``--nonblocking``) and writes collapsed stacks, one ``frame;frame;... count`` line per stack;
:func:`summary` turns them into the functions that take the most time, by themselves and with what
they call.
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
from pathlib import Path

# The event loop and start-up frames every stack passes through: left out of the "total" list.
_SCAFFOLDING = (
    "(<frozen runpy>)",
    "(asyncio/runners.py)",
    "(asyncio/base_events.py)",
    "Handle._run (asyncio/events.py)",
    "(broker/__main__.py)",
)
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


class ProfilerError(RuntimeError):
    """py-spy is missing or could not attach."""


class Profiler:
    """``py-spy record`` attached to one process until :meth:`stop`."""

    def __init__(self, pid: int, output: Path, rate: int = 250) -> None:
        binary = shutil.which("py-spy")
        if binary is None:
            raise ProfilerError("--profile needs py-spy on PATH: pip install py-spy")
        output.parent.mkdir(parents=True, exist_ok=True)
        self.output = output
        self._process = subprocess.Popen(
            [
                binary,
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(rate),
                "--format",
                "raw",
                "--nonblocking",
                "--output",
                str(output),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def stop(self) -> Path:
        process = self._process
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
        try:
            _, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        if not self.output.exists():
            raise ProfilerError(f"py-spy wrote nothing: {stderr.decode(errors='replace')[-500:]}")
        return self.output


def _short(frame: str) -> str:
    """``function (path:line)`` as ``function (package/module.py)``, the line dropped."""
    match = _FRAME.match(frame)
    if match is None:
        return frame
    path = match.group("file")
    for marker in ("site-packages/", "lib/python3."):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker.startswith("lib/"):
                path = "stdlib/" + path.split("/", 1)[-1]
            break
    else:
        if "/broker/" in path:
            path = "broker/" + path.split("/broker/", 1)[1]
    return f"{match.group('function')} ({path})"


def summary(path: Path, top: int = 25) -> str:
    """The functions with the most samples, by themselves (self) and with callees (total)."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short(f) for f in stack.split(";")]
        if frames and frames[0].startswith(("process ", "thread ")):
            frames = frames[1:]  # py-spy's thread/process pseudo-frames
        if not frames:
            continue
        samples += count
        own[frames[-1]] += count
        for frame in set(frames):
            total[frame] += count
    if not samples:
        return "no samples\n"
    lines = [f"{samples} samples of a busy broker thread", "", "self %  function"]
    lines += [f"{100 * n / samples:6.1f}  {name}" for name, n in own.most_common(top)]
    lines += ["", "total %  function (with what it calls)"]
    inclusive = [(n, f) for f, n in total.most_common() if not f.endswith(_SCAFFOLDING)]
    lines += [f"{100 * n / samples:7.1f}  {name}" for n, name in inclusive[:top]]
    lines += ["", "total %  the broker's own functions"]
    ours = [(n, f) for n, f in inclusive if "(broker/" in f]
    lines += [f"{100 * n / samples:7.1f}  {name}" for n, name in ours[:top]]
    return "\n".join(lines) + "\n"
