"""The `ponytail` command. One subcommand per job: `estimate` sizes a KV cache, `bench` checks the
engine on a model; installed packages add more through the entry point group `ponytail.commands`
(deployments adds `serve`), so the library never imports them."""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from .bench.command import add_parser as add_bench_parser
from .kv.config import CacheConfig
from .errors import ConfigError, PonytailError
from .kv.capacity import count_parameters, device_capacity
from .kv.estimate import KVEstimate, estimate_from_config, estimate_kv_cache
from .config import GPU_BATCHED_TOKENS, GPU_PREFILL_ONLY_BATCHED_TOKENS, token_budgets
from .models.hub import check_hub_model, is_hub_id
from .models.loader import default_checkpoint
from .utils.units import parse_bytes

COMMANDS_GROUP = "ponytail.commands"  # entry points: functions that add a subcommand to the parser

# --flag -> estimate_kv_cache argument, for the shape flags --model can stand in for.
_SHAPE_FLAGS = {
    "--num-layers": "num_layers",
    "--num-kv-heads": "num_kv_heads",
    "--head-dim": "head_dim",
    "--max-seq-len": "max_seq_len",
}


# The shape flags only a model can otherwise give: with none set, --device-memory takes the default model.
_SHAPE_ONLY = ("num_layers", "num_kv_heads", "head_dim")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for bad input, with no traceback)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.run(args)
    except PonytailError as exc:
        print(f"ponytail: error: {exc}", file=sys.stderr)
        return 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ponytail", description="Paged KV cache for LLM serving."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    est = commands.add_parser(
        "estimate",
        help="how much memory a KV cache needs",
        description="Estimate KV-cache memory for a model shape, given by flags or by --model.",
    )
    est.add_argument("--model", metavar="PATH_OR_ID",
                     help="local model directory holding config.json, a config.json file, or a hub id "
                          "(ORG/NAME, its config read through transformers' hub cache); supplies the shape "
                          "flags (explicit flags must agree with it)")
    est.add_argument("--revision", help="with a hub id: its branch, tag or commit (default: main)")
    est.add_argument("--num-layers", type=int, help="decoder layers")
    est.add_argument("--num-kv-heads", type=int, help="key/value heads per layer")
    est.add_argument("--head-dim", type=int, help="elements per head")
    est.add_argument("--dtype", help="bfloat16, float16 or float32: what the weights are loaded as (default: "
                                     "bfloat16 with --device-memory, as LLM() loads on CUDA; else the model's "
                                     "with --model, else float16)")
    est.add_argument("--max-batch-size", type=int, default=1,
                     help="sequences held at once (default: 1)")
    est.add_argument("--max-seq-len", type=int,
                     help="tokens per sequence (default with --model: max_position_embeddings)")
    est.add_argument("--block-size", type=int, default=16, help="tokens per block (default: 16)")
    est.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                     help="how K/V are stored: auto (the model's dtype), fp8 or fp8_e4m3 (default: auto); the "
                          "estimate also prints the other's capacity")
    est.add_argument("--gpu-memory", metavar="SIZE",
                     help='KV memory available ("80GB", "80GiB" or bytes): '
                          "how many full-length sequences fit")
    device = est.add_argument_group("a whole GPU: the KV pool LLM() would size there")
    device.add_argument("--device-memory", metavar="SIZE",
                        help='the GPU\'s total memory ("80GiB" for an 80 GB H100): its KV pool ceiling, with the '
                             "weights counted from --model's config (without --model: the embedded default "
                             "model's) and one step's activations left free")
    device.add_argument("--gpu-memory-utilization", type=float, metavar="SHARE",
                        help="the share of the device the process may hold, as LLM(gpu_memory_utilization=) "
                             "and vLLM take it (default: the engine's default sizing, 0.9 less one step)")
    device.add_argument("--max-num-seqs", type=int, default=256,
                        help="the engine's max_num_seqs, which one step's activations depend on (default: 256)")
    device.add_argument("--max-num-batched-tokens", type=int,
                        help=f"the engine's token budget per step (default: {GPU_BATCHED_TOKENS}, LLM()'s on CUDA)")
    device.add_argument("--prefill-only-batched-tokens", type=int,
                        help="the budget of a step without decode rows, which one step's activations are sized for "
                             f"when larger (default: {GPU_PREFILL_ONLY_BATCHED_TOKENS} where --max-num-batched-tokens "
                             "is left to its default, else the same: LLM()'s on CUDA)")
    est.add_argument("--json", action="store_true", help="print the estimate as JSON")
    est.set_defaults(run=_run_estimate)
    for entry in importlib.metadata.entry_points(group=COMMANDS_GROUP):  # `serve`, from deployments
        entry.load()(commands)
    add_bench_parser(commands)
    return parser


def _run_estimate(args: argparse.Namespace) -> int:
    shape = {name: getattr(args, name) for name in _SHAPE_FLAGS.values()}
    _check_estimate_flags(args)
    if args.model is not None:
        model_config = _load_model_config(args.model, args.revision)
        dtype = args.dtype or ("bfloat16" if args.device_memory is not None else None)
        config = CacheConfig.from_model(
            model_config if dtype is None else _as_loaded(model_config),
            **shape,
            dtype=dtype,
            max_batch_size=args.max_batch_size,
            block_size=args.block_size,
            device="cpu",  # an estimate does not depend on this machine's devices
            kv_cache_dtype=args.kv_cache_dtype,
        )
        capacity = None
        if args.device_memory is not None:
            capacity = device_capacity(
                config, model_config.get_text_config(), count_parameters(model_config),
                parse_bytes(args.device_memory, "device_memory"), gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max(token_budgets(
                    "cuda", args.max_num_seqs, args.max_num_batched_tokens, args.prefill_only_batched_tokens)))
        estimate = estimate_from_config(config, gpu_memory=args.gpu_memory, device=capacity)
    else:
        missing = [flag for flag, name in _SHAPE_FLAGS.items() if shape[name] is None]
        if missing:
            raise ConfigError(f"estimate needs {', '.join(missing)}, or --model PATH to take "
                              "the shape from")
        estimate = estimate_kv_cache(
            **shape,
            dtype=args.dtype or "float16",
            max_batch_size=args.max_batch_size,
            block_size=args.block_size,
            gpu_memory=args.gpu_memory,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    print(_render(estimate, as_json=args.json))
    return 0


def _check_estimate_flags(args: argparse.Namespace) -> None:
    if args.revision is not None and (args.model is None or _is_local(args.model)):
        raise ConfigError(f"--revision {args.revision} names a version of a hub id, but --model is "
                          f"{args.model!r}; allowed: --revision with --model ORG/NAME")
    if args.device_memory is None:
        if args.gpu_memory_utilization is not None:
            raise ConfigError(f"--gpu-memory-utilization {args.gpu_memory_utilization} needs --device-memory "
                              "(the device's total memory it is a share of)")
        return
    if args.model is None:
        if any(getattr(args, name) is not None for name in _SHAPE_ONLY):
            raise ConfigError(f"--device-memory {args.device_memory} needs --model: the weights it leaves room for "
                              "are counted from the model's config")
        args.model = str(default_checkpoint())  # the embedded default, as `serve run deployments/app.yaml` serves it
    if args.gpu_memory is not None:
        raise ConfigError(f"--gpu-memory {args.gpu_memory} and --device-memory {args.device_memory} were both "
                          "given; allowed: one (--gpu-memory: the KV memory itself; --device-memory: the GPU's "
                          "total, the KV pool sized as LLM() sizes it)")
    for flag, value in (("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens),
                        ("--prefill-only-batched-tokens", args.prefill_only_batched_tokens)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} is not supported; allowed: an integer >= 1")


def _as_loaded(model_config: Any) -> Any:
    """A copy of the config without its dtype: --dtype (or LLM()'s CUDA default) decides, as the
    loader casts the weights to whatever it is asked for."""
    config = copy.deepcopy(model_config)
    for part in (config, config.get_text_config()):  # the same object where the config has no text part
        part.dtype = None
    return config


def _is_local(name: str) -> bool:
    return Path(name).expanduser().exists()


def _render(estimate: KVEstimate, *, as_json: bool) -> str:
    return json.dumps(estimate.to_dict(), indent=2) if as_json else estimate.summary()


def _load_model_config(path: str, revision: str | None = None) -> Any:
    """A transformers config from a local directory or config.json, or a hub id's through the hub
    cache (downloaded unless HF_HUB_OFFLINE=1), as transformers reads it."""
    # Imported here: importing transformers takes seconds, and only --model needs it.
    from transformers import AutoConfig

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    allowed = "allowed: a local model directory holding config.json, a config.json file, or a hub id (ORG/NAME)"
    p = Path(path).expanduser()
    if not p.exists():
        if is_hub_id(path):
            return check_hub_model(path, revision=revision)
        raise ConfigError(f"--model {path!r} does not exist and is no hub id; {allowed}")
    file = p / "config.json" if p.is_dir() else p
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:  # missing or unreadable file, bad JSON
        raise ConfigError(f"--model {path!r}: cannot read {file}: {exc}; {allowed}") from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ConfigError(f"--model {path!r}: model_type={model_type!r} in {file} is not a "
                          "model type this transformers version knows")
    try:
        if p.is_dir():
            return AutoConfig.from_pretrained(p, local_files_only=True)
        return AutoConfig.for_model(**data)
    except (OSError, ValueError) as exc:  # e.g. a config that needs trust_remote_code
        raise ConfigError(f"--model {path!r}: transformers cannot load {file}: {exc}") from None


if __name__ == "__main__":
    raise SystemExit(main())
