"""The `ponytail` command. One subcommand per job: `estimate` sizes a KV cache, `serve` serves a
model (serve_command.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from .bench.command import add_parser as add_bench_parser
from .kv.config import CacheConfig
from .errors import ConfigError, PonytailError
from .kv.estimate import KVEstimate, estimate_from_config, estimate_kv_cache
from .serve_command import add_serve_parser

# --flag -> estimate_kv_cache argument, for the shape flags --model can stand in for.
_SHAPE_FLAGS = {
    "--num-layers": "num_layers",
    "--num-kv-heads": "num_kv_heads",
    "--head-dim": "head_dim",
    "--max-seq-len": "max_seq_len",
}


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
    est.add_argument("--model", metavar="PATH",
                     help="local model directory holding config.json, or a config.json file; "
                          "supplies the shape flags (explicit flags must agree with it)")
    est.add_argument("--num-layers", type=int, help="decoder layers")
    est.add_argument("--num-kv-heads", type=int, help="key/value heads per layer")
    est.add_argument("--head-dim", type=int, help="elements per head")
    est.add_argument("--dtype", help="bfloat16, float16 or float32 "
                                     "(default: the model's with --model, else float16)")
    est.add_argument("--max-batch-size", type=int, default=1,
                     help="sequences held at once (default: 1)")
    est.add_argument("--max-seq-len", type=int,
                     help="tokens per sequence (default with --model: max_position_embeddings)")
    est.add_argument("--block-size", type=int, default=16, help="tokens per block (default: 16)")
    est.add_argument("--gpu-memory", metavar="SIZE",
                     help='KV memory available ("80GB", "80GiB" or bytes): '
                          "how many full-length sequences fit")
    est.add_argument("--json", action="store_true", help="print the estimate as JSON")
    est.set_defaults(run=_run_estimate)
    add_serve_parser(commands)
    add_bench_parser(commands)
    return parser


def _run_estimate(args: argparse.Namespace) -> int:
    shape = {name: getattr(args, name) for name in _SHAPE_FLAGS.values()}
    if args.model is not None:
        config = CacheConfig.from_model(
            _load_model_config(args.model),
            **shape,
            dtype=args.dtype,
            max_batch_size=args.max_batch_size,
            block_size=args.block_size,
            device="cpu",  # an estimate does not depend on this machine's devices
        )
        estimate = estimate_from_config(config, gpu_memory=args.gpu_memory)
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
        )
    print(_render(estimate, as_json=args.json))
    return 0


def _render(estimate: KVEstimate, *, as_json: bool) -> str:
    return json.dumps(estimate.to_dict(), indent=2) if as_json else estimate.summary()


def _load_model_config(path: str) -> Any:
    """A transformers config from a local directory or config.json; never contacts a hub."""
    # Imported here: importing transformers takes seconds, and only --model needs it.
    from transformers import AutoConfig

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    allowed = "allowed: a local model directory holding config.json, or a config.json file"
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--model {path!r} does not exist; {allowed}")
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
