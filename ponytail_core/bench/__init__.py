"""`ponytail bench`: on a user's model, greedy outputs checked against plain transformers, then
speed (tokens/s, TTFT, TPOT) for both, then memory over time with the KV pool beside it.

One job per file: workload (the requests), output_check (the correctness verdict, shared with
benchmarks/bench_engine.py), baseline and engine_run (the sides: plain generate, then Ponytail, and
with --kv-cache-dtype fp8 Ponytail again storing K/V in FP8), kv_agreement (the FP8 side's greedy
tokens against the auto side's, reported, not judged), speed (percentiles), memory (the sampler),
plot (PNG), report (CSV, JSON, tables), run (the order), command (flags).
Imports: llm and everything below it.
"""
