"""`ponytail serve` and the app's typed arguments: --help, bad flags, the README example through the
real command, `serve run deployments.app:build key=value`, a hub id from a local hub cache. Loopback only."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

try:
    import httpx2 as httpx  # the HTTP library openai>=3 depends on
except ImportError:  # pragma: no cover - older openai clients use httpx
    import httpx

from deployments.app.args import AppArgs  # noqa: E402
from hub_cache import HUB_ID, REVISION, build_hub_cache, offline_env  # noqa: E402
from ponytail.cli import main  # noqa: E402
from ponytail.config import engine_fields  # noqa: E402
from serve_support import MODEL, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERVE = str(Path(sys.executable).with_name("serve"))  # Ray's `serve` CLI, from this environment
README_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_every_knob_with_its_default(capsys):
    code, out, _ = run(capsys, "serve", "--help")
    assert code == 0
    text = " ".join(out.split())  # argparse wraps lines
    for flag in ("--host", "--port", "--address", "--replicas", "MODEL"):
        assert flag in text
    defaults = {name: field.default_factory() if field.default_factory else field.default
                for name, field in AppArgs.model_fields.items() if name not in ("model", "engine")}
    defaults.update({field.name: None if field.default is dataclasses.MISSING else field.default
                     for section, field, _ in engine_fields() if section != "tuning"})  # the engine's, flat
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        entry = re.search(rf"^  {flag}[ ,](.*?)(?=^  -|^\S|\Z)", out, re.MULTILINE | re.DOTALL)
        assert entry is not None, f"{flag} is missing from --help"
        shown = "unset" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        assert f"(default: {shown})" in " ".join(entry.group(1).split()), flag
    assert "--compile-model, --no-compile-model" in out and "--tuning JSON" in out


@pytest.mark.parametrize("argv, message", [
    (["--max-replicas", "two"], "--max-replicas='two': Input should be a valid integer"),
    (["--device", "tpu"], "--device: device='tpu' is not supported; allowed: auto, cuda, cuda:N, cpu"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory: kv_cache_memory='lots' is not a byte size"),
    (["--max-num-seqs", "0"], "--max-num-seqs: max_num_seqs=0 is not supported; allowed: an integer >= 1"),
    (["--min-replicas", "3"], "min_replicas=3, max_replicas=2: need 1 <= min_replicas <= max_replicas"),
    (["--replicas", "2", "--max-replicas", "3"], "--replicas=2 sets --min-replicas and --max-replicas; "
                                                 "allowed: --replicas alone, or --max-replicas without it"),
    (["--stream-interval-s", "5"], "--stream-interval-s: stream_interval_s=5 is not supported"),
    (["--scheduling-policy", "lottery"], "--scheduling-policy: scheduling_policy='lottery' is not supported; "
                                         "allowed: fcfs, priority"),
    (["--revision", ""], "--revision: revision='' is not supported; allowed: a branch, tag or commit"),
    (["--tuning", '{"fuse_projections": "yes"}'], "fuse_projections='yes' is not supported; allowed: True, False"),
])
def test_bad_flags_name_the_argument_before_anything_starts(capsys, argv, message):
    code, out, err = run(capsys, "serve", *argv)
    assert (code, out) == (2, "")
    assert err.startswith("ponytail: error: ") and message in err
    assert "Traceback" not in err


def test_flags_become_typed_app_args():
    from deployments.cli import app_args
    from ponytail.cli import _build_parser

    parser_args = ["serve", "org/model", "--replicas", "3", "--kv-cache-memory", "4GiB", "--compile-model",
                   "--max-hold-s", "0", "--served-model-name", "mine", "--max-num-seqs", "32",
                   "--tuning", '{"prefill_delay_factor": 0}']
    settings = app_args(_build_parser().parse_args(parser_args))
    assert (settings.model, settings.min_replicas, settings.max_replicas) == ("org/model", 3, 3)
    assert settings.engine == {"kv_cache_memory": "4GiB", "compile_model": True, "max_num_seqs": 32,
                               "tuning": {"prefill_delay_factor": 0}}
    assert settings.max_hold_s == 0.0
    assert settings.served_name() == "mine"
    assert app_args(_build_parser().parse_args(["serve"])) == AppArgs()  # unset flags: the model's defaults
    assert AppArgs(model=HUB_ID).served_name() == HUB_ID  # a client loads the tokenizer by this name


def _as_in_a_terminal() -> None:
    """In the child before exec: SIGINT as a terminal's foreground job has it. A shell script's
    background job (`cmd &` without job control) inherits SIGINT ignored, and Python then installs
    no KeyboardInterrupt handler, so the Ctrl-C these tests send would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stream_chat(port: int, events: list, opened: threading.Event) -> None:
    """A long streamed chat: each event's data and when it came into `events` ([DONE]'s time: None)."""
    body = {"model": MODEL, "messages": README_QUESTION, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append((data, None if data == "[DONE]" else time.monotonic()))
                opened.set()


def _wait_for(log: Path, text: str, process: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = log.read_text(errors="replace")
        if text in content:
            return content
        if process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode} before {text!r}:\n{content[-4000:]}")
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} after {timeout} s:\n{log.read_text(errors='replace')[-4000:]}")


@pytest.mark.chaos
@pytest.mark.network  # the default model
def test_ponytail_serve_answers_the_readme_example_and_ctrl_c_ends_open_streams_after_the_timeout(default_model, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:  # a file, not a pipe: Ray's logs must never block the server
        process = subprocess.Popen([sys.executable, "-m", "ponytail.cli", "serve", "--port", str(port),
                                    "--replicas", "1", "--shutdown-timeout-s", "3"], stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, preexec_fn=_as_in_a_terminal, cwd=tmp_path)
    try:
        content = _wait_for(log, "Ctrl-C stops it", process, timeout=300)
        assert f"ponytail: serving '{MODEL}' at http://127.0.0.1:{port}/v1" in content
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120,
                               max_retries=0)
        assert [m.id for m in client.models.list().data][1:] == [MODEL]  # first: where the tokenizer loads from
        chat = client.chat.completions.create(model=MODEL, temperature=0, messages=README_QUESTION)
        assert chat.choices[0].message.content == "The capital of France is Paris."  # as README says

        streams = [([], threading.Event()) for _ in range(3)]  # long answers, still streaming at Ctrl-C
        readers = [threading.Thread(target=_stream_chat, args=(port, *stream)) for stream in streams]
        for reader in readers:
            reader.start()
        for _, opened in streams:
            assert opened.wait(120)
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole group
        interrupted = time.monotonic()
        for reader in readers:
            reader.join(120)
        assert process.wait(timeout=120) == 0
        for events, _ in streams:  # each streamed on for --shutdown-timeout-s, then ended explicitly
            assert events[-1] == ("[DONE]", None) and events[-2][1] >= interrupted + 3
            assert json.loads(events[-2][0])["error"]["code"] == "service_unavailable"
            assert all(json.loads(data)["choices"][0]["finish_reason"] is None for data, _ in events[:-2])
        content = log.read_text(errors="replace")
        assert "ponytail: stopping" in content and "ponytail: stopped" in content
        assert "open requests finish for up to 3 s" in content
        assert "Traceback" not in content.split("ponytail: stopping")[1]
        assert "graceful_shutdown failed" not in content
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_serve_run_refuses_a_mistyped_argument_by_name():
    done = subprocess.run([SERVE, "run", "deployments.app:build", "max_replicas=two"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "max_replicas" in output and "Input should be a valid integer" in output and "'two'" in output


@pytest.mark.network  # the default model, as a hub id
def test_serve_run_key_values_are_typed_and_a_hub_id_serves_from_the_hub_cache(default_model, tmp_path,
                                                                                 monkeypatch):
    """`serve run deployments.app:build max_replicas=1 ...` (strings, as Serve's CLI passes them)
    onto a running cluster whose replicas see only a local hub cache, offline, pinned to the snapshot's
    commit (vLLM's --revision); then `ponytail serve --address` attached to that cluster."""
    import ray
    from ray import serve

    from ponytail.models.loader import cache_dir

    build_hub_cache(tmp_path / "hub", cache_dir() / "models" / "smollm2-135m-instruct")
    for key, value in offline_env(tmp_path).items():
        if key.startswith("HF_"):
            monkeypatch.setenv(key, value)  # before ray.init: the cluster's workers inherit it
    port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)  # logical CPUs: fits a 2-core CI
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = {"revision": REVISION, "device": "cpu", "kv_cache_memory": "256MiB", "max_num_seqs": 8,
                  "max_model_len": 2048, "compile_model": False}
        args = [f"model={HUB_ID}", "min_replicas=1", "max_replicas=1", "stream_interval_s=0.02",
                f"engine={json.dumps(engine)}"]  # the engine's arguments as one JSON object
        done = subprocess.run([SERVE, "run", "--address", ray.get_runtime_context().gcs_address,
                               "--non-blocking", "--name", "ponytail", "deployments.app:build", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        status = serve.status().applications["ponytail"]
        assert status.status == "RUNNING"
        engine = status.deployments["EngineReplica"]
        assert sum(engine.replica_states.values()) == 1

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120,
                               max_retries=0)
        assert [m.id for m in client.models.list().data] == [HUB_ID]  # the hub id is the served name
        chat = client.chat.completions.create(model=HUB_ID, temperature=0, messages=README_QUESTION)
        assert chat.choices[0].message.content == "The capital of France is Paris."

        # `ponytail serve --address` on the same running cluster: Ctrl-C takes off only its own app.
        serve.delete("ponytail")
        log = tmp_path / "attached.log"
        with log.open("w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "ponytail.cli", "serve", HUB_ID, "--address",
                 ray.get_runtime_context().gcs_address, "--replicas", "1", "--device", "cpu",
                 "--kv-cache-memory", "256MiB", "--max-num-seqs", "8", "--served-model-name", "smol"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_as_in_a_terminal,
                cwd=tmp_path)
        try:
            content = _wait_for(log, "Ctrl-C stops it", process, timeout=300)
            assert "serving 'smol' at the HTTP address of the Serve already running there" in content
            chat = client.chat.completions.create(model="smol", temperature=0, messages=README_QUESTION)
            assert chat.choices[0].message.content == "The capital of France is Paris."
            os.killpg(process.pid, signal.SIGINT)
            assert process.wait(timeout=120) == 0
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        after = serve.status()
        assert "ponytail" not in after.applications and after.proxies  # the cluster's Serve still runs
    finally:
        serve.shutdown()
        ray.shutdown()


def test_a_hub_id_not_in_the_cache_says_what_to_do(tmp_path):
    """Offline with an empty hub cache: refused before Ray starts, with what to do."""
    done = subprocess.run([sys.executable, "-m", "ponytail.cli", "serve", HUB_ID], env=offline_env(tmp_path),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    err = " ".join(done.stderr.split())
    assert err.startswith(f"ponytail: error: name_or_path='{HUB_ID}': this hub id is not in the hub cache "
                          f"{tmp_path / 'hub'} and HF_HUB_OFFLINE=1 forbids downloading it")
    assert f"`hf download {HUB_ID}`" in err and "unset HF_HUB_OFFLINE" in err
    assert "Started a local Ray instance" not in done.stdout + done.stderr


def test_without_the_serve_extra_serve_says_what_to_install(capsys, monkeypatch):
    """A base install (no Ray Serve): `ponytail serve` names the extra to install, not a NameError."""
    monkeypatch.setitem(sys.modules, "deployments.app.args", None)  # its import raises ImportError
    code, out, err = run(capsys, "serve")
    assert code != 0 and "ponytail serve needs Ray Serve: pip install -e '.[serve]'" in out + err
    assert "NameError" not in out + err
