"""Response headers that keep browsers safe: a strict policy for the demo page, and CORS.

Every response says ``nosniff`` and sends no ``Referer`` onwards (stream links may carry an
attach token). The demo page and its files also get a Content-Security-Policy that allows only
this origin's own scripts, styles and connections, and may not be framed.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PAGE_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
COMMON = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer")]
PAGE = [
    (b"content-security-policy", PAGE_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
]


# Durable Streams responses may be read from any origin's fetch() (the protocol asks for it).
CROSS_ORIGIN = [(b"cross-origin-resource-policy", b"cross-origin")]


def is_page(path: str) -> bool:
    return path == "/" or path.startswith("/static/")


def headers_for(path: str) -> list[tuple[bytes, bytes]]:
    """The headers above that a response to ``path`` carries."""
    if path.startswith("/ds/"):
        return COMMON + CROSS_ORIGIN
    return COMMON + PAGE if is_page(path) else COMMON


def with_headers(
    headers: list[tuple[bytes, bytes]], extra: list[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """``headers`` and those of ``extra`` it does not name already."""
    present = {name.lower() for name, _ in headers}
    return [*headers, *((n, v) for n, v in extra if n not in present)]


class SecurityHeaders:
    """Adds the headers above to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = headers_for(scope.get("path", ""))

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = with_headers(list(message.get("headers", [])), extra)
            await send(message)

        await self.app(scope, receive, send_with_headers)


def cors_origins(setting: str | None) -> list[str]:
    """``BROKER_CORS_ORIGINS`` as a list: empty (no CORS), ``["*"]``, or exact origins."""
    if not setting:
        return []
    return [origin.strip().rstrip("/") for origin in setting.split(",") if origin.strip()]
