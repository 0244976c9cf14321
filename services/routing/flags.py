"""The router's flags, declared once for every process that routes: the kv-router service, a
processor with `--routing local`, and the launcher (which hands the same values to its routers)."""

from __future__ import annotations

import argparse

from services.mesh.config_error import validated
from services.mesh.flags import non_negative_float, non_negative_int, positive_float, positive_int
from services.routing.admission.gate import AdmissionConfig
from services.routing.config import RouterConfig
from services.routing.kv_truth import KvEventsMode, KvTruthConfig
from services.routing.cost_function import COST_MODELS, CostModel, CostWeights
from services.routing.pickers import ROUTER_MODES
from services.routing.session_bindings import AFFINITIES, Affinity, SessionConfig

_WEIGHTS = CostWeights()
_ADMISSION = AdmissionConfig()
_TRUTH = KvTruthConfig()
_SESSIONS = SessionConfig()


def add_router_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Returns the group, so the launcher can hand the same values to its routers."""
    g = parser.add_argument_group("routing")
    g.add_argument("--router-mode", choices=ROUTER_MODES, default=RouterConfig.mode)
    g.add_argument("--seed", type=int, default=None, help="seed for random tie-breaking (reproducible runs)")
    g.add_argument("--overlap-weight", type=float, default=_WEIGHTS.overlap,
                   help="cost function: weight of the cached share")
    g.add_argument("--cache-usage-weight", type=float, default=_WEIGHTS.cache_usage,
                   help="cost function: weight of KV cache usage")
    g.add_argument("--waiting-weight", type=float, default=_WEIGHTS.waiting,
                   help="cost function: weight of the normalized queue")
    g.add_argument("--router-temperature", type=non_negative_float, default=_WEIGHTS.temperature,
                   help="0 = best logit wins; > 0 = sample from softmax(logit / T)")
    g.add_argument("--host-overlap-weight", type=non_negative_float, default=None,
                   help="cost function: a fixed credit for a prefix block held in a worker's host memory "
                        "(0 = ignore the host tier; default: derived from what loading it back saves "
                        "against recomputing it)")
    # Left out (None), these three fall back to the config's defaults in the launcher's children too.
    g.add_argument("--cost-model", choices=COST_MODELS, default=None,
                   help=f"kv mode's rule: cached-share (the share of the prompt a worker caches vs its cache usage vs "
                        f"its queue, highest wins) or dynamo (NVIDIA Dynamo's blocks to prefill + blocks to decode, "
                        f"lowest wins); default {_WEIGHTS.model.value}")
    g.add_argument("--prefill-load-scale", type=non_negative_float, default=None,
                   help=f"dynamo cost model: weight of the prefill blocks against the decode blocks "
                        f"(default {_WEIGHTS.prefill_load_scale:g})")
    g.add_argument("--lora-weight", type=non_negative_float, default=None,
                   help=f"cost function: weight of loading a request's LoRA adapter on a worker that does not hold "
                        f"it resident, in both cost models (0 = adapter-blind; only workers that know the adapter "
                        f"are candidates whatever the weight; default {_WEIGHTS.lora:g})")
    g.add_argument("--media-aware-routing", action=argparse.BooleanOptionalAction, default=RouterConfig.media_aware,
                   help="hash the blocks that hold a prompt's images with the images, as workers do (--no-...: the "
                        "tokens alone: no image block matches; a baseline for comparison)")
    g.add_argument("--ttft-objective-ms", type=positive_int, default=None,
                   help="admission: refuse at once (429 with Retry-After) a request whose predicted time to first "
                        "token exceeds this (a request's x-kvmesh-ttft-objective-ms header sets its own; default: "
                        "only those that set one)")
    g.add_argument("--worker-queue", type=non_negative_int, default=_ADMISSION.worker_queue,
                   help="admission: requests a decode worker may hold beyond its slots; the rest wait in the "
                        "router's ordered queue")
    g.add_argument("--max-queued", type=positive_int, default=_ADMISSION.max_queued,
                   help="admission: requests waiting in the router's queue at most (then 429)")
    g.add_argument("--max-queue-wait", type=positive_float, default=_ADMISSION.max_queue_wait_s,
                   help="admission: the longest any request may wait for a worker, in seconds (then 429)")
    g.add_argument("--tenant-policies", default=None, metavar="FILE",
                   help="admission: tenants' weights and limits (TOML), read again when it changes")
    # Strings on the command line (the launcher forwards them as they are); modes in the config.
    g.add_argument("--kv-events", choices=tuple(m.value for m in KvEventsMode), default=_TRUTH.kv_events.value,
                   help="off: follow no worker's KV events; predict each worker's cache from the prompts routed "
                        "to it (on: follow them, predicting only a worker whose events are gone or wrong)")
    g.add_argument("--prediction-ttl", type=positive_float, default=_TRUTH.prediction_ttl_s,
                   help="seconds a routed prompt's blocks are predicted to stay in the worker's cache")
    g.add_argument("--prediction-max-blocks", type=positive_int, default=_TRUTH.prediction_max_blocks,
                   help="blocks predicted per worker at most (the least recently routed go first)")
    g.add_argument("--index-accuracy-floor", type=non_negative_float, default=_TRUTH.index_accuracy_floor,
                   help="a worker whose recent index accuracy falls under this (0..1) is predicted until its "
                        "events agree again")
    g.add_argument("--session-affinity", choices=AFFINITIES, default=_SESSIONS.affinity.value,
                   help="agent sessions (x-session-id): soft = prefer the worker a session is bound to (the load terms "
                        "can outweigh it), hard = keep to it while it serves, off = plain kv routing; a binding "
                        "also asks the worker to keep the session's blocks for --session-ttl")
    g.add_argument("--session-ttl", type=positive_float, default=_SESSIONS.ttl_s,
                   help="seconds a session stays bound to its worker after its last request (and its blocks kept)")
    g.add_argument("--session-weight", type=non_negative_float, default=_SESSIONS.weight,
                   help="soft affinity: the bound worker's bonus (cached-share rule: logit; dynamo rule: whole prompts of "
                        "prefill)")
    return g


def session_config(args: argparse.Namespace) -> SessionConfig:
    return validated(lambda: SessionConfig(affinity=Affinity(args.session_affinity), ttl_s=args.session_ttl,
                                           weight=args.session_weight))


def router_config(args: argparse.Namespace) -> RouterConfig:
    model = _WEIGHTS.model if args.cost_model is None else CostModel(args.cost_model)
    weights = validated(lambda: CostWeights(
        overlap=args.overlap_weight, cache_usage=args.cache_usage_weight, waiting=args.waiting_weight,
        temperature=args.router_temperature, host_overlap=args.host_overlap_weight, model=model,
        prefill_load_scale=_WEIGHTS.prefill_load_scale if args.prefill_load_scale is None else args.prefill_load_scale,
        lora=_WEIGHTS.lora if args.lora_weight is None else args.lora_weight))
    truth = validated(lambda: KvTruthConfig(kv_events=KvEventsMode(args.kv_events), prediction_ttl_s=args.prediction_ttl,
                                            prediction_max_blocks=args.prediction_max_blocks,
                                            index_accuracy_floor=args.index_accuracy_floor))
    return validated(lambda: RouterConfig(mode=args.router_mode, seed=args.seed, weights=weights, kv_truth=truth,
                                          media_aware=args.media_aware_routing))


def admission_config(args: argparse.Namespace) -> AdmissionConfig:
    objective = args.ttft_objective_ms / 1000 if args.ttft_objective_ms else None
    return validated(lambda: AdmissionConfig(ttft_objective_s=objective, worker_queue=args.worker_queue,
                                             max_queued=args.max_queued, max_queue_wait_s=args.max_queue_wait,
                                             tenant_policies=args.tenant_policies))
