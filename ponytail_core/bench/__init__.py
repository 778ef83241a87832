"""`ponytail bench`: on a user's model, greedy outputs checked against plain transformers, then
speed (tokens/s, TTFT, TPOT) for both, then memory over time with the KV pool beside it.

One job per file: workload (the requests), output_check (the correctness verdict, shared with
benchmarks/bench_engine.py), baseline and engine_run (the two sides), speed (percentiles),
memory (the sampler), plot (PNG), report (CSV, JSON, tables), run (the order), command (flags).
Imports: llm and everything below it.
"""
