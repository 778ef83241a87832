"""Shared by the Serve tests: start the app on a free loopback port, ask every engine replica."""

import socket
from contextlib import contextmanager

import openai
import ray
from ray import serve

from deployments.app import build
from deployments.reports import replica_reports

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_app(**args):
    """Ray + Serve + the ponytail app on CPU engines; yields (openai client, port)."""
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)  # logical CPUs: fits a 2-core CI
    port = free_port()  # after Ray's own processes took their ports
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build({"device": "cpu", "kv_cache_memory": "256MiB", "max_num_seqs": 8, "max_model_len": 2048,
                         **args}), name="ponytail", route_prefix="/")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120,
                            max_retries=0), port
    finally:
        serve.shutdown()
        ray.shutdown()


def replica_stats(replicas: int = 2) -> dict:
    """{actor name: EngineStats} of every engine replica (the router picks one per call)."""
    return {name: report.stats for name, report in replica_reports("ponytail", replicas=replicas).items()}
