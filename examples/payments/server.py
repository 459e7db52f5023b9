"""A toy payment endpoint for docs/tools.md's tool-call example: it counts every payment it makes.

    python examples/payments/server.py            # serves http://127.0.0.1:9000 until Ctrl-C

``POST /pay`` with the broker's tool body (``{"name", "arguments": {"to", "amount"}}``) makes a
payment and answers ``{"payment_id", "to", "amount"}``. ``GET /payments`` answers
``{"count", "payments"}``: how many payments were made, and each one with the
``Idempotency-Key`` it came with. The server deliberately ignores that key, like an endpoint that
cannot deduplicate (the broker's ``unkeyed_write`` class): any second payment it counts is one
the broker let through. It binds loopback only, keeps everything in memory and needs nothing
but the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY_BYTES = 65536


class Ledger:
    """The payments made so far (thread-safe: the server answers each request in a thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._payments: list[dict[str, Any]] = []

    def pay(self, to: str, amount: float, key: str | None) -> dict[str, Any]:
        with self._lock:
            payment = {"payment_id": len(self._payments) + 1, "to": to, "amount": amount}
            self._payments.append({**payment, "idempotency_key": key})
            return payment

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"count": len(self._payments), "payments": list(self._payments)}


def make_handler(ledger: Ledger) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "example-payments/1"

        def do_GET(self) -> None:
            if self.path != "/payments":
                self._answer(404, {"error": "not found"})
                return
            self._answer(200, ledger.snapshot())

        def do_POST(self) -> None:
            if self.path != "/pay":
                self._answer(404, {"error": "not found"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY_BYTES:
                self._answer(400, {"error": "a JSON body is required"})
                return
            try:
                body = json.loads(self.rfile.read(length))
                arguments = body["arguments"]
                to, amount = str(arguments["to"]), float(arguments["amount"])
            except (ValueError, KeyError, TypeError):
                self._answer(400, {"error": 'expected {"arguments": {"to", "amount"}}'})
                return
            payment = ledger.pay(to, amount, self.headers.get("Idempotency-Key"))
            print(f"paid {amount:g} to {to} (payment {payment['payment_id']})", flush=True)
            self._answer(200, payment)

        def _answer(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per payment is printed above; no access log

    return Handler


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A toy payment endpoint that counts payments.")
    parser.add_argument("--port", type=int, default=9000, help="port on 127.0.0.1 (0: any)")
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(Ledger()))
    print(f"payments serving on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
