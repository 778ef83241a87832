"""app.yaml and cluster.yaml validated against Ray's own schemas, without starting anything."""

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve")

ROOT = Path(__file__).resolve().parent.parent


def test_app_yaml_matches_serves_schema_and_builds():
    from ray.serve.schema import ServeDeploySchema

    from deployments.app.args import AppArgs
    from deployments.app.builder import build

    config = yaml.safe_load((ROOT / "deployments" / "app.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(config)
    (app,) = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("ponytail", "/", "deployments.app:build")
    assert app.args["model"] is None and set(app.args["engine"]) == {"kv_cache_memory", "max_model_len"}
    AppArgs(**app.args)  # every arg is one the builder knows
    assert build(app.args) is not None


def test_app_args_are_checked():
    from deployments.app.args import AppArgs

    with pytest.raises(ValueError, match=r"engine: device='tpu' is not supported; allowed: auto, cuda, cuda:N, cpu"):
        AppArgs(engine={"device": "tpu"})
    with pytest.raises(ValueError, match="min_replicas=3, max_replicas=2"):
        AppArgs(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="router='random' is not supported; allowed: kv_blocks, prefix, power_of_two"):
        AppArgs(router="random")
    with pytest.raises(ValueError, match="engine: compile_model='yes' is not supported; allowed: True, False or None"):
        AppArgs(engine={"compile_model": "yes"})
    with pytest.raises(ValueError, match="engine: fuse_projections=2 is not supported; allowed: True, False or None"):
        AppArgs(engine={"tuning": {"fuse_projections": 2}})
    with pytest.raises(ValueError, match="engine: unknown engine argument max_num_sequences; allowed: async_scheduling, block_size, "):
        AppArgs(engine={"max_num_sequences": 8})
    with pytest.raises(ValueError, match="engine_process='sometimes' is not supported; allowed: true, false, null"):
        AppArgs(engine_process="sometimes")
    with pytest.raises(ValueError, match=r"max_hold_s=-1 is not supported; allowed: seconds >= 0 \(0: never hold\)"):
        AppArgs(max_hold_s=-1)
    with pytest.raises(ValueError, match=r"stream_interval_s=5 is not supported; allowed: seconds from 0 to 1"):
        AppArgs(stream_interval_s=5)
    with pytest.raises(ValueError, match=r"ingress_replicas\n  Input should be greater than or equal to 1"):
        AppArgs(ingress_replicas=0)
    with pytest.raises(ValueError, match=r"max_deltas_per_s=-5 is not supported; allowed: a number > 0, or null"):
        AppArgs(max_deltas_per_s=-5)


def test_the_ingress_scales_to_ingress_replicas():
    from deployments.app.builder import build

    # Serve's Application keeps its ingress deployment here; no public accessor exists.
    ingress = build({"engine": {"device": "cpu"}, "ingress_replicas": "3"})._bound_deployment
    assert (ingress.name, ingress.num_replicas) == ("OpenAIIngress", 3)
    assert build({"engine": {"device": "cpu"}, "api_in_engines": False})._bound_deployment.name == "OpenAIIngress"


def test_the_engine_replicas_serve_the_api_unless_the_router_or_ingress_replicas_need_an_ingress():
    from deployments.app.args import AppArgs
    from deployments.app.builder import build
    from deployments.app.engine_api import EngineAPI

    app = build({"engine": {"device": "cpu"}})._bound_deployment
    assert app.name == "EngineReplica" and issubclass(app.func_or_class, EngineAPI)
    assert AppArgs().serves_api_in_engines and not AppArgs(router="prefix").serves_api_in_engines
    assert not AppArgs(ingress_replicas=2).serves_api_in_engines
    assert build({"engine": {"device": "cpu"}, "router": "prefix"})._bound_deployment.name == "OpenAIIngress"
    for clash in ({"router": "prefix"}, {"ingress_replicas": 2}):
        with pytest.raises(ValueError, match=r"api_in_engines=true with router=.*allowed: api_in_engines false or "
                                             r"null with router prefix or ingress_replicas > 1"):
            AppArgs(api_in_engines=True, **clash)
    with pytest.raises(ValueError, match=r"prefill_delay_factor=-1 is not supported; allowed: a number >= 0"):
        AppArgs(engine={"tuning": {"prefill_delay_factor": -1}})
    with pytest.raises(ValueError, match=r"generation_config\n  Input should be 'auto' or 'ponytail'"):
        AppArgs(generation_config="vllm")


def test_app_args_are_typed_from_strings_and_refuse_unknown_names():
    """`serve run deployments.app:build key=value` hands the builder strings (the engine's a JSON object)."""
    from deployments.app.args import AppArgs
    from deployments.app.builder import build

    settings = AppArgs.model_validate({"max_replicas": "3", "min_replicas": "2", "max_hold_s": "0.5",
                                       "engine": '{"max_model_len": 2048, "compile_model": true}',
                                       "model_id": "old-name"})
    assert (settings.min_replicas, settings.max_replicas, settings.max_hold_s) == (2, 3, 0.5)
    assert settings.engine == {"max_model_len": 2048, "compile_model": True}
    assert settings.served_name() == "old-name"  # app.yaml files written with model_id keep working
    assert build({"max_replicas": "3", "engine": {"device": "cpu"}}) is not None
    with pytest.raises(ValueError, match=r"max_replica\n  Extra inputs are not permitted"):
        build({"max_replica": "3"})
    with pytest.raises(ValueError, match=r"max_replicas\n  Input should be a valid integer.*input_value='two'"):
        build({"max_replicas": "two"})
    with pytest.raises(ValueError, match=r"engine='\{max_model_len: 8\}' is not JSON"):
        AppArgs(engine="{max_model_len: 8}")


def test_the_served_name_defaults_to_what_clients_can_load():
    from deployments.app.args import AppArgs

    assert AppArgs().served_name() == "SmolLM2-135M-Instruct"
    assert AppArgs(model="HuggingFaceTB/SmolLM2-135M-Instruct").served_name() == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert AppArgs(model=str(ROOT / "deployments") + "/").served_name() == "deployments"  # a local directory
    assert AppArgs(model="x/y", served_model_name="mine").served_name() == "mine"


def test_router_arguments_reach_only_the_kv_block_router():
    from deployments.app.args import AppArgs
    from deployments.app.builder import router_arguments

    assert router_arguments(AppArgs(max_hold_s=0)) == {"max_hold_s": 0.0, "admission": "engine"}
    assert router_arguments(AppArgs(router="power_of_two")) == {}


def test_engine_arguments_reach_the_replica_constructor():
    from deployments.app.args import AppArgs
    from deployments.app.builder import engine_arguments, engine_cpus, router_arguments
    from deployments.app.replica_options import ReplicaOptions

    settings = AppArgs(engine={"compile_model": True, "max_num_seqs": 8}, stream_interval_s=0.02, max_deltas_per_s=500)
    args = engine_arguments(settings, gpu=False)
    assert args["engine"] == {"compile_model": True, "max_num_seqs": 8, "device": "cpu"}
    assert args["stream_interval_s"] == 0.02 and args["max_deltas_per_s"] == 500
    assert set(args) == {"model", "engine", "model_alias", *ReplicaOptions.model_fields}  # what EngineReplica takes
    assert args["engine_process"] is None  # the replica decides: a child process where its engine is on a GPU
    assert engine_arguments(AppArgs(engine_process="false"), gpu=True)["engine_process"] is False
    # The engine's process takes a core of its own: Ray places the replica counting it.
    assert [engine_cpus(AppArgs(), gpu=True), engine_cpus(AppArgs(), gpu=False)] == [2, 1]
    assert [engine_cpus(AppArgs(engine_process=False), gpu=True), engine_cpus(AppArgs(engine_process=True), gpu=False)] == [1, 2]
    assert engine_arguments(AppArgs(), gpu=True)["engine"]["device"] == "cuda"
    cpu_share = engine_arguments(AppArgs(engine={"gpu_memory_utilization": 0.45}), gpu=False)
    assert "gpu_memory_utilization" not in cpu_share["engine"]  # a CPU replica has no GPU to take a share of
    assert args["served_model_name"] is None and args["model_alias"] == "SmolLM2-135M-Instruct"
    named = engine_arguments(AppArgs(served_model_name="mine"), gpu=False)
    assert named["served_model_name"] == named["model_alias"] == "mine"
    # vLLM's --revision and --trust-remote-code reach the engine, and the prefix router's tokenizer loads alike.
    pinned = AppArgs(model="org/model", engine={"revision": "v2", "trust_remote_code": True}, router="prefix")
    assert {k: engine_arguments(pinned, gpu=True)["engine"][k] for k in ("revision", "trust_remote_code")} == \
        {"revision": "v2", "trust_remote_code": True}
    router = router_arguments(pinned)
    assert (router["model"], router["revision"], router["trust_remote_code"]) == ("org/model", "v2", True)


@pytest.mark.parametrize("engine, message", [
    (dict(enforce_eager=True, compile_model=True), "enforce_eager=True runs the model eagerly, but"),
    (dict(seed=-1), "seed=-1 is not supported; allowed: an int >= 0"),
    (dict(kv_cache_memory="8GiB", gpu_memory_utilization=0.5), "allowed: one of them"),
])
def test_vllm_style_engine_args_are_checked_when_the_app_is_built(engine, message):
    from pydantic import ValidationError

    from deployments.app.args import AppArgs

    with pytest.raises(ValidationError, match=message):
        AppArgs(engine=engine)


def test_unset_batch_and_autoscaling_args_are_sized_to_the_device():
    from deployments.app.args import AppArgs

    args = AppArgs()
    assert [(args.max_num_seqs(gpu), args.target_ongoing(gpu), args.replica_max_ongoing_requests(gpu))
            for gpu in (True, False)] == [(256, 256, 512), (64, 16, 128)]
    mine = AppArgs(engine={"max_num_seqs": 32}, target_ongoing_requests=4)
    assert (mine.max_num_seqs(True), mine.target_ongoing(True)) == (32, 4)  # what the operator set stays
    assert AppArgs(engine={"max_num_seqs": 32}).target_ongoing(True) == 32
    assert AppArgs(engine_process="null").engine_process is None
    assert (AppArgs().replica_num_gpus, AppArgs(engine={"gpu_memory_utilization": 0.45}).replica_num_gpus) == (1, 0.45)
    assert AppArgs(num_gpus=0.5, engine={"kv_cache_memory": "8GiB"}).replica_num_gpus == 0.5
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
