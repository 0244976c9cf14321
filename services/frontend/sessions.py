"""Which agent session a request belongs to, read at the edge.

A session is named by the `x-session-id` header; without one, by the conversation id an agent
client sends on its own (Claude Code's `metadata.user_id` carries a JSON object with its
`session_id`; Codex sends `prompt_cache_key`; one that is not a valid id is used as its digest);
where the gateway runs with `--session-from-user`,
a request without either is in the session its body's `user` names (OpenAI's field; the
Messages API's `metadata.user_id` arrives as the same field). A sub-agent names its parent
session in `x-parent-session-id`: it is placed where the parent's prefix is (the router's
session bindings, services/routing/session_bindings.py). Ids travel into etcd keys and logs, so
they are short printable ASCII; anything else is a 400 naming the header or field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from gen.kvmesh.v1 import common_pb2
from services.frontend.errors import ApiError
from services.frontend.short_names import is_short_name, request_name

SESSION_HEADER = "x-session-id"
PARENT_SESSION_HEADER = "x-parent-session-id"
# Long enough for agents' own ids (Claude Code's metadata.user_id is about 160 characters).
MAX_SESSION_CHARS = 256


def agent_session_id(value: str) -> str:
    """An agent client's own conversation id as a session id: itself when it is one (short
    printable ASCII without `/`), else a digest of it (`h-` and 32 hex digits). The client chose
    the value for its own purposes (OpenAI's prompt_cache_key is any string): it is never
    refused for not being a session id."""
    name = value.strip()
    if is_short_name(name, MAX_SESSION_CHARS, without="/"):
        return name
    return "h-" + hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def request_session(headers: Mapping[str, str], user: str | None, from_user: bool,
                    agent: tuple[str, str] | None = None) -> common_pb2.SessionRef | None:
    """The request's session (None: it belongs to none). `agent`: the conversation id an agent
    client sends on its own and the field it came in (Claude Code's `metadata.user_id`
    session_id, Codex's `prompt_cache_key`), the session when no header names one; `user`: the body's `user` field,
    the session id when `from_user` (--session-from-user) and neither names one."""
    session_id = headers.get(SESSION_HEADER)
    where = SESSION_HEADER
    if session_id is None and agent is not None and agent[0].strip():
        session_id, where = agent_session_id(agent[0]), agent[1]
    if session_id is None and from_user and user:
        session_id, where = user, "user"
    parent = headers.get(PARENT_SESSION_HEADER)
    if session_id is None:
        if parent is not None:
            raise ApiError(400, f"{PARENT_SESSION_HEADER} needs {SESSION_HEADER}: a sub-agent's own session",
                           param=PARENT_SESSION_HEADER, code="invalid_value")
        return None
    session = common_pb2.SessionRef(id=request_name(session_id, where, MAX_SESSION_CHARS, without="/"))
    if parent is not None:
        session.parent_id = request_name(parent, PARENT_SESSION_HEADER, MAX_SESSION_CHARS, without="/")
    return session
