"""Models named by hub id ("HuggingFaceTB/SmolLM2-135M-Instruct"), loaded by transformers itself.

Nothing of the hub is reimplemented here: transformers and huggingface_hub find the files in the
hub cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub), download what is
missing with their progress bars, and honour HF_HUB_OFFLINE=1 (cache only). This module only
says which names are hub ids and turns "not found" into an error that says what to do.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import ConfigError

# huggingface_hub's repo-id grammar: NAME or ORG/NAME, letters, digits, "-", "_", "."; no "--"
# or ".." and no leading or trailing "-"/"." (what validate_repo_id accepts, checked without it).
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"^(?:{_PART}/)?{_PART}$")


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a hub repo id (callers check local paths first)."""
    return bool(_REPO_ID.match(name)) and "--" not in name and ".." not in name


def check_hub_model(repo_id: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The model's config at `revision`, read through the hub cache (downloaded if allowed): fails
    fast and clearly, before a server starts replicas that would each fail on it."""
    from transformers import AutoConfig

    return _translate(repo_id, lambda: AutoConfig.from_pretrained(repo_id, revision=revision,
                                                                  trust_remote_code=trust_remote_code), revision)


def load_hub_model(repo_id: str, dtype: torch.dtype, device: torch.device, revision: str | None = None,
                   trust_remote_code: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer) through transformers' from_pretrained: cache, downloads, offline mode;
    revision (a branch, tag or commit) and trust_remote_code as transformers takes them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options = dict(revision=revision, trust_remote_code=trust_remote_code)

    def load():
        tokenizer = AutoTokenizer.from_pretrained(repo_id, **options)
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype, device_map=str(device), **options)
        return model, tokenizer

    return _translate(repo_id, load, revision)


def _translate(repo_id: str, load, revision: str | None = None):
    try:
        return load()
    except OSError as exc:  # transformers' "not found / cannot connect / gated" errors are OSErrors
        which = f"name_or_path={repo_id!r}" + ("" if revision is None else f" revision={revision!r}")
        raise ConfigError(f"{which}: {_what_to_do(repo_id)}\n(transformers: {exc})") from None


def _what_to_do(repo_id: str) -> str:
    from huggingface_hub import constants

    where = f"the hub cache {constants.HF_HUB_CACHE}"
    if constants.HF_HUB_OFFLINE:
        return (f"this hub id is not in {where} and HF_HUB_OFFLINE=1 forbids downloading it. "
                f"Download it where the hub can be reached (`hf download {repo_id}`) and copy the "
                "cache here (HF_HOME or HF_HUB_CACHE point at it), unset HF_HUB_OFFLINE to download, "
                "or pass a local checkpoint directory")
    return (f"this hub id is not in {where} and could not be downloaded (no such repo, a gated "
            f"repo without a token, or no network). Check the name, run `hf auth login` for a "
            f"gated model, or download it elsewhere (`hf download {repo_id}`) and copy the cache "
            "here, or pass a local checkpoint directory")
