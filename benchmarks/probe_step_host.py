"""What one engine step costs with compiled layers: decode-only steps and mixed steps (decode rows
plus a prompt chunk), medians over many steps after every shape has compiled.

On a GPU decode steps replay CUDA graphs and mixed steps run eagerly, so the mixed median is the
eager step's host cost (plus a small model's few milliseconds of device time); on the CPU both run
eagerly, and a model of thin layers leaves mostly the host's share: what the compiled layers'
dynamo frames, guards and wrappers cost per step.

    python benchmarks/probe_step_host.py --model /tmp/ponytail-smollm2-random          # a GPU
    python benchmarks/probe_step_host.py --model /tmp/thin --thin-layers 30            # CPU: builds
        # /tmp/thin (30 layers 64 wide, SmolLM2's vocabulary) from --files first
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

import ponytail


def build_thin(files: str, out: str, layers: int) -> None:
    """A random Llama of `layers` thin layers with the exported default model's tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(files)
    config.update({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
                   "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
                   "max_position_embeddings": 4096})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(files) / name).exists():
            shutil.copy(Path(files) / name, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--thin-layers", type=int, help="build --model first: a random model of this many thin layers")
    parser.add_argument("--files", default=".gpu/smollm2-files", help="tokenizer files for --thin-layers "
                        "(benchmarks/random_checkpoint.py export)")
    parser.add_argument("--rows", type=int, default=32, help="requests decoding through the timed steps")
    parser.add_argument("--steps", type=int, default=60, help="timed steps; every third adds a 16-token prompt")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.rows < 1 or args.steps < 3:
        parser.error(f"--rows {args.rows} and --steps {args.steps}: at least 1 and 3")
    if args.thin_layers is not None:
        build_thin(args.files, args.model, args.thin_layers)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # steady timings on a shared CPU
    # No prefill delay: a mixed step must carry its prompt (the delay would hold it for a later step).
    llm = ponytail.LLM(args.model, compile_model=True, max_num_seqs=64, max_model_len=1024, prefill_delay_factor=0.0)
    engine = llm.engine

    def params(n: int) -> ponytail.SamplingParams:
        return ponytail.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    for _ in range(2):  # every shape the timed steps use compiles here
        for i in range(16):
            engine.add_request([5 + i] * 20, params(40))
        while engine.has_unfinished():
            engine.step()
    for i in range(args.rows):
        engine.add_request([7 + i] * 10, params(args.steps + 20))
    for _ in range(5):
        engine.step()
    times: dict[str, list[float]] = {"decode": [], "mixed": []}
    for k in range(args.steps):
        kind = "mixed" if k % 3 == 0 else "decode"
        if kind == "mixed":
            engine.add_request([11 + k] * 16, params(1))
        if llm.device.type == "cuda":
            torch.cuda.synchronize(llm.device)
        start = time.perf_counter()
        engine.step()
        if llm.device.type == "cuda":
            torch.cuda.synchronize(llm.device)
        times[kind].append(time.perf_counter() - start)
    report = {"model": args.model, "device": str(llm.device), "rows": args.rows, "ponytail": ponytail.__file__,
              "median_ms": {kind: 1e3 * statistics.median(t) for kind, t in times.items()},
              "steps": {kind: len(t) for kind, t in times.items()}}
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
