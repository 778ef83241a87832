"""xgrammar against llguidance on this model's vocabulary: tokenizer set-up, compile, per-step mask.

    python benchmarks/probe_grammar_backends.py            # the default model, CPU is enough
    python benchmarks/probe_grammar_backends.py --json out.json

Both libraries compute the token mask on the host (a bitmask of vocab/32 int32 words), so the CPU
numbers are the ones that matter for the engine. For each backend and each schema it reports:
the one-off tokenizer set-up, the cold compile of the schema (a fresh compiler, nothing cached),
and the time to fill one row's mask and advance the matcher, step by step along a valid
instance's tokens (mean, p50, p99, max). Every step also checks that the instance's next token is
allowed, so a backend that masks wrongly fails here rather than looking fast.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

# The test suite's nested schema (tests/test_structured_api.py), a tool call's arguments, any JSON.
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "kind": {"type": "string", "enum": ["cat", "dog", "bird"]},
        "owner": {"type": "object", "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "verified": {"type": "boolean"}}, "required": ["age", "verified"],
            "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "owner", "tags"],
    "additionalProperties": False,
}
NESTED_VALUE = {"name": "Rex the dog", "kind": "dog", "owner": {"age": 42, "verified": True},
                "tags": ["a", "c"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
WEATHER_VALUE = {"city": "Paris", "unit": "celsius"}
CASES = {"nested": (NESTED, NESTED_VALUE), "tool_args": (WEATHER, WEATHER_VALUE),
         "json_object": (None, {"answer": [1, 2.5, "x"], "ok": None})}


def _stats(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"mean_us": 1e6 * statistics.fmean(ordered), "p50_us": 1e6 * ordered[len(ordered) // 2],
            "p99_us": 1e6 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "max_us": 1e6 * ordered[-1], "steps": len(ordered)}


def _walk(tokens, fill, allowed, advance) -> list[float]:
    """Per step: fill the mask, check the token is allowed, advance; the fill + advance time."""
    times = []
    for token in tokens:
        start = time.perf_counter()
        fill()
        mid = time.perf_counter()
        if not allowed(token):
            raise AssertionError(f"the mask refuses token {token} of a valid instance")
        start_advance = time.perf_counter()
        advance(token)
        times.append(mid - start + time.perf_counter() - start_advance)
    return times


def _bit(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def probe_xgrammar(tokenizer, vocab_size: int, eos: int) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
    out = {"version": xgr.__version__ if hasattr(xgr, "__version__") else "?",
           "tokenizer_setup_ms": 1e3 * (time.perf_counter() - start)}
    for name, (schema, value) in CASES.items():
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        start = time.perf_counter()
        compiled = (compiler.compile_builtin_json_grammar() if schema is None else
                    compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        compile_ms = 1e3 * (time.perf_counter() - start)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        tokens = tokenizer.encode(json.dumps(value), add_special_tokens=False) + [eos]
        times = _walk(tokens, lambda: matcher.fill_next_token_bitmask(bitmask, 0),
                      lambda t: _bit(bitmask, t), lambda t: matcher.accept_token(t))
        out[name] = {"compile_ms": compile_ms, **_stats(times), "terminated": matcher.is_terminated()}
    return out


def probe_llguidance(tokenizer, vocab_size: int, eos: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    out = {"version": getattr(llguidance, "__version__", "?"),
           "tokenizer_setup_ms": 1e3 * (time.perf_counter() - start)}
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    for name, (schema, value) in CASES.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, defaults=options)
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_ms = 1e3 * (time.perf_counter() - start)
        if matcher.is_error():
            raise AssertionError(matcher.get_error())
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        tokens = tokenizer.encode(json.dumps(value), add_special_tokens=False) + [eos]
        times = _walk(tokens, lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0),
                      lambda t: _bit(bitmask, t), lambda t: matcher.consume_token(t))
        out[name] = {"compile_ms": compile_ms, **_stats(times), "terminated": matcher.is_stopped()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    from ponytail.models.loader import load_model

    model, tokenizer = load_model(args.model, device="cpu")
    vocab_size = model.config.get_text_config().vocab_size
    eos = tokenizer.eos_token_id
    results = {"vocab_size": vocab_size, "threads": torch.get_num_threads()}
    for name, probe in (("xgrammar", probe_xgrammar), ("llguidance", probe_llguidance)):
        results[name] = probe(tokenizer, vocab_size, eos)
        r = results[name]
        print(f"{name} {r['version']}: tokenizer set-up {r['tokenizer_setup_ms']:.0f} ms")
        for case in CASES:
            c = r[case]
            print(f"  {case:12s} compile {c['compile_ms']:8.2f} ms   mask+advance mean {c['mean_us']:7.1f} us"
                  f"  p50 {c['p50_us']:7.1f}  p99 {c['p99_us']:7.1f}  max {c['max_us']:7.1f}"
                  f"  ({c['steps']} steps, ended {c['terminated']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
