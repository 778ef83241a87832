"""The default model behind a local OpenAI-compatible server (deployments/local_server.py), and the
official openai client pointed at it, for the tests that drive the API through that client."""

from contextlib import contextmanager

import openai

from deployments.app.local_server import local_server


@contextmanager
def served_openai():
    """(replica, client, url) while the server runs."""
    with local_server() as (replica, url):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as client:
            yield replica, client, url
