"""A choice's text read as content, reasoning and tool calls, as it streams.

One parser per choice, beside its detokenizer: it sees the same text deltas in the same order, so
a choice moved to another worker keeps its parser, and a choice taken over from a failed processor
replays the tokens the client already has through a fresh one (their output is discarded, as the
detokenizer's is). Calls are numbered from 0 per choice and their ids derive from the request id,
the choice and the call's number, so a taken-over stream names its calls as the unbroken one would.

- `auto` (or no tool_choice) with `--tool-call-parser NAME`, and `--reasoning-parser NAME`: vLLM's
  parsers (`vllm.tool_parsers`, `vllm.reasoning`), through `VllmParsers`; reasoning first, then
  tool calls in what follows it.
- a named function (`NamedCall`): the output is the arguments, enforced by structured output;
  they stream as they come.
- `required` (`RequiredCalls`): the output is a JSON array of calls, enforced by structured
  output; each call is sent whole when the array is complete.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gen.kvmesh.v1 import processor_pb2
from services.config_error import ConfigError
from services.processor.chat_render import openai_tools

Mode = processor_pb2.ToolChoice.Mode


@dataclass(slots=True)
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[processor_pb2.ToolCallDelta] = field(default_factory=list)


class OutputParser(Protocol):
    # True once a tool call was emitted: the choice then finishes with "tool_calls".
    called: bool

    def push(self, text: str, ids: Sequence[int]) -> Parsed: ...

    def finish(self) -> Parsed: ...


ParserFactory = Callable[[str, int], OutputParser]  # (request id, choice index) -> the choice's parser


def call_id(rid: str, choice: int, call: int) -> str:
    return "call_" + hashlib.blake2b(f"{rid}/{choice}/{call}".encode(), digest_size=12).hexdigest()


class NamedCall:
    def __init__(self, rid: str, choice: int, function: str) -> None:
        self.called = False
        self._id = call_id(rid, choice, 0)
        self._function = function

    def push(self, text: str, ids: Sequence[int]) -> Parsed:
        if not text and self.called:
            return Parsed()
        delta = processor_pb2.ToolCallDelta(index=0, arguments=text)
        if not self.called:
            self.called = True
            delta.id, delta.name = self._id, self._function
        return Parsed(calls=[delta])

    def finish(self) -> Parsed:
        return self.push("", ())


class RequiredCalls:
    def __init__(self, rid: str, choice: int) -> None:
        self.called = False
        self._rid, self._choice = rid, choice
        self._text: list[str] = []

    def push(self, text: str, ids: Sequence[int]) -> Parsed:
        self._text.append(text)
        return Parsed()

    def finish(self) -> Parsed:
        text = "".join(self._text)
        try:
            calls = json.loads(text)
            parsed = [processor_pb2.ToolCallDelta(index=i, id=call_id(self._rid, self._choice, i), name=c["name"],
                                                  arguments=json.dumps(c["parameters"], ensure_ascii=False))
                      for i, c in enumerate(calls)]
        except (ValueError, TypeError, KeyError):
            # Cut short (max_tokens): what the model wrote, as text, never a half call.
            return Parsed(content=text)
        self.called = bool(parsed)
        return Parsed(calls=parsed)


class VllmParsers:
    """vLLM's streaming reasoning and tool-call parsers over one choice's text."""

    def __init__(self, rid: str, choice: int, reasoning: Any | None, tools: Any | None, request: Any) -> None:
        self.called = False
        self._rid, self._choice = rid, choice
        self._reasoning, self._tools, self._request = reasoning, tools, request
        self._in_reasoning = reasoning is not None
        # Everything so far, for the reasoning parser; what follows the reasoning, for the tool parser.
        self._text, self._ids = "", list[int]()
        self._content, self._content_ids = "", list[int]()
        self._last_call = -1

    def push(self, text: str, ids: Sequence[int]) -> Parsed:
        if not text and not ids:
            return Parsed()
        out = Parsed()
        content, content_ids = text, list(ids)
        if self._in_reasoning and self._reasoning is not None:
            prev_text, prev_ids = self._text, self._ids
            self._text, self._ids = prev_text + text, prev_ids + list(ids)
            delta = self._reasoning.extract_reasoning_streaming(prev_text, self._text, text, prev_ids, self._ids,
                                                                list(ids))
            out.reasoning = (delta.reasoning or "") if delta else ""
            content = (delta.content or "") if delta else ""
            if self._reasoning.is_reasoning_end(self._ids):
                self._in_reasoning = False
        if self._tools is None or not content:
            out.content = content
            return out
        prev, prev_ids = self._content, self._content_ids
        self._content, self._content_ids = prev + content, prev_ids + content_ids
        delta = self._tools.extract_tool_calls_streaming(prev, self._content, content, prev_ids, self._content_ids,
                                                         content_ids, self._request)
        if delta is not None:
            out.content = delta.content or ""
            out.calls = [self._call(c) for c in delta.tool_calls or ()]
        return out

    def finish(self) -> Parsed:
        # Arguments a parser read but did not stream yet (it streams only what cannot change).
        rest = self._tools.get_remaining_unstreamed_args() if self._tools is not None and self.called else ""
        if not rest:
            return Parsed()
        return Parsed(calls=[processor_pb2.ToolCallDelta(index=self._last_call, arguments=rest)])

    def _call(self, c: Any) -> processor_pb2.ToolCallDelta:
        out = processor_pb2.ToolCallDelta(index=c.index)
        if c.function is not None:
            out.name = c.function.name or ""
            out.arguments = c.function.arguments or ""
        if out.name:  # a call's first piece: our id, not the parser's random one
            out.id = call_id(self._rid, self._choice, c.index)
        self.called = True
        self._last_call = c.index
        return out


class OutputParsers:
    """The processor's parser configuration (`--tool-call-parser`, `--reasoning-parser`)."""

    def __init__(self, hf_tokenizer: Any, tool_parser: str | None = None, reasoning_parser: str | None = None) -> None:
        self._hf = hf_tokenizer
        self._tool_cls = self._reasoning_cls = None
        if tool_parser:
            from vllm.tool_parsers import ToolParserManager

            self._tool_cls = _named(ToolParserManager, "get_tool_parser", tool_parser, "--tool-call-parser")
        if reasoning_parser:
            from vllm.reasoning import ReasoningParserManager

            self._reasoning_cls = _named(ReasoningParserManager, "get_reasoning_parser", reasoning_parser,
                                         "--reasoning-parser")
            _try(lambda: self._reasoning_cls(hf_tokenizer), "--reasoning-parser", reasoning_parser)  # type: ignore[misc]
        if self._tool_cls is not None:
            _try(lambda: self._tool_cls(hf_tokenizer, []), "--tool-call-parser", tool_parser)  # type: ignore[misc]

    def for_request(self, request: processor_pb2.GenerateRequest) -> ParserFactory | None:
        """A parser per choice of the request; None when its text is just content."""
        chat = request.chat if request.WhichOneof("input") == "chat" else None
        mode = chat.tool_choice.mode if chat is not None and chat.tools else Mode.MODE_NONE
        if mode == Mode.MODE_NAMED:
            function = chat.tool_choice.function  # type: ignore[union-attr]
            return lambda rid, choice: NamedCall(rid, choice, function)
        if mode == Mode.MODE_REQUIRED:
            return RequiredCalls
        tools = self._tool_cls is not None and mode == Mode.MODE_AUTO
        if not tools and self._reasoning_cls is None or chat is None:
            return None
        vllm_request = _vllm_request(openai_tools(chat) if tools else None)

        def parser(rid: str, choice: int) -> OutputParser:
            reasoning = self._reasoning_cls(self._hf) if self._reasoning_cls is not None else None
            tool = self._tool_cls(self._hf, vllm_request.tools) if tools else None  # type: ignore[misc]
            return VllmParsers(rid, choice, reasoning, tool, vllm_request)

        return parser


def _named(manager: Any, getter: str, name: str, flag: str) -> Any:
    try:
        return getattr(manager, getter)(name)
    except KeyError:
        raise ConfigError(f"{flag} {name!r} is not one of vLLM's: {', '.join(manager.list_registered())}") from None


def _try(build: Callable[[], object], flag: str, name: str | None) -> None:
    """Builds a parser once at start-up: a model whose tokenizer lacks the parser's markers
    (`<think>` for a reasoning parser, say) is refused with one line, not on its first request."""
    try:
        build()
    except Exception as exc:  # noqa: BLE001 - any parser's constructor error means the same
        raise ConfigError(f"{flag} {name!r} cannot read this model's output: {' '.join(str(exc).split())[:200]}") from None


def _vllm_request(tools: list[dict[str, Any]] | None) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"model": "-", "messages": [], "tools": tools,
                                                 "tool_choice": "auto" if tools else "none"})
