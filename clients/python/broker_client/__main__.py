"""Command line: `python -m broker_client tail STREAM_ID` and `python -m broker_client start ...`.

Exit codes: 0 when the turn ended `complete`, 1 when it ended any other way, 2 on errors (bad
arguments, unknown or expired stream, broker unreachable for too long), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import TextIO

import httpx

from .assemble import TurnText
from .client import AttachPolicy, BrokerClient, ReconnectInfo
from .errors import BrokerClientError

__all__ = ["main", "tail"]

_DEFAULT_URL = "http://127.0.0.1:8000"
_DEFAULTS = AttachPolicy()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _Console:
    """Writes streamed text to `out` and notes to `err` without gluing a note onto a text line."""

    def __init__(self, out: TextIO, err: TextIO, *, quiet: bool) -> None:
        self.out = out
        self.err = err
        self.quiet = quiet
        self._mid_line = False

    def text(self, piece: str) -> None:
        if piece:
            self.out.write(piece)
            self.out.flush()
            self._mid_line = not piece.endswith("\n")

    def end_line(self) -> None:
        if self._mid_line:
            self.out.write("\n")
            self.out.flush()
            self._mid_line = False

    def note(self, message: str) -> None:
        if self.quiet:
            return
        # On a terminal both streams share the screen: start the note on a line of its own.
        # Redirected output stays the exact answer text, so nothing is added to it.
        if _isatty(self.out) and _isatty(self.err):
            self.end_line()
        self.err.write(f"[{message}]\n")
        self.err.flush()


async def tail(
    client: BrokerClient,
    stream_id: str,
    *,
    offset: str = "-1",
    policy: AttachPolicy | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    quiet: bool = False,
) -> int:
    """Print a stream's delta text live until the turn is at rest; return the exit code."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    console = _Console(out, err, quiet=quiet)
    assembled = TurnText()

    def on_reconnect(info: ReconnectInfo) -> None:
        console.note(
            f"connection lost ({_describe(info.error)}); reconnecting in {info.delay:.1f}s"
        )

    async for event in client.attach(
        stream_id, offset=offset, policy=policy, on_reconnect=on_reconnect
    ):
        assembled.feed(event)
        if event.type == "delta":
            piece = event.data.get("text")
            if isinstance(piece, str):
                console.text(piece)
        elif event.type == "attempt":
            strategy = event.data.get("strategy")
            if strategy == "regenerate":
                console.end_line()  # a new answer replaces the old: start it on its own line
            if strategy != "initial":
                console.note(f"attempt {event.attempt}: {strategy}")
        elif event.type == "error":
            code, message = event.data.get("code"), event.data.get("message")
            console.note(f"error {code}: {message}")

    console.end_line()
    status = assembled.status
    reason = f" ({assembled.reason})" if assembled.reason else ""
    err.write(f"status: {status or 'unknown'}{reason}\n")
    err.flush()
    return 0 if status == "complete" else 1


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get("BROKER_URL", _DEFAULT_URL),
        help=f"broker base URL (default: $BROKER_URL or {_DEFAULT_URL})",
    )
    common.add_argument("-q", "--quiet", action="store_true", help="no notes on stderr")
    common.add_argument(
        "--max-retries",
        type=int,
        default=_DEFAULTS.max_retries,
        help="consecutive failed reconnects before giving up (default: %(default)s)",
    )
    common.add_argument(
        "--read-timeout",
        type=float,
        default=_DEFAULTS.read_timeout,
        help="seconds without any byte before a stream counts as dead (default: %(default)s)",
    )

    parser = argparse.ArgumentParser(
        prog="broker-client", description="Talk to a resumable stream broker."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    tail_cmd = commands.add_parser(
        "tail", parents=[common], help="print a stream's text live until the turn is at rest"
    )
    tail_cmd.add_argument("stream_id")
    tail_cmd.add_argument(
        "--offset", default="-1", help="'-1' from the start, 'now' for new events only, or an id"
    )

    start_cmd = commands.add_parser(
        "start", parents=[common], help="start a turn with one user message and print its JSON"
    )
    start_cmd.add_argument("prompt")
    start_cmd.add_argument("--conversation", required=True, help="conversation id")
    start_cmd.add_argument("--turn-id", help="idempotency key: reuse to get the same turn back")
    start_cmd.add_argument("--provider")
    start_cmd.add_argument("--model")
    start_cmd.add_argument("--system", help="system message placed before the prompt")
    start_cmd.add_argument("--tail", action="store_true", help="then follow the turn's stream")
    return parser


async def _run(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None) -> int:
    policy = AttachPolicy(max_retries=args.max_retries, read_timeout=args.read_timeout)
    async with (
        httpx.AsyncClient(transport=transport) as http,
        BrokerClient(args.url, http=http, policy=policy) as client,
    ):
        if args.command == "tail":
            return await tail(client, args.stream_id, offset=args.offset, quiet=args.quiet)
        messages = [{"role": "user", "content": args.prompt}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        turn = await client.start_turn(
            args.conversation,
            messages,
            turn_id=args.turn_id,
            provider=args.provider,
            model=args.model,
        )
        print(json.dumps(turn.raw, indent=2, sort_keys=True), flush=True)
        if args.tail:
            return await tail(client, turn.stream_id, quiet=args.quiet)
        return 0


def main(
    argv: Sequence[str] | None = None, *, transport: httpx.AsyncBaseTransport | None = None
) -> int:
    """Run the command line; `transport` lets tests serve the broker from memory."""
    args = _build_parser().parse_args(argv)
    try:
        return asyncio.run(_run(args, transport))
    except KeyboardInterrupt:
        return 130
    except (BrokerClientError, httpx.HTTPError, httpx.InvalidURL) as exc:
        sys.stdout.flush()
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
