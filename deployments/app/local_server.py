"""The OpenAI API over one engine replica in this process, without Ray: for tests through the
official `openai` client that need real tokens, and for benchmarks/lm_eval_check.py --local."""

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from deployments.api.server import build_app

from .replica import EngineReplica

WAIT_S = 10.0


@contextmanager
def local_server(port: int = 0, model: str | None = None, engine: dict | None = None, **options):
    """Yields (replica, base url) of the API on 127.0.0.1 (port 0: a free one). engine: LLM's
    arguments over these defaults: the CPU, 64 MiB of KV cache, 8 sequences of 1,024 tokens;
    options: the replica's (ReplicaOptions)."""
    engine = {"device": "cpu", "kv_cache_memory": "64MiB", "max_num_seqs": 8, "max_model_len": 1024, **(engine or {})}
    replica = EngineReplica(model, engine=engine, **options)
    with serve_on_loopback(build_app(replica), port) as url:
        yield replica, url


@contextmanager
def serve_on_loopback(app, port: int = 0):
    """Yields the base url of `app` served by uvicorn on 127.0.0.1 (port 0: a free one), in a thread."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=WAIT_S)
        sock.close()
    assert not thread.is_alive(), "uvicorn did not stop"
