"""Where the engine's steps make the host wait for the device, besides reading a step back.

With async scheduling the host builds step k + 1 while the device runs step k; any torch call that
synchronizes the stream in between (a copy from pageable memory, .item(), .tolist() or a boolean
mask on a device tensor) idles the device for the rest of the host's work. The twenty-seventh
session found one in the KV pool's growth (docs/benchmarks.md). This runs bench_engine's mixed
requests (the first --requests of them) through `LLM(model)` with its defaults under torch's sync
debug mode and prints each place in Ponytail's code that synchronized, how often, and one stack.
The engine's own read-back waits on a CUDA event, which the debug mode does not count.

    python benchmarks/probe_step_syncs.py --model /tmp/ponytail-smollm2-random        # CUDA only
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from collections import Counter

import torch

import ponytail
from ponytail import SamplingParams

import peer_workloads

PACKAGE_MARK = "ponytail"  # frames from Ponytail's package (installed, or ponytail_core in a checkout)


def ponytail_site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of Ponytail's code in a stack, as file:line function."""
    for frame in reversed(stack):
        if PACKAGE_MARK in frame.filename and "probe_step_syncs" not in frame.filename:
            path = frame.filename.split(PACKAGE_MARK, 1)[-1].removeprefix("_core")
            return f"ponytail{path}:{frame.lineno} {frame.name}"
    return "outside ponytail"


def run(llm, work, n_samples: int) -> tuple[Counter, dict, int]:
    """Every request added at once, then steps until done under the sync debug mode: the sites,
    a stack for each, and the steps taken."""
    sites: Counter = Counter()
    stacks: dict[str, list[str]] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        site = ponytail_site(stack)
        sites[site] += 1
        stacks.setdefault(site, traceback.format_list(stack[-10:]))

    engine = llm.engine
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
        samples = n_samples if i % 4 == 0 else 1  # parallel samples on a quarter of the requests
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.8 if samples > 1 else 0,
                                                  n=samples, seed=i, ignore_eos=True))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        steps = 0
        try:
            while engine.has_unfinished():
                engine.step()
                steps += 1
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites, stacks, steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory (random_checkpoint.py builds one)")
    parser.add_argument("--requests", type=int, default=64, help="the first this many mixed requests")
    parser.add_argument("--n", type=int, default=2, help="samples of every fourth request (parallel sampling)")
    parser.add_argument("--json", help="write the sites and their counts here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("probe_step_syncs.py needs a CUDA device: the host waits it looks for are CUDA stream syncs",
              file=sys.stderr)
        return 2
    llm = ponytail.LLM(args.model)
    config = llm.engine.model.config.get_text_config()
    full = peer_workloads.build("mixed", config.vocab_size, llm.max_model_len)
    work = peer_workloads.PeerWorkload("mixed", full.prompts[: args.requests], full.output_lens[: args.requests],
                                       "output")
    warm = peer_workloads.build("mixed", config.vocab_size, llm.max_model_len, seed=1)
    run(llm, peer_workloads.PeerWorkload("warm-up", warm.prompts[:4], [4] * 4, "output"), args.n)
    sites, stacks, steps = run(llm, work, args.n)
    print(f"{sum(sites.values())} synchronizing calls in {steps} steps, at {len(sites)} sites")
    for site, count in sites.most_common():
        print(f"{count:6d}  {site}")
        print("".join(stacks[site][-4:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sites": dict(sites), "stacks": stacks}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
