"""vLLM's LLM arguments a script written for vLLM passes: honoured where they mean something here,
refused by name where they do not (never accepted and ignored)."""

import pytest
import torch

import ponytail
from ponytail import ConfigError, SamplingParams
from ponytail.models.loader import default_checkpoint
from hub_cache import HUB_ID, REVISION, add_revision, build_hub_cache, run_offline

pytestmark = pytest.mark.network  # the default model's tokenizer


def make_llm(small_model, **kwargs):
    model, tokenizer = small_model
    return ponytail.LLM(model, tokenizer=tokenizer, kv_cache_memory="4MiB", max_num_seqs=8, max_model_len=128,
                        **kwargs)


def test_seed_makes_requests_without_their_own_seed_reproducible(small_model):
    sampled = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    prompts = ["Once upon a time", "The weather today"]
    first = [o.token_ids for o in make_llm(small_model, seed=7).generate(prompts, sampled)]
    again = [o.token_ids for o in make_llm(small_model, seed=7).generate(prompts, sampled)]
    other = [o.token_ids for o in make_llm(small_model, seed=8).generate(prompts, sampled)]
    assert first == again and first != other


def test_enforce_eager_turns_graphs_and_compile_off_and_refuses_a_contradiction(small_model):
    llm = make_llm(small_model, enforce_eager=True)
    assert llm.engine.runner.graphs is None
    assert llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0))[0].token_ids
    with pytest.raises(ConfigError, match=r"enforce_eager=True runs the model eagerly, but cuda_graphs=True"):
        make_llm(small_model, enforce_eager=True, cuda_graphs=True)
    with pytest.raises(ConfigError, match=r"but cuda_graphs=None and compile_model=True ask otherwise"):
        make_llm(small_model, enforce_eager=True, compile_model=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=2), r"tensor_parallel_size=2 is not supported; allowed: 1 \(an engine runs on one"),
    (dict(tensor_parallel_size=True), r"tensor_parallel_size=True is not supported"),
    (dict(seed=-1), r"seed=-1 is not supported; allowed: an int >= 0, or None"),
    (dict(seed="7"), r"seed='7' is not supported"),
    (dict(enforce_eager="yes"), r"enforce_eager='yes' is not supported; allowed: True or False"),
    (dict(revision="main"), r"revision='main' applies when LLM loads the model \(a name or path\), not to a model"),
    (dict(trust_remote_code=True), r"trust_remote_code=True applies when LLM loads the model"),
])
def test_vllm_arguments_that_mean_nothing_here_are_refused_by_name(small_model, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_llm(small_model, **kwargs)


def test_tensor_parallel_size_one_is_what_an_engine_is(small_model):
    make_llm(small_model, tensor_parallel_size=1)


def test_a_tokenizer_given_by_path_is_loaded(small_model):
    model, tokenizer = small_model
    llm = ponytail.LLM(model, tokenizer=str(default_checkpoint()), kv_cache_memory="4MiB", max_num_seqs=4,
                       max_model_len=128)
    assert llm.get_tokenizer() is llm.tokenizer and llm.get_tokenizer().vocab_size == tokenizer.vocab_size
    by_object = make_llm(small_model).generate("Hello there", SamplingParams(max_tokens=5, temperature=0))[0]
    by_path = llm.generate("Hello there", SamplingParams(max_tokens=5, temperature=0))[0]
    assert (by_path.text, by_path.token_ids) == (by_object.text, by_object.token_ids)


def test_a_revision_applies_to_hub_ids_only():
    with pytest.raises(ConfigError, match=r"revision='v2' names a version of a hub id, but name_or_path="):
        ponytail.load_model(str(default_checkpoint()), revision="v2")
    with pytest.raises(ConfigError, match=r"trust_remote_code='no' is not supported; allowed: True or False"):
        ponytail.load_model(str(default_checkpoint()), trust_remote_code="no")


def test_a_hub_revision_loads_by_commit_and_an_unknown_one_is_a_clear_error(default_model, tmp_path):
    """Offline, from a cache laid out as the hub's: the snapshot's commit loads; a tag the cache has
    never seen is a ConfigError that names the hub id, not a traceback."""
    build_hub_cache(tmp_path / "hub", default_checkpoint())
    script = (
        "import ponytail\n"
        f"model, _ = ponytail.load_model({HUB_ID!r}, revision={REVISION!r})\n"
        "print(model.config.num_hidden_layers)\n"
        "try:\n"
        f"    ponytail.load_model({HUB_ID!r}, revision='v9')\n"
        "except ponytail.ConfigError as exc:\n"
        "    print('refused:', str(exc).splitlines()[0])\n"
    )
    stdout = run_offline(script, tmp_path)
    layers, refused = stdout.strip().splitlines()[-2:]
    assert layers == str(default_model[0].config.num_hidden_layers)
    assert refused.startswith(f"refused: name_or_path={HUB_ID!r} revision='v9':"), refused


def test_logprobs_are_vllm_logprob_objects_and_still_floats(small_model):
    """vLLM scripts read `.logprob`, `.rank` and `.decoded_token`; Ponytail's own code reads a float."""
    import json
    import pickle

    model, tokenizer = small_model
    llm = make_llm(small_model)
    prompt = tokenizer("The weather today is")["input_ids"]
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1.5, seed=3, logprobs=3, prompt_logprobs=2,
                                              ignore_eos=True))[0]
    tokens = out.outputs[0].token_ids
    model.set_attn_implementation("sdpa")  # LLM switched it to "ponytail"
    with torch.no_grad():  # the raw distribution at every position, teacher forced
        logprobs = model(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    ranks = []
    for step, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        dist = logprobs[len(prompt) - 1 + step]
        chosen = entry[token]
        assert isinstance(chosen, ponytail.Logprob) and chosen.logprob == float(chosen)
        # Counted on the engine's logits: a token within float noise of the chosen one may count or not.
        low, high = int((dist > dist[token] + 1e-4).sum()) + 1, int((dist >= dist[token] - 1e-4).sum())
        assert low <= chosen.rank <= high and chosen.decoded_token == tokenizer.decode([token])
        by_rank = sorted(entry.values(), key=lambda lp: lp.rank)  # the top 3, and the chosen one if not among them
        assert [lp.rank for lp in by_rank][:3] == [1, 2, 3] and len(entry) in (3, 4)
        assert by_rank[0] == pytest.approx(float(dist.max()), abs=1e-4)
        ranks.append(chosen.rank)
    assert max(ranks) > 1, f"every sampled token was the most likely ({ranks}): ranks were not exercised"
    first = out.prompt_logprobs[1]  # position 0 has none, as in vLLM
    target = logprobs[0, prompt[1]]
    low, high = int((logprobs[0] > target + 1e-4).sum()) + 1, int((logprobs[0] >= target - 1e-4).sum())
    assert low <= first[prompt[1]].rank <= high
    assert {lp.decoded_token for lp in first.values()} >= {tokenizer.decode([prompt[1]])}
    again = pickle.loads(pickle.dumps(chosen))
    assert (again, again.rank, again.decoded_token) == (chosen, chosen.rank, chosen.decoded_token)
    assert json.loads(json.dumps({"lp": chosen}))["lp"] == float(chosen) and f"{chosen}" == repr(float(chosen))


def test_the_served_revision_reaches_the_tokenizer_the_sampling_defaults_and_the_start_check(default_model, tmp_path):
    """vLLM's --revision for `serve`: the prefix router's tokenizer, the replica's generation_config.json
    defaults and `ponytail serve`'s check before Ray starts all read the revision the engine loads, offline
    from a cache laid out as the hub's; main's defaults differ from v2's, so reading main would show."""
    import json

    build_hub_cache(tmp_path / "hub", default_checkpoint())
    generation = json.loads((default_checkpoint() / "generation_config.json").read_text())
    add_revision(tmp_path / "hub", "v2", {"generation_config.json": json.dumps({**generation, "temperature": 0.3,
                                                                                 "top_p": 0.8})})
    script = (
        "import ponytail\n"
        "from deployments.api.generation_defaults import model_sampling_defaults\n"
        "from ponytail.models.hub import check_hub_model\n"
        f"print(model_sampling_defaults({HUB_ID!r}), model_sampling_defaults({HUB_ID!r}, 'v2'))\n"
        f"print(len(ponytail.load_tokenizer({HUB_ID!r}, revision='v2')))\n"
        f"print(check_hub_model({HUB_ID!r}, revision='v2').num_hidden_layers)\n"
        "try:\n"
        f"    check_hub_model({HUB_ID!r}, revision='v9')\n"
        "except ponytail.ConfigError as exc:\n"
        "    print('refused:', str(exc).splitlines()[0])\n"
    )
    defaults, vocab, layers, refused = run_offline(script, tmp_path).strip().splitlines()[-4:]
    assert defaults == "{} {'temperature': 0.3, 'top_p': 0.8}"
    assert int(vocab) == len(default_model[1]) and layers == str(default_model[0].config.num_hidden_layers)
    assert refused.startswith(f"refused: name_or_path={HUB_ID!r} revision='v9':"), refused
    with pytest.raises(ConfigError, match=r"revision='v2' names a version of a hub id, but name_or_path="):
        ponytail.load_tokenizer(str(default_checkpoint()), revision="v2")


def test_vllm_generate_and_chat_keywords_run_or_are_refused_by_name(small_model):
    """Scripts written for vLLM pass lora_request=None and priority=[0, ...]; chat takes documents
    (for templates that read them). Anything Ponytail cannot honour is refused, not dropped."""
    llm = make_llm(small_model)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    plain = llm.generate(["Hello there", "Hi"], greedy)
    same = llm.generate(["Hello there", "Hi"], greedy, lora_request=None, priority=[0, 0])
    assert [o.token_ids for o in same] == [o.token_ids for o in plain]
    with pytest.raises(ConfigError, match=r"priority=2 needs scheduling_policy='priority'; allowed: 0 under 'fcfs'"):
        llm.generate(["Hello there", "Hi"], greedy, priority=[0, 2])
    assert not llm.engine.requests  # the first prompt, added before the refusal, was taken back
    with pytest.raises(ConfigError, match=r"lora_request='adapter' is not supported; allowed: None"):
        llm.chat([{"role": "user", "content": "Hi"}], greedy, lora_request="adapter")
    template = ("{% for d in documents or [] %}[{{ d.text }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    with_docs = llm.chat([{"role": "user", "content": "Hi"}], greedy, chat_template=template,
                         documents=[{"title": "t", "text": "Paris"}])[0]
    assert with_docs.prompt_token_ids == llm.tokenizer("[Paris]Hi", add_special_tokens=False)["input_ids"]
    assert not llm.engine.requests
