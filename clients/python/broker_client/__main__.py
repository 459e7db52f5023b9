"""Command line: `python -m broker_client tail STREAM_ID`, `start ...` and `share TURN_ID`.

Exit codes: 0 when the turn ended `complete`, 1 when it ended any other way, 2 on errors (bad
arguments, refused credentials, unknown or expired stream, broker unreachable for too long), 130
on Ctrl-C. A `tail` of a turn already at rest (`--offset now` after its end) prints no text and
reports the turn's final status with the same codes. `--api-key` (default `$BROKER_API_KEY`)
is sent as a bearer credential.
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
    token: str | None = None,
    policy: AttachPolicy | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    quiet: bool = False,
) -> int:
    """Print a stream's delta text live until the turn is at rest; return the exit code.

    `token` is an attach token to read with instead of the client's credential.
    """
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    console = _Console(out, err, quiet=quiet)
    assembled = TurnText()

    def on_reconnect(info: ReconnectInfo) -> None:
        console.note(
            f"connection lost ({_describe(info.error)}); reconnecting in {info.delay:.1f}s"
        )

    async for event in client.attach(
        stream_id, offset=offset, token=token, policy=policy, on_reconnect=on_reconnect
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
    status, reason = assembled.status, assembled.reason
    if status is None:
        # Nothing came after the resume point because the turn is at rest (the broker answered
        # 204, e.g. `--offset now` on a finished stream): its last `end` holds the final status.
        console.note("nothing after this point: the turn is at rest")
        final = TurnText()
        async for event in client.attach(stream_id, token=token, policy=policy):
            final.feed(event)
        status, reason = final.status, final.reason
    because = f" ({reason})" if reason else ""
    err.write(f"status: {status or 'unknown'}{because}\n")
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
    common.add_argument(
        "--api-key",
        help="API key or JWT sent as 'Authorization: Bearer ...' (default: $BROKER_API_KEY)",
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
    tail_cmd.add_argument("--token", help="an attach token: read with it instead of a key")

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

    share_cmd = commands.add_parser(
        "share",
        parents=[common],
        help="mint a read-only attach token for a turn's stream and print it as JSON",
    )
    share_cmd.add_argument("turn_id")
    share_cmd.add_argument("--ttl", type=float, help="lifetime in seconds (default: the broker's)")
    share_cmd.add_argument(
        "--one-viewer", action="store_true", help="admit one connection at a time"
    )
    return parser


def _api_key(args: argparse.Namespace) -> str | None:
    key: str | None = args.api_key or os.environ.get("BROKER_API_KEY") or None
    return key


async def _run(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None) -> int:
    policy = AttachPolicy(max_retries=args.max_retries, read_timeout=args.read_timeout)
    async with (
        httpx.AsyncClient(transport=transport) as http,
        BrokerClient(args.url, http=http, policy=policy, api_key=_api_key(args)) as client,
    ):
        if args.command == "tail":
            return await tail(
                client, args.stream_id, offset=args.offset, token=args.token, quiet=args.quiet
            )
        if args.command == "share":
            minted = await client.mint_attach_token(
                args.turn_id, ttl_s=args.ttl, one_viewer=args.one_viewer
            )
            shared = {
                "token": minted.token,
                "turn_id": minted.turn_id,
                "stream_id": minted.stream_id,
                "expires_at": minted.expires_at,
                "one_viewer": minted.one_viewer,
                "stream_url": minted.stream_url,
            }
            print(json.dumps(shared, indent=2), flush=True)
            return 0
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
    parser = _build_parser()
    args = parser.parse_args(argv)
    key = _api_key(args)
    if key is not None and (not key.strip() or any(c in key for c in "\r\n")):
        parser.error("the API key must be one non-empty line")
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
