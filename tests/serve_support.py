"""Shared by the Serve tests: start the app on a free loopback port, ask every engine replica."""

import socket
from contextlib import contextmanager

import openai
import ray
from ray import serve

from deployments.app.builder import build
from deployments.app.reports import replica_reports
from deployments.app.stream_closer import controller_options
from ponytail.config import field_owners

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_args(**args) -> dict:
    """The app's args on CPU engines (256 MiB of KV cache, 8 sequences of 2,048 tokens), with `args`
    over them: LLM's argument names go into `engine`, the others are the app's."""
    engine = {"device": "cpu", "kv_cache_memory": "256MiB", "max_num_seqs": 8, "max_model_len": 2048,
              **args.pop("engine", {})}
    for name in [name for name in args if name in field_owners() or name == "tuning"]:
        engine[name] = args.pop(name)
    return {**args, "engine": engine}


@contextmanager
def running_app(**args):
    """Ray + Serve + the ponytail app on CPU engines (app_args); yields (openai client, port)."""
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)  # logical CPUs: fits a 2-core CI
    port = free_port()  # after Ray's own processes took their ports
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, controller_options=controller_options())
        serve.run(build(app_args(**args)), name="ponytail", route_prefix="/")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120,
                            max_retries=0), port
    finally:
        serve.shutdown()
        ray.shutdown()


def replica_stats(replicas: int = 2) -> dict:
    """{actor name: EngineStats} of every engine replica (the router picks one per call)."""
    return {name: report.stats for name, report in replica_reports("ponytail", replicas=replicas).items()}
