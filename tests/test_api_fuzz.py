"""The HTTP API fuzzed from its own OpenAPI document (schemathesis, built on hypothesis): no request
it generates gets a 5xx, and the pool holds no KV blocks afterwards.

Every POST route documents its body in /openapi.json (deployments/openapi_bodies.py), so the
generated requests reach the engine: chat, completions, responses, tokenize, Anthropic's messages.
The run is schemathesis's own command line, as an operator would run it against a replica
(docs/serving.md, where a longer run found the two faults the API tests now pin); its pytest plugin
does not load under this pytest."""

from __future__ import annotations

import subprocess
import sys
import time

from deployments.app.local_server import local_server

# Per route in the fuzzing phase. The coverage phase's boundary values (empty lists, extreme numbers,
# wrong types for every field) come on top: about 2,200 requests in all, 2-4 minutes on two cores.
EXAMPLES = 5
RUN_TIMEOUT_S = 900
DRAIN_S = 30.0


def test_generated_requests_get_no_server_error_and_leave_no_blocks(tmp_path):
    with local_server(engine=dict(max_num_seqs=4, max_model_len=96)) as (replica, url):
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "not_a_server_error",
             "--max-examples", str(EXAMPLES), "--seed", "1", "--request-timeout", "120", "--warnings", "off",
             "--no-shrink"],
            cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        assert "No issues found" in run.stdout, run.stdout[-3000:]
        deadline = time.monotonic() + DRAIN_S
        stats = replica.llm.stats()
        while (stats.used_blocks or stats.num_running or stats.num_waiting) and time.monotonic() < deadline:
            time.sleep(0.1)
            stats = replica.llm.stats()
        assert (stats.used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)
