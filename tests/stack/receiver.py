"""An Alertmanager webhook receiver that records what it is sent: CI's stand-in for a pager.

``python receiver.py PORT`` serves ``POST /alerts`` (Alertmanager's webhook payload, kept in
order of arrival) and ``GET /alerts`` (every payload so far, as a JSON list) on 127.0.0.1.
Standard library only: it runs in the broker's image, mounted by tests/stack/compose.ci.yaml.
"""

from __future__ import annotations

import http.server
import json
import sys
import threading
from typing import Any

received: list[Any] = []
lock = threading.Lock()


class Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        payload = json.loads(self.rfile.read(length))
        with lock:
            received.append(payload)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        with lock:
            body = json.dumps(received).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write(f"receiver: {format % args}\n")


if __name__ == "__main__":
    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Receiver)
    server.serve_forever()
