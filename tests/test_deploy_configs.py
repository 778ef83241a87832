"""app.yaml and cluster.yaml validated against Ray's own schemas, without starting anything."""

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve")

ROOT = Path(__file__).resolve().parent.parent


def test_app_yaml_matches_serves_schema_and_builds():
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import AppArgs, build

    config = yaml.safe_load((ROOT / "deployments" / "app.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(config)
    (app,) = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("ponytail", "/", "deployments.app:build")
    assert app.args["model"] is None and app.args["device"] == "auto"
    AppArgs(**app.args)  # every arg is one the builder knows
    assert build(app.args) is not None


def test_app_args_are_checked():
    from deployments.app import AppArgs

    with pytest.raises(ValueError, match="device='tpu' is not supported; allowed: auto, cuda, cpu"):
        AppArgs(device="tpu")
    with pytest.raises(ValueError, match="min_replicas=3, max_replicas=2"):
        AppArgs(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="router='random' is not supported; allowed: kv_blocks, prefix, power_of_two"):
        AppArgs(router="random")
    with pytest.raises(ValueError, match="compile_model='yes' is not supported; allowed: true, false, null"):
        AppArgs(compile_model="yes")
    with pytest.raises(ValueError, match="fuse_projections=2 is not supported; allowed: true, false, null"):
        AppArgs(fuse_projections=2)
    with pytest.raises(ValueError, match="column_major_weights='cols' is not supported; allowed: true, false, null"):
        AppArgs(column_major_weights="cols")
    with pytest.raises(ValueError, match="engine_process='sometimes' is not supported; allowed: true, false, null"):
        AppArgs(engine_process="sometimes")
    with pytest.raises(ValueError, match=r"max_hold_s=-1 is not supported; allowed: seconds >= 0 \(0: never hold\)"):
        AppArgs(max_hold_s=-1)
    with pytest.raises(ValueError, match=r"stream_interval_s=5 is not supported; allowed: seconds from 0 to 1"):
        AppArgs(stream_interval_s=5)
    with pytest.raises(ValueError, match=r"ingress_replicas=0 is not supported; allowed: an integer >= 1"):
        AppArgs(ingress_replicas=0)
    with pytest.raises(ValueError, match=r"max_deltas_per_s=-5 is not supported; allowed: a number > 0, or null"):
        AppArgs(max_deltas_per_s=-5)


def test_the_ingress_scales_to_ingress_replicas():
    from deployments.app import build

    # Serve's Application keeps its ingress deployment here; no public accessor exists.
    ingress = build({"device": "cpu", "ingress_replicas": "3"})._bound_deployment
    assert (ingress.name, ingress.num_replicas) == ("OpenAIIngress", 3)
    assert build({"device": "cpu", "api_in_engines": False})._bound_deployment.name == "OpenAIIngress"


def test_the_engine_replicas_serve_the_api_unless_the_router_or_ingress_replicas_need_an_ingress():
    from deployments.app import AppArgs, build
    from deployments.engine_api import EngineAPI

    app = build({"device": "cpu"})._bound_deployment
    assert app.name == "EngineReplica" and issubclass(app.func_or_class, EngineAPI)
    assert AppArgs().serves_api_in_engines and not AppArgs(router="prefix").serves_api_in_engines
    assert not AppArgs(ingress_replicas=2).serves_api_in_engines
    assert build({"device": "cpu", "router": "prefix"})._bound_deployment.name == "OpenAIIngress"
    for clash in ({"router": "prefix"}, {"ingress_replicas": 2}):
        with pytest.raises(ValueError, match=r"api_in_engines=true with router=.*allowed: api_in_engines false or "
                                             r"null with router prefix or ingress_replicas > 1"):
            AppArgs(api_in_engines=True, **clash)
    with pytest.raises(ValueError, match=r"prefill_delay_factor=-1 is not supported; allowed: a number >= 0"):
        AppArgs(prefill_delay_factor=-1)
    with pytest.raises(ValueError, match=r"generation_config\n  Input should be 'auto' or 'ponytail'"):
        AppArgs(generation_config="vllm")


def test_app_args_are_typed_from_strings_and_refuse_unknown_names():
    """`serve run deployments.app:build key=value` hands the builder strings."""
    from deployments.app import AppArgs, build

    settings = AppArgs.model_validate({"max_replicas": "3", "min_replicas": "2", "compile_model": "true",
                                       "max_hold_s": "0.5", "max_model_len": "2048", "model_id": "old-name"})
    assert (settings.min_replicas, settings.max_replicas, settings.max_hold_s) == (2, 3, 0.5)
    assert settings.compile_model is True and settings.max_model_len == 2048
    assert settings.served_name() == "old-name"  # app.yaml files written with model_id keep working
    assert build({"max_replicas": "3", "device": "cpu"}) is not None
    with pytest.raises(ValueError, match=r"max_replica\n  Extra inputs are not permitted"):
        build({"max_replica": "3"})
    with pytest.raises(ValueError, match=r"max_replicas\n  Input should be a valid integer.*input_value='two'"):
        build({"max_replicas": "two"})


def test_the_served_name_defaults_to_what_clients_can_load():
    from deployments.app import AppArgs

    assert AppArgs().served_name() == "SmolLM2-135M-Instruct"
    assert AppArgs(model="HuggingFaceTB/SmolLM2-135M-Instruct").served_name() == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert AppArgs(model=str(ROOT / "deployments") + "/").served_name() == "deployments"  # a local directory
    assert AppArgs(model="x/y", served_model_name="mine").served_name() == "mine"


def test_router_arguments_reach_only_the_kv_block_router():
    from deployments.app import AppArgs, router_arguments

    assert router_arguments(AppArgs(max_hold_s=0)) == {"max_hold_s": 0.0, "admission": "engine"}
    assert router_arguments(AppArgs(router="power_of_two")) == {}


def test_engine_arguments_reach_the_replica_constructor():
    import inspect

    from deployments.app import AppArgs, engine_arguments
    from deployments.replica import EngineReplica

    args = engine_arguments(AppArgs(compile_model=True, max_num_seqs=8, stream_interval_s=0.02, max_deltas_per_s=500),
                            gpu=False)
    assert args["compile_model"] is True and args["max_num_seqs"] == 8 and args["device"] == "cpu"
    assert args["stream_interval_s"] == 0.02 and args["max_deltas_per_s"] == 500
    assert args["keep_prefix_cache"] is True  # a replica keeps its conversations' prefixes by default
    assert engine_arguments(AppArgs(keep_prefix_cache=False), gpu=False)["keep_prefix_cache"] is False
    assert args["engine_process"] is None  # the replica decides: a child process where its engine is on a GPU
    assert engine_arguments(AppArgs(engine_process="false"), gpu=True)["engine_process"] is False
    from deployments.app import engine_cpus

    # The engine's process takes a core of its own: Ray places the replica counting it.
    assert [engine_cpus(AppArgs(), gpu=True), engine_cpus(AppArgs(), gpu=False)] == [2, 1]
    assert [engine_cpus(AppArgs(engine_process=False), gpu=True), engine_cpus(AppArgs(engine_process=True), gpu=False)] == [1, 2]
    assert engine_arguments(AppArgs(), gpu=True)["device"] == "cuda"
    assert args["model_id"] is None and args["model_alias"] == "SmolLM2-135M-Instruct"
    named = engine_arguments(AppArgs(served_model_name="mine"), gpu=False)
    assert named["model_id"] == named["model_alias"] == "mine"
    assert set(args) <= set(inspect.signature(EngineReplica.__init__).parameters)
    vllm_like = engine_arguments(AppArgs(enforce_eager=True, seed=3), gpu=True)  # vLLM's --enforce-eager, --seed
    assert (vllm_like["enforce_eager"], vllm_like["seed"], args["enforce_eager"], args["seed"]) == (True, 3, False, None)
    # vLLM's --revision and --trust-remote-code reach the engine, and the prefix router's tokenizer loads alike.
    pinned = AppArgs(model="org/model", revision="v2", trust_remote_code=True, router="prefix")
    assert {k: engine_arguments(pinned, gpu=True)[k] for k in ("revision", "trust_remote_code")} == \
        {"revision": "v2", "trust_remote_code": True}
    assert (args["revision"], args["trust_remote_code"]) == (None, False)
    from deployments.app import router_arguments

    router = router_arguments(pinned)
    assert (router["model"], router["revision"], router["trust_remote_code"]) == ("org/model", "v2", True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(enforce_eager=True, compile_model=True), "enforce_eager=true and compile_model=true: allowed: one of them"),
    (dict(seed=-1), "seed"),
])
def test_vllm_style_engine_args_are_checked_when_the_app_is_built(kwargs, message):
    from pydantic import ValidationError

    from deployments.app import AppArgs

    with pytest.raises(ValidationError, match=message):
        AppArgs(**kwargs)


def test_unset_batch_and_autoscaling_args_are_sized_to_the_device():
    from deployments.app import AppArgs

    gpu, cpu = AppArgs().for_device(gpu=True), AppArgs().for_device(gpu=False)
    assert (gpu.max_num_seqs, gpu.target_ongoing_requests, gpu.replica_max_ongoing_requests) == (256, 256, 512)
    assert (cpu.max_num_seqs, cpu.target_ongoing_requests, cpu.replica_max_ongoing_requests) == (64, 16, 128)
    mine = AppArgs(max_num_seqs=32, target_ongoing_requests=4).for_device(gpu=True)
    assert (mine.max_num_seqs, mine.target_ongoing_requests) == (32, 4)  # what the operator set stays
    assert AppArgs(max_num_seqs=32).for_device(gpu=True).target_ongoing_requests == 32
    assert AppArgs().compile_model is None and AppArgs(compile_model="null").compile_model is None
    assert (AppArgs().replica_num_gpus, AppArgs(gpu_memory_utilization=0.45).replica_num_gpus) == (1, 0.45)
    assert AppArgs(num_gpus=0.5, kv_cache_memory="8GiB").replica_num_gpus == 0.5
    with pytest.raises(ValueError, match=r"num_gpus=0 is not supported; allowed: a number > 0"):
        AppArgs(num_gpus=0)


def test_cluster_yaml_matches_the_cluster_launchers_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(config))
    workers = config["available_node_types"]["gpu_worker"]
    assert workers["resources"]["GPU"] == 1 and workers["min_workers"] <= workers["max_workers"]
    assert config["available_node_types"]["head"]["resources"]["GPU"] == 0
    assert any("serve deploy deployments/app.yaml" in c for c in config["head_start_ray_commands"])
    broken = prepare_config(yaml.safe_load((ROOT / "cluster.yaml").read_text()))
    broken["available_node_types"]["gpu_worker"]["max_workers"] = "many"
    with pytest.raises(Exception, match="max_workers"):
        validate_config(broken)
