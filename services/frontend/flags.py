"""The gateway's flags, declared once for the frontend and the launcher, and its config."""

from __future__ import annotations

import argparse
import os

from services.frontend.config import FrontendConfig
from services.frontend.auth import load_api_keys
from services.frontend.images import ImageLimits
from services.mesh.config_error import validated
from services.mesh.flags import port_number, positive_int

DEFAULT_HTTP_PORT = 8000
# API keys travel by environment or file, not argv, so they never show in `ps`.
API_KEY_ENV = "KVMESH_API_KEY"
API_KEY_FILE_ENV = "KVMESH_API_KEY_FILE"


def add_frontend_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Returns the group, so the launcher can hand the same values to its frontend."""
    g = parser.add_argument_group("HTTP gateway")
    g.add_argument("--http-port", type=port_number, default=DEFAULT_HTTP_PORT)
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require one of these bearer tokens, comma-separated (env {API_KEY_ENV})")
    g.add_argument("--api-key-file", default=os.environ.get(API_KEY_FILE_ENV) or None,
                   help=f"file with accepted bearer tokens, one per line, each optionally followed by its tenant "
                        f"(env {API_KEY_FILE_ENV})")
    g.add_argument("--tenant-header", default=None, metavar="NAME",
                   help="take a request's tenant from this header (set by a proxy you trust) instead of its API key")
    g.add_argument("--reuse-port", action="store_true",
                   help="share --http-port with other frontends on this host (SO_REUSEPORT: the kernel spreads "
                        "connections over them)")
    g.add_argument("--metrics-port", type=port_number, default=None,
                   help="serve /health, /live and /metrics on this port only, not on --http-port")
    g.add_argument("--hide-routing-details", action="store_true",
                   help="leave out x-kvmesh-worker, x-kvmesh-prefill and cached_tokens (a prefix-cache side channel)")
    g.add_argument("--allow-explain", action="store_true",
                   help="answer a request sent with `x-kvmesh-explain: 1` with an x-kvmesh-route header: "
                        "the chosen worker and the runner-up with their routing terms")
    g.add_argument("--allow-runtime-lora", action="store_true",
                   help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read adapter paths on "
                        "the workers' machines; without this flag they answer 403)")
    g.add_argument("--session-from-user", action="store_true",
                   help="a request without an x-session-id header is in the agent session its `user` field names "
                        "(Anthropic's metadata.user_id on /v1/messages)")
    g.add_argument("--max-body-bytes", type=positive_int, default=FrontendConfig.max_body_bytes)
    g.add_argument("--max-inflight", type=positive_int, default=FrontendConfig.max_inflight,
                   help="concurrent requests before 429")
    g.add_argument("--max-images", type=int, default=ImageLimits.max_images,
                   help="images taken in one request (0: none)")
    g.add_argument("--max-image-bytes", type=positive_int, default=ImageLimits.max_image_bytes,
                   help="bytes of one image, once decoded")
    g.add_argument("--max-request-image-bytes", type=positive_int, default=ImageLimits.max_request_image_bytes,
                   help="bytes of all of a request's images (at most 48 MiB: a request travels in one message)")
    g.add_argument("--image-url-allow", action="append", default=[], metavar="PREFIX",
                   help="fetch http(s) image URLs that start with this prefix, e.g. https://images.example.com/ "
                        "(repeatable; without it only data: URLs are taken)")
    return g


def frontend_config(args: argparse.Namespace) -> FrontendConfig:
    keys = validated(lambda: load_api_keys(args.api_key, args.api_key_file))
    return validated(lambda: FrontendConfig(api_keys=tuple(keys), key_tenants=tuple(keys.values()),
                                            tenant_header=args.tenant_header,
                                            max_body_bytes=args.max_body_bytes, max_inflight=args.max_inflight,
                                            hide_routing_details=args.hide_routing_details,
                                            metrics_port=args.metrics_port, allow_explain=args.allow_explain,
                                            allow_runtime_lora=args.allow_runtime_lora,
                                            session_from_user=args.session_from_user,
                                            images=ImageLimits(args.max_images, args.max_image_bytes,
                                                               args.max_request_image_bytes,
                                                               tuple(args.image_url_allow))))
