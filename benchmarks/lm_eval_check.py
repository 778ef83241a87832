"""lm-eval's `local-completions`, with its default batching, against a running Ponytail server.

Two tasks from local data, written next to the results: a multiple-choice (loglikelihood) task,
which needs `echo` with prompt logprobs and lists of token-id prompts, and a generate_until task.
The tokenizer comes from /v1/models' `root`, as a client with only the server's address finds it.

Requirement (not a Ponytail dependency): `pip install "lm-eval[api]==0.4.13"`.

    serve run deployments/app.yaml &            # or: --local (the API over an in-process engine, no Ray)
    python benchmarks/lm_eval_check.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # deployments/ for --local

# (country, capital): the questions of both tasks; wrong choices are other capitals.
CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
            ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Russia", "Moscow"), ("Greece", "Athens"),
            ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Norway", "Oslo"),
            ("Poland", "Warsaw"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Hungary", "Budapest"),
            ("Canada", "Ottawa"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Cuba", "Havana")]

MC_YAML = """task: ponytail_capitals_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

GEN_YAML = """task: ponytail_capitals_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "The capital of {{{{country}}}} is the city of"
doc_to_target: "{{{{capital}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
process_results: !function capitals_utils.process_results
metric_list:
  - metric: contains
    aggregation: mean
    higher_is_better: true
"""

UTILS = '''def process_results(doc, results):
    """1 when the generated text names the capital (exact_match would need a hub download)."""
    return {"contains": float(doc["capital"].lower() in results[0].lower())}
'''


def write_tasks(folder: Path) -> None:
    capitals = [capital for _, capital in CAPITALS]
    with open(folder / "mc.jsonl", "w") as f:
        for i, (country, capital) in enumerate(CAPITALS):
            others = [c for c in capitals if c != capital]
            choices = [others[(i + k * 5) % len(others)] for k in range(3)]
            choices.insert(i % 4, capital)
            f.write(json.dumps({"country": country, "choices": [" " + c for c in choices],
                                "answer": choices.index(capital)}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for country, capital in CAPITALS:
            f.write(json.dumps({"country": country, "capital": capital}) + "\n")
    (folder / "capitals_mc.yaml").write_text(MC_YAML.format(data=folder / "mc.jsonl"))
    (folder / "capitals_gen.yaml").write_text(GEN_YAML.format(data=folder / "gen.jsonl"))
    (folder / "capitals_utils.py").write_text(UTILS)


def served_model(base_url: str) -> tuple[str, str]:
    """(model id, tokenizer root) from /v1/models."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as response:
        model = json.load(response)["data"][0]
    if not model.get("root"):
        raise SystemExit(f"/v1/models gives no root for {model['id']!r}: lm-eval cannot find the tokenizer")
    return model["id"], model["root"]


def run(base_url: str, limit: int | None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_id, root = served_model(base_url)
    with tempfile.TemporaryDirectory() as folder:
        write_tasks(Path(folder))
        results = lm_eval.simple_evaluate(
            model="local-completions",
            # lm-eval's defaults otherwise: tokenized_requests=True (token-id prompts), its batching.
            model_args=f"model={model_id},base_url={base_url}/v1/completions,tokenizer={root}",
            tasks=["ponytail_capitals_mc", "ponytail_capitals_gen"],
            task_manager=TaskManager(include_path=folder), limit=limit)
    return {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            for task, metrics in results["results"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--local", action="store_true",
                        help="serve the API from an in-process engine on the CPU (no Ray) and evaluate that")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all 20)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        base_url = args.base_url
        if args.local:
            from deployments.app.local_server import local_server

            _, base_url = stack.enter_context(local_server())
        scores = run(base_url, args.limit)
    print(json.dumps(scores, indent=2))


if __name__ == "__main__":
    main()
