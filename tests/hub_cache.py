"""A hub cache laid out the way huggingface_hub writes one, filled from the default model's files.

<root>/models--ORG--NAME/blobs/<sha256>, snapshots/<rev>/<file> -> ../../blobs/<sha256>,
refs/main holding <rev>. With HF_HUB_CACHE=<root> and HF_HUB_OFFLINE=1, transformers loads
"ORG/NAME" from it exactly as from a cache a download had filled.
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
REVISION = hashlib.sha1(b"ponytail test snapshot").hexdigest()  # a commit hash's shape: 40 hex


def build_hub_cache(root: Path, checkpoint: Path, repo_id: str = HUB_ID) -> Path:
    """Fill `root` with `checkpoint`'s files as the snapshot of `repo_id` at refs/main."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / REVISION
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(checkpoint.iterdir()):
        if file.name.startswith("ponytail-"):  # ponytail's conversion marker is no hub file
            continue
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blobs / digest)
        os.symlink(Path("..", "..", "blobs", digest), snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return root


def add_revision(root: Path, tag: str, files: dict[str, str], repo_id: str = HUB_ID) -> str:
    """A second snapshot of `repo_id` in the cache `root`: refs/main's files, `files` (name -> text)
    replacing or adding some, under refs/<tag>. Returns its commit hash."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(f"ponytail test snapshot {tag}".encode()).hexdigest()
    main, snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text(), repo / "snapshots" / commit
    snapshot.mkdir()
    for link in sorted(main.iterdir()):
        if link.name not in files:
            os.symlink(os.readlink(link), snapshot / link.name)
    for name, text in files.items():
        digest = hashlib.sha256(text.encode()).hexdigest()
        (repo / "blobs" / digest).write_text(text)
        os.symlink(Path("..", "..", "blobs", digest), snapshot / name)
    (repo / "refs" / tag).write_text(commit)
    return commit


def offline_env(hf_home: Path) -> dict:
    """This process's environment pointed at `hf_home`, with the hub forbidden."""
    env = dict(os.environ)
    env.update(HF_HOME=str(hf_home), HF_HUB_CACHE=str(hf_home / "hub"), HF_HUB_OFFLINE="1")
    return env


def run_offline(script: str, hf_home: Path) -> str:
    """Run a Python script in a fresh process pointed at `hf_home` with the hub forbidden (the hub
    library reads HF_HUB_CACHE and HF_HUB_OFFLINE at import); its stdout, after it exits 0."""
    done = subprocess.run([sys.executable, "-c", script], env=offline_env(hf_home), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
