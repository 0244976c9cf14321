"""Every config validates itself when built: a setting that cannot work is a one-line ConfigError
naming its flag, before any process starts anything."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.decode_worker.disagg_decision import DisaggConfig
from services.frontend.config import FrontendConfig
from services.routing.cost_function import CostWeights
from services.routing.config import RouterConfig
from services.routing.kv_truth import KvEventsMode, KvTruthConfig
from services.config_error import ConfigError
from services.mesh.flags import MeshConfig, ModelRef, forward_flags
from services.processor.service import ProcessorConfig
from services.tools.make_demo_model import ensure_demo_model
from services.worker.engine_flags import EngineConfig


def demo() -> ModelRef:
    model = ensure_demo_model()
    return ModelRef(str(model), model.name)


BAD: list[tuple[str, Callable[[], object], str]] = [
    ("empty etcd list", lambda: MeshConfig(etcd_endpoints=()), "--etcd-endpoints"),
    ("etcd without scheme", lambda: MeshConfig(etcd_endpoints=("127.0.0.1:2379",)), "--etcd-endpoints"),
    ("namespace with a slash", lambda: MeshConfig(namespace="a/b"), "--namespace"),
    ("unknown log level", lambda: MeshConfig(log_level="LOUD"), "--log-level"),
    ("model dir without config.json", lambda: ModelRef("/nonexistent", "x"), "--model"),
    ("unknown engine", lambda: EngineConfig("tgi", demo(), 16), "--engine"),
    ("zero block size", lambda: EngineConfig("mocker", demo(), 0), "--block-size"),
    ("unknown timing preset", lambda: EngineConfig("mocker", demo(), 16, timing="tpu"), "--timing"),
    ("zero speedup", lambda: EngineConfig("mocker", demo(), 16, speedup=0.0), "--speedup"),
    ("remote prefill without NIXL", lambda: DisaggConfig(remote_prefill=True, can_receive_kv=False), "--remote-prefill"),
    ("negative prefill length", lambda: DisaggConfig(max_local_prefill_length=-1), "--max-local-prefill-length"),
    ("zero prefill timeout", lambda: DisaggConfig(prefill_timeout_s=0), "--prefill-timeout"),
    ("unknown router mode", lambda: RouterConfig(mode="least-loaded"), "--router-mode"),
    ("negative temperature", lambda: RouterConfig(weights=CostWeights(temperature=-1)), "--router-temperature"),
    ("kv events as a bare string", lambda: KvTruthConfig(kv_events="off"), "--kv-events"),  # type: ignore[arg-type]
    ("negative prefill load scale", lambda: CostWeights(prefill_load_scale=-1.0), "--prefill-load-scale"),
    ("zero request timeout", lambda: ProcessorConfig("m", request_timeout_s=0), "--request-timeout"),
    ("non-ASCII API key", lambda: FrontendConfig(api_keys=("schlüssel",)), "--api-key"),
    ("zero body limit", lambda: FrontendConfig(max_body_bytes=0), "--max-body-bytes"),
]


@pytest.mark.parametrize(("case", "build", "flag"), BAD, ids=[case for case, _, _ in BAD])
def test_a_bad_setting_is_one_line_naming_its_flag(case: str, build: Callable[[], object], flag: str) -> None:
    with pytest.raises(ConfigError) as exc:
        build()
    message = str(exc.value)
    assert flag in message
    assert "\n" not in message


def test_flags_left_out_give_exactly_the_config_defaults() -> None:
    """A default is declared once: the launcher's flags fall back to the configs' own defaults."""
    from services.routing.admission.gate import AdmissionConfig
    from services.launch.config import load
    from services.routing.session_bindings import SessionConfig

    cfg = load(["--engine", "mocker"])
    truth = RouterConfig().kv_truth
    assert cfg.disagg_argv == ("--conditional-disagg", "--max-local-prefill-length", "512",
                               "--max-prefill-queue-size", "2", "--prefill-timeout", "30.0")
    assert (DisaggConfig().max_local_prefill_length, DisaggConfig().max_prefill_queue_size) == (512, 2)
    assert cfg.router_argv == ("--router-mode", RouterConfig().mode, "--overlap-weight", "2.0",
                               "--cache-usage-weight", "1.0", "--waiting-weight", "1.0", "--router-temperature", "0.0",
                               "--media-aware-routing", "--worker-queue", str(AdmissionConfig().worker_queue),
                               "--max-queued", str(AdmissionConfig().max_queued),
                               "--max-queue-wait", str(AdmissionConfig().max_queue_wait_s),
                               "--kv-events", truth.kv_events.value, "--prediction-ttl", str(truth.prediction_ttl_s),
                               "--prediction-max-blocks", str(truth.prediction_max_blocks),
                               "--index-accuracy-floor", str(truth.index_accuracy_floor),
                               "--session-affinity", SessionConfig().affinity.value,
                               "--session-ttl", str(SessionConfig().ttl_s),
                               "--session-weight", str(SessionConfig().weight))
    engine = dict(zip(cfg.engine_argv[::2], cfg.engine_argv[1::2], strict=True))
    assert engine["--num-gpu-blocks"] == str(EngineConfig("mocker", demo(), 16).num_gpu_blocks) == "16384"
    assert engine["--timing"] == EngineConfig("mocker", demo(), 16).timing == "h100-8b"
    assert cfg.namespace == MeshConfig().namespace and cfg.log_level == MeshConfig().log_level


@pytest.mark.parametrize("mode", list(KvEventsMode))
def test_the_kv_events_flag_takes_each_modes_name_and_gives_the_mode(mode: KvEventsMode) -> None:
    import argparse

    from services.routing.flags import add_router_flags, router_config

    parser = argparse.ArgumentParser()
    add_router_flags(parser)
    assert router_config(parser.parse_args(["--kv-events", mode.value])).kv_truth.kv_events is mode
    assert router_config(parser.parse_args([])).kv_truth.kv_events is KvEventsMode.ON


def test_forwarded_flags_reproduce_the_values_a_child_needs() -> None:
    import argparse

    p = argparse.ArgumentParser()
    group = p.add_argument_group("g")
    group.add_argument("--mode", default="kv")
    group.add_argument("--limit", type=int, default=512)
    group.add_argument("--switch", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--unset", default=None)
    group.add_argument("--secret", default=None)
    args = p.parse_args(["--limit", "64", "--no-switch", "--secret", "s3"])
    argv = forward_flags(args, group._group_actions, skip=("secret",))
    assert argv == ["--mode", "kv", "--limit", "64", "--no-switch"]
    assert p.parse_args(argv).limit == 64
