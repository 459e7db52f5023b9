"""Command line: ``broker serve [--host --port --workers N|auto --role all|api|worker]``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType

from broker import __version__, logs
from broker.app import Runtime, Server, create_app, server_config
from broker.auth import Authenticator, new_api_key
from broker.connection import RedisConnectError
from broker.embedded_redis import EmbeddedRedisError
from broker.memory import settle
from broker.providers import Providers
from broker.settings import ROLES, Settings, SettingsError
from broker.tools import ToolConfigError, ToolRegistry
from broker.webhook_config import new_secret
from broker.workers import serve_workers

log = logging.getLogger("broker")


def _loadgen() -> ModuleType | None:
    """The load generator: a client tool, shipped with the client package (broker_client)."""
    try:
        from broker_client import loadgen
    except ImportError:
        return None
    return loadgen


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="broker", description=__doc__)
    parser.add_argument("--version", action="version", version=f"broker {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="serve the API and run workers (with an embedded Redis by default)"
    )
    serve.add_argument("--host", help="address to bind (BROKER_HOST, default 127.0.0.1)")
    serve.add_argument("--port", help="port to bind, 0 = any free (BROKER_PORT, 8000)")
    serve.add_argument("--role", choices=ROLES, help="all (default), api or worker (BROKER_ROLE)")
    serve.add_argument(
        "--workers", help="processes serving the port: a number or auto (BROKER_WORKERS, 1)"
    )
    # How a supervisor (broker.workers) hands its processes the socket and a pipe for "ready".
    serve.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    commands.add_parser("providers", help="list the configured providers and their models")
    commands.add_parser("new-key", help="print a new random API key (for BROKER_API_KEYS)")
    commands.add_parser(
        "new-webhook-secret", help="print a new random secret (for BROKER_WEBHOOK_SECRET)"
    )
    loadgen = _loadgen()
    if loadgen is not None:
        loadgen.add_parser(commands)
    else:
        stub = commands.add_parser("loadgen", help="(needs the broker-client package)")
        stub.add_argument("args", nargs=argparse.REMAINDER)
    tools = commands.add_parser("tools", help="inspect the tool registry (BROKER_TOOLS)")
    tools_commands = tools.add_subparsers(dest="tools_command", required=True)
    audit = tools_commands.add_parser(
        "audit", help="print which tools can double-fire and how each is protected"
    )
    audit.add_argument("--file", help="tools file (default: BROKER_TOOLS)")
    return parser


def list_providers() -> int:
    """``broker providers``: what turns may name as ``provider`` and ``model`` (never keys)."""
    try:
        settings = Settings.from_env()
        providers = Providers(settings)
    except SettingsError as exc:
        print(f"broker: {exc}", file=sys.stderr)
        return 2
    for index, provider in enumerate(providers):
        models = ", ".join(provider.models) if provider.models else "(any)"
        default = " (default)" if index == 0 else ""
        print(f"{provider.name:<10} {provider.description}{default}\n{'':<10} models: {models}")
    source = (
        f"BROKER_PROVIDERS={settings.providers}" if settings.providers else "BROKER_PROVIDERS unset"
    )
    left_out = [name for name in providers.known if name not in providers.names]
    print(f"served: {', '.join(providers.names)} ({source})")
    print(f"not served: {', '.join(left_out) or 'none'}")
    asyncio.run(providers.aclose())
    return 0


def audit_tools(path: str | None) -> int:
    """``broker tools audit``: the registry's double-fire risk, tool by tool."""
    if not path:
        print("broker: no tools file: set BROKER_TOOLS or pass --file", file=sys.stderr)
        return 2
    try:
        registry = ToolRegistry.from_file(path)
    except ToolConfigError as exc:
        print(f"broker: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(registry.audit())
    return 0


def given_flags(args: argparse.Namespace) -> dict[str, str]:
    """The flags of ``broker serve`` that were given, as the variables they stand for."""
    flags = {
        "BROKER_HOST": args.host,
        "BROKER_PORT": args.port,
        "BROKER_ROLE": args.role,
        "BROKER_WORKERS": args.workers,
    }
    return {name: value for name, value in flags.items() if value is not None}


def serve_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """What ``broker serve`` runs with: ``environ``, and its flags over it.

    A flag is read as the variable it names, by the same parser: one check, one message, which
    names the flag when the flag's value is the bad one.
    """
    given = given_flags(args)
    try:
        return Settings.from_env({**environ, **given})
    except SettingsError as exc:
        flag = next((name for name in given if str(exc).startswith(f"{name} ")), None)
        if flag is None:
            raise
        raise SettingsError(f"{exc} (given as --{flag.removeprefix('BROKER_').lower()})") from None


# Open files a process needs besides its client connections (Redis, logs, the listening socket).
FILE_HEADROOM = 1_024


def raise_file_limit(settings: Settings) -> None:
    """Lift this process's soft limit on open files to what ``BROKER_MAX_CONNECTIONS`` needs.

    The limit is raised at most to the hard limit; when that is still short, a warning says so,
    since connections past the descriptors fail at accept instead of getting the broker's 503.
    """
    try:
        import resource
    except ImportError:  # not on this platform: nothing to raise
        return
    # The cap, the tenth past it that is closed unanswered, and Redis connections and files.
    wanted = settings.max_connections + settings.max_connections // 10 + FILE_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning(
            "BROKER_MAX_CONNECTIONS=%d needs about %d open files but this process may open %d "
            "(ulimit -n): lower BROKER_MAX_CONNECTIONS or raise the limit",
            settings.max_connections,
            wanted,
            soft,
        )


def serve(settings: Settings, listen_fd: int | None = None, ready_fd: int | None = None) -> int:
    """Run the broker until SIGINT/SIGTERM; returns the exit code.

    ``listen_fd`` and ``ready_fd``: one of a supervisor's processes (see :mod:`broker.workers`)
    serves the socket it inherited and writes a line to the pipe once it serves.

    On uvloop when it is installed (a dependency, except on Windows): the event loop does the
    fan-out's socket work, and uvloop does it in C.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_serve(settings, listen_fd, ready_fd))
    return uvloop.run(_serve(settings, listen_fd, ready_fd))


async def _serve(settings: Settings, listen_fd: int | None, ready_fd: int | None) -> int:
    # Start Redis (or connect) before uvicorn, so a failure is one clear line, not a traceback.
    runtime = await Runtime.start(settings)
    raise_file_limit(settings)
    server = Server(server_config(settings, create_app(settings, runtime)))
    server.ready_fd = ready_fd
    sockets = None if listen_fd is None else [socket.socket(fileno=listen_fd)]
    settle()  # everything is loaded: the collector's full passes need not walk it again
    try:
        await server.serve(sockets)
    finally:
        await runtime.close()  # idempotent; covers a bind failure before the lifespan ran
    return 0 if server.started else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "loadgen":
        loadgen = _loadgen()
        if loadgen is None:
            print("broker loadgen: install the client package (broker-client)", file=sys.stderr)
            return 2
        return int(loadgen.run(args))
    if args.command == "tools":
        return audit_tools(args.file or os.environ.get("BROKER_TOOLS"))
    if args.command == "providers":
        return list_providers()
    if args.command == "new-key":
        print(new_api_key())
        return 0
    if args.command == "new-webhook-secret":
        print(new_secret())
        return 0
    try:
        settings = serve_settings(args, os.environ)
        Authenticator(settings, b"")  # a bad key file or JWT key fails here, in one line
    except SettingsError as exc:
        print(f"broker: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    try:
        if settings.workers != "1" and args.listen_fd is None:
            return serve_workers(settings, {**os.environ, **given_flags(args)})
        return serve(settings, args.listen_fd, args.ready_fd)
    except (RedisConnectError, EmbeddedRedisError, ToolConfigError) as exc:
        print(f"broker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the server took the signals, or after
        print("broker: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
