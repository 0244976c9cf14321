"""The gateway's flags, declared once for the frontend and the launcher, and its config."""

from __future__ import annotations

import argparse
import os

from services.frontend.app import FrontendConfig
from services.mesh.flags import port_number, positive_int, validated

DEFAULT_HTTP_PORT = 8000
# The API key travels by environment, not argv, so it never shows in `ps`.
API_KEY_ENV = "KVMESH_API_KEY"


def add_frontend_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Returns the group, so the launcher can hand the same values to its frontend."""
    g = parser.add_argument_group("HTTP gateway")
    g.add_argument("--http-port", type=port_number, default=DEFAULT_HTTP_PORT)
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require this bearer token (env {API_KEY_ENV})")
    g.add_argument("--max-body-bytes", type=positive_int, default=FrontendConfig.max_body_bytes)
    g.add_argument("--max-inflight", type=positive_int, default=FrontendConfig.max_inflight,
                   help="concurrent requests before 429")
    return g


def frontend_config(args: argparse.Namespace) -> FrontendConfig:
    return validated(lambda: FrontendConfig(api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                                            max_inflight=args.max_inflight))
