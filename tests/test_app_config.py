"""Application arguments, serve configs and the cluster definition, checked without starting Ray."""

import importlib
from pathlib import Path
from types import SimpleNamespace

import pydantic
import pytest
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve import Application
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema
import yaml

from deployments.app import build_colocated_app, build_pd_app
from tests.models import make_random_model

ROOT = Path(__file__).resolve().parents[1]


def test_cluster_yaml_passes_rays_validation():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(config))
    types = config["available_node_types"]
    assert types["prefill_worker"]["resources"]["prefill"] > 0
    assert types["decode_worker"]["resources"]["decode"] > 0


@pytest.mark.parametrize("name", ["local.yaml", "colocated.yaml", "pd-autoscale.yaml", "tls.yaml"])
def test_serve_configs_are_valid_and_loopback(name):
    config = yaml.safe_load((ROOT / "configs" / name).read_text())
    ServeDeploySchema.model_validate(config)
    assert config["http_options"]["host"] == "127.0.0.1"


def test_pd_autoscale_puts_p_and_d_on_their_node_types():
    config = yaml.safe_load((ROOT / "configs" / "pd-autoscale.yaml").read_text())
    deployments = {d["name"]: d for d in config["applications"][0]["deployments"]}
    assert deployments["PrefillServer"]["ray_actor_options"]["resources"] == {"prefill": 1}
    assert deployments["DecodeServer"]["ray_actor_options"]["resources"] == {"decode": 1}
    for name in ("PrefillServer", "DecodeServer"):
        scaling = deployments[name]["autoscaling_config"]
        assert scaling["max_replicas"] > scaling["min_replicas"] >= 1
        assert deployments[name]["max_ongoing_requests"] > 5


def test_pd_autoscale_policies_scale_p_and_d_on_their_own_signals():
    config = yaml.safe_load((ROOT / "configs" / "pd-autoscale.yaml").read_text())
    deployments = {d["name"]: d for d in config["applications"][0]["deployments"]}

    def policy(name: str):
        spec = deployments[name]["autoscaling_config"]["policy"]
        module, _, attr = spec["policy_function"].partition(":")
        return getattr(importlib.import_module(module), attr)(**spec["policy_kwargs"])

    def ctx(**metrics):
        return SimpleNamespace(aggregated_metrics=metrics, target_num_replicas=2)

    prefill, decode = policy("PrefillServer"), policy("DecodeServer")
    assert prefill(ctx(queued_prompt_tokens={"a": 6000.0, "b": 5000.0})) == (3, {})  # 11000 tokens / 4096
    assert prefill(ctx()) == (2, {})  # nothing reported yet: no change
    assert decode(ctx(requests={"a": 40.0, "b": 30.0}, kv_usage={"a": 0.2, "b": 0.2})) == (3, {})  # 70 / 32
    assert decode(ctx(requests={"a": 10.0, "b": 10.0}, kv_usage={"a": 0.9, "b": 0.9})) == (3, {})  # 1.8 / 0.7
    with pytest.raises(ValueError, match="target_queued_prompt_tokens"):
        type(prefill)(target_queued_prompt_tokens=0)


def as_serve_run(builder, args: dict):
    """Call a builder exactly as `serve run module:builder key=value` does."""
    return call_user_app_builder_with_args_if_necessary(builder, args)


@pytest.mark.parametrize("builder", [build_pd_app, build_colocated_app])
def test_builders_work_as_serve_run_calls_them(builder):
    assert isinstance(as_serve_run(builder, {}), Application)
    assert isinstance(as_serve_run(builder, {"max_iter_times": "64", "model": "tiny-llama"}), Application)


def test_builder_arguments_are_typed_and_checked(tmp_path):
    with pytest.raises(pydantic.ValidationError, match="max_iter_times"):
        as_serve_run(build_pd_app, {"max_iter_times": "0"})
    with pytest.raises(pydantic.ValidationError, match="unknown_option"):
        as_serve_run(build_colocated_app, {"unknown_option": "1"})
    with pytest.raises(ValueError, match="local directory"):
        as_serve_run(build_colocated_app, {"model": "org/not-here"})
    other = make_random_model(tmp_path / "other", "llama")
    with pytest.raises(ValueError, match="prefill_model / decode_model"):
        as_serve_run(build_pd_app, {"prefill_model": "tiny-llama", "decode_model": str(other)})


@pytest.mark.parametrize("style,expected", [("openai", ["stop", "stop", "length"]),
                                            ("mindie", ["eos_token", "stop_sequence", "length"])])
def test_finish_reason_style_on_v1(style, expected):
    from transformers import AutoTokenizer

    from dialects.openai_api import OpenAIFrontend
    from engine.outputs import RequestOutput
    from engine.execution.tiny_model import ensure_tiny_model

    front = OpenAIFrontend(AutoTokenizer.from_pretrained(ensure_tiny_model()), "m", 891, 4096, 1024, style)
    reasons = [front.finish_reason(RequestOutput("r", [], "", 1, True, reason, 1))
               for reason in ("eos_token", "stop_sequence", "length")]
    assert reasons == expected


def test_the_engine_settings_among_the_app_arguments_are_the_engines_own():
    """engine/config.py owns each engine setting: AppArgs takes every one an app may set, with its
    default, description and bounds, passes it to the engine, and the engine's checks name it."""
    from dataclasses import fields

    from deployments.config import AppArgs
    from engine.config import EngineConfig, app_settings

    settings = {spec.name: spec for spec in app_settings()}
    assert set(settings) == {f.name for f in fields(EngineConfig)} - {"model", "default_timeout_s",
                                                                     "first_token_from_prefill"}
    for name, spec in settings.items():
        argument = AppArgs.model_fields[name]
        assert (argument.default, argument.description) == (spec.default, spec.metadata["doc"]), name
    given = {"quantization": "int8", "block_size": 32, "enforce_eager": True, "top_k_guess": 8}
    engine = AppArgs(**given).engine_config()
    assert {name: getattr(engine, name) for name in given} == given
    with pytest.raises(pydantic.ValidationError, match="max_num_seqs"):
        AppArgs(max_num_seqs=0)
    with pytest.raises(pydantic.ValidationError, match="quantization: must be one of"):
        AppArgs(quantization="int3")
    with pytest.raises(pydantic.ValidationError, match="prompt_lookup_max: must be >= prompt_lookup_min"):
        AppArgs(prompt_lookup_min=4, prompt_lookup_max=2)


def test_torch_threads_is_refused_unless_a_positive_count_and_applied_when_given():
    from deployments.config import AppArgs

    assert AppArgs(torch_threads=3).engine_config().torch_threads == 3
    assert AppArgs().engine_config().torch_threads is None  # unset: torch's own default (docs/serving.md)
    for bad in (0, -2, "two", 1.5):
        with pytest.raises(pydantic.ValidationError, match="torch_threads"):
            AppArgs(torch_threads=bad)
