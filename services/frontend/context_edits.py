"""Anthropic's context editing (`context_management.edits`), applied by the gateway before the
conversation is rendered, for any model.

- `clear_thinking_20251015`: the thinking blocks of all but the last `keep` assistant turns that
  have some are dropped (default 1; `keep: "all"` drops none).
- `clear_tool_uses_20250919`: once the prompt reaches `trigger` (default 100,000 input tokens, or
  a count of tool uses), the oldest tool results give way to CLEARED_RESULT, all but the last
  `keep` tool uses (default 3) and never those of `exclude_tools` or one cleared already (a
  cleared result keeps its tool_reference blocks: the tools a search loaded stay loaded); with
  `clear_tool_inputs` (all, or the named tools) their calls' inputs become `{}` too. A
  `tool_uses` trigger counts every tool use of the conversation. With `clear_at_least`, nothing is
  cleared unless that many input tokens would be.

Edits run in the order given; each one applied is reported as Anthropic reports it
(`context_management.applied_edits`: the type, what was cleared, and `cleared_input_tokens`, the
prompt's tokens before the edit less those after, counted by a processor as /count_tokens does).
Counting costs a render and a tokenization on a processor, so it is done only when an edit has
something to clear. The client keeps its whole history; a cleared prompt differs from the last
one from the first cleared block on, so the prefix cache holds only what precedes it (the reason
to clear in large steps: `clear_at_least`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from services.frontend.messages_schemas import (
    ClearThinking,
    ClearToolUses,
    CountTokensRequest,
    InputTokens,
    MessageIn,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)

CLEARED_RESULT = "[this tool result was cleared to save context]"
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING_TURNS = 1

Count = Callable[[CountTokensRequest], Awaitable[int]]


async def apply_edits(req: CountTokensRequest, count: Count) -> tuple[CountTokensRequest, list[dict[str, Any]]]:
    """The request as the model is to see it, and the edits applied (empty when none was)."""
    applied: list[dict[str, Any]] = []
    if req.context_management is None:
        return req, applied
    before: int | None = None
    for edit in req.context_management.edits:
        if isinstance(edit, ClearThinking):
            messages, cleared = _clear_thinking(req.messages, edit)
            report: dict[str, Any] = {"type": edit.type, "cleared_thinking_turns": cleared}
        else:
            if _over_trigger(req, edit) is False:
                continue
            tokens = _trigger_tokens(edit)
            if tokens is not None:
                if before is None:
                    before = await count(req)
                if before < tokens:
                    continue
            messages, cleared = _clear_tool_uses(req.messages, edit)
            report = {"type": edit.type, "cleared_tool_uses": cleared}
        if not cleared:
            continue
        edited = req.model_copy(update={"messages": messages})
        if before is None:
            before = await count(req)
        after = await count(edited)
        if isinstance(edit, ClearToolUses) and edit.clear_at_least is not None \
                and before - after < edit.clear_at_least.value:
            continue
        report["cleared_input_tokens"] = max(0, before - after)
        applied.append(report)
        req, before = edited, after
    return req, applied


def _trigger_tokens(edit: ClearToolUses) -> int | None:
    """The input tokens past which the edit applies (None: its trigger counts tool uses)."""
    if edit.trigger is None:
        return DEFAULT_TRIGGER_TOKENS
    return edit.trigger.value if isinstance(edit.trigger, InputTokens) else None


def _over_trigger(req: CountTokensRequest, edit: ClearToolUses) -> bool | None:
    """Whether a tool-use trigger is reached (None: the trigger is in tokens, to be counted).
    False also when there is nothing to clear, so nothing is counted for nothing. The trigger
    counts every tool use of the conversation; only clearing passes over `exclude_tools` and
    results already cleared."""
    if len(_tool_uses(req.messages, edit)) <= _keep(edit):
        return False
    if edit.trigger is not None and not isinstance(edit.trigger, InputTokens):
        return len(_tool_uses(req.messages, None)) >= edit.trigger.value
    return None


def _keep(edit: ClearToolUses) -> int:
    return edit.keep.value if edit.keep is not None else DEFAULT_KEEP_TOOL_USES


def _tool_uses(messages: list[MessageIn], edit: ClearToolUses | None) -> list[str]:
    """Ids of the tool uses the edit may clear, oldest first (None: every tool use)."""
    excluded = set(edit.exclude_tools or ()) if edit is not None else set()
    cleared = {block.tool_use_id for m in messages if not isinstance(m.content, str) for block in m.content
               if isinstance(block, ToolResultBlock) and _cleared(block)} if edit is not None else set()
    return [block.id for m in messages if m.role == "assistant" and not isinstance(m.content, str)
            for block in m.content if isinstance(block, ToolUseBlock) and block.name not in excluded
            and block.id not in cleared]


def _cleared(block: ToolResultBlock) -> bool:
    """Whether a result was cleared already (by an earlier edit of the same request)."""
    content = block.content
    if isinstance(content, list):
        return bool(content) and isinstance(content[0], TextBlock) and content[0].text == CLEARED_RESULT
    return content == CLEARED_RESULT


def _clear_tool_uses(messages: list[MessageIn], edit: ClearToolUses) -> tuple[list[MessageIn], int]:
    uses = _tool_uses(messages, edit)
    cleared = set(uses[:max(0, len(uses) - _keep(edit))])
    if not cleared:
        return messages, 0
    inputs = edit.clear_tool_inputs
    out: list[MessageIn] = []
    for m in messages:
        if isinstance(m.content, str):
            out.append(m)
            continue
        blocks = []
        for block in m.content:
            if isinstance(block, ToolResultBlock) and block.tool_use_id in cleared:
                block = block.model_copy(update={"content": _placeholder(block)})
            elif isinstance(block, ToolUseBlock) and block.id in cleared and (
                    inputs is True or isinstance(inputs, list) and block.name in inputs):
                block = block.model_copy(update={"input": {}})
            blocks.append(block)
        out.append(m.model_copy(update={"content": blocks}))
    return out, len(cleared)


def _placeholder(block: ToolResultBlock) -> str | list[TextBlock | ToolReferenceBlock]:
    """A cleared result's content: the placeholder, and the tool references it held (the tools
    a search loaded stay loaded: they are defined nowhere else in the prompt)."""
    refs = [p for p in block.content if isinstance(p, ToolReferenceBlock)] if isinstance(block.content, list) else []
    if not refs:
        return CLEARED_RESULT
    return [TextBlock(type="text", text=CLEARED_RESULT), *refs]


def _clear_thinking(messages: list[MessageIn], edit: ClearThinking) -> tuple[list[MessageIn], int]:
    if edit.keep == "all":
        return messages, 0
    keep = edit.keep.value if edit.keep is not None else DEFAULT_KEEP_THINKING_TURNS
    turns = [i for i, m in enumerate(messages) if m.role == "assistant" and not isinstance(m.content, str)
             and any(isinstance(b, ThinkingBlock | RedactedThinkingBlock) for b in m.content)]
    cleared = set(turns[:max(0, len(turns) - keep)])
    if not cleared:
        return messages, 0
    out = [m.model_copy(update={"content": [b for b in m.content if not isinstance(b, ThinkingBlock | RedactedThinkingBlock)]})
           if i in cleared and not isinstance(m.content, str) else m for i, m in enumerate(messages)]
    return out, len(cleared)
