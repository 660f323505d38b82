"""A uvicorn server in a background thread, on 127.0.0.1, for the server tests."""

import socket
import threading
import time

import uvicorn

from hierspec.server import ServerConfig, build_app

MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """A uvicorn server in a background thread."""

    def __init__(self, target, drafter, **config) -> None:
        self.app, self.engine = build_app(target, drafter, ServerConfig(model_name=MODEL, **config))
        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.close()
