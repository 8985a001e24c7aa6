"""Tool calls in the Qwen2.5 / Hermes format: parsing the model's output into OpenAI `tool_calls`, the grammar that
forces a call, and the holdback of a streamed answer that may turn into calls. Pure text (no torch).

The format (what Qwen2.5's chat template asks for, and how it renders an assistant's past calls):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, several blocks for parallel calls. Parsing (`ToolCallParser.parse`) is all or nothing: every
block must hold a JSON object whose "name" is one of the request's tools and whose "arguments" (absent = {}) is
a JSON object; else no call is returned and the whole text stays content. A last block without its closing tag
counts. An output without tags that is exactly one such JSON object is one call too: small Qwen2.5 models often
drop the tags (Qwen2.5-Coder-0.5B-Instruct does, greedy, on a weather question). Only an output that ended
naturally (finish_reason "stop") is parsed: a truncated one ("length") stays content.

Message content beside the calls: the text before the first call (trailing whitespace dropped) and the text
between and after the calls (stripped), the non-empty pieces joined by newlines; null when all are empty.
"""
from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

from specdec.config import GuidedDecoding
from specdec.models.tokenizer import Tokenizer

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL)
# The arguments as the model writes them (Qwen's template renders past calls with json.dumps' separators); a
# schema's own "x-guidance" settings take precedence.
ARGUMENTS_JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # `parameters` absent

ToolChoiceMode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class FunctionSpec:
    """One tool: the function's name and the JSON schema of its arguments (an object)."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" + 24 random hex digits
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedToolCalls:
    """An output that holds tool calls: the message's content beside them (None when empty) and the calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class ToolCallSetup:
    """What a chat request's tools ask of the server (tool_choice "none" has no setup: no tools, no parsing).

    mode: "auto" (free output, parsed afterwards), "required" (at least one call to any tool), "named" (one call to
    `functions[0]`, the function tool_choice names). multiple: several calls allowed ("required" with
    parallel_tool_calls); "named" always makes exactly one call.
    """

    tools: tuple[dict[str, Any], ...]  # the request's tools, as the chat template receives them
    functions: tuple[FunctionSpec, ...]  # all the tools' functions (named: only the chosen one)
    tool_names: frozenset[str]  # every tool's name (what the parser accepts)
    mode: ToolChoiceMode
    multiple: bool

    def guided(self, tags_are_tokens: bool) -> GuidedDecoding | None:
        """The constraint on the output: None for "auto", else the tool-call grammar."""
        if self.mode == "auto":
            return None
        return tool_call_grammar(self.functions, self.multiple and self.mode == "required", tags_are_tokens)

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.tool_names)


# ---- parsing ----------------------------------------------------------------------------------------------


class ToolCallParser:
    """Finds the tool calls in a finished output (see the module docstring for the rules)."""

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.tool_names = tool_names

    def parse(self, text: str, finish_reason: str | None) -> ParsedToolCalls | None:
        """The calls and the content beside them; None when the output holds no well-formed call to a known tool
        or did not end naturally (the text then stays content)."""
        if finish_reason != "stop":
            return None
        if TOOL_CALL_OPEN not in text:
            bare = self._call(text) if text.lstrip().startswith("{") else None
            return None if bare is None else ParsedToolCalls(None, (bare,))
        calls: list[ToolCall] = []
        pieces: list[str] = []
        position = 0
        for block in _BLOCK.finditer(text):
            call = self._call(block.group(1))
            if call is None:
                return None
            piece = text[position:block.start()]
            pieces.append(piece.rstrip() if not calls else piece.strip())
            calls.append(call)
            position = block.end()
        pieces.append(text[position:].strip())
        content = "\n".join(piece for piece in pieces if piece)
        return ParsedToolCalls(content or None, tuple(calls))

    def _call(self, block: str) -> ToolCall | None:
        try:
            value = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.tool_names:
            return None
        arguments = value.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# ---- streaming --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FinalDelta:
    """The last stream chunk's delta: the content not streamed yet, the calls (None: none) and the finish reason."""

    content: str
    tool_calls: tuple[ToolCall, ...] | None
    finish_reason: str | None


class ToolCallStream:
    """Content deltas of a streamed answer that may turn into tool calls.

    Text is streamed as content until a `<tool_call>` tag begins; from there on it is held back, as are a trailing
    partial tag (`<tool`), trailing whitespace (which the content drops before a call), and an output that
    begins with "{" (it may be a call without tags), all of it. At the end, `finish`
    gives what is left: the rest of the parsed content and the calls in one delta, or, when there is no
    well-formed call, the held-back text as content. The streamed content deltas joined equal the non-streamed
    message's content.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.emitted = 0  # characters of the text streamed as content

    def content_delta(self, text: str) -> str:
        """The content that the text so far lets out (text: everything generated so far)."""
        limit = _streamable_length(text)
        if limit <= self.emitted:
            return ""
        delta = text[self.emitted:limit]
        self.emitted = limit
        return delta

    def finish(self, text: str, finish_reason: str | None) -> FinalDelta:
        parsed = self.parser.parse(text, finish_reason)
        streamed = text[: self.emitted]
        if parsed is None or not (parsed.content or "").startswith(streamed):
            return FinalDelta(text[self.emitted:], None, finish_reason)
        return FinalDelta((parsed.content or "")[self.emitted:], parsed.tool_calls, "tool_calls")


def _streamable_length(text: str) -> int:
    """How much of text can be streamed as content: up to a tag (or the start of a partial one at the end),
    without the whitespace just before it; nothing of an output that begins with "{"."""
    if text.lstrip().startswith("{"):
        return 0
    limit = text.find(TOOL_CALL_OPEN)
    if limit < 0:
        limit = len(text)
        for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
            if text.endswith(TOOL_CALL_OPEN[:size]):
                limit -= size
                break
    return len(text[:limit].rstrip())


# ---- the constraint -----------------------------------------------------------------------------------------


def tags_are_tokens(tokenizer: Tokenizer) -> bool:
    """Whether `<tool_call>` and `</tool_call>` are added tokens of the tokenizer (Qwen2.5's are): llguidance sees
    added tokens as special, so the grammar must name them as tokens; otherwise they are text."""
    added = {token.content for token in tokenizer.backend.get_added_tokens_decoder().values()}
    return TOOL_CALL_OPEN in added and TOOL_CALL_CLOSE in added


def tool_call_grammar(functions: Sequence[FunctionSpec], multiple: bool, tags_are_tokens: bool) -> GuidedDecoding:
    """A Lark grammar (llguidance's dialect) whose only outputs are tool calls in the Qwen2.5 format: one call (or,
    with multiple, one or more separated by newlines) to one of the functions, its arguments JSON matching the
    function's parameters schema, written with ", " and ": " separators:

        <tool_call>\\n{"name": "<name>", "arguments": <arguments JSON>}\\n</tool_call>
    """
    if not functions:
        raise ValueError("a tool-call grammar needs at least one function")
    open_tag, close_tag = ((TOOL_CALL_OPEN, TOOL_CALL_CLOSE) if tags_are_tokens
                           else (json.dumps(TOOL_CALL_OPEN), json.dumps(TOOL_CALL_CLOSE)))
    alternatives = " | ".join(f"function_{i}" for i in range(len(functions)))
    lines = [
        'start: call ("\\n" call)*' if multiple else "start: call",
        f'call: {open_tag} "\\n" ({alternatives}) "\\n" {close_tag}',
    ]
    for i, function in enumerate(functions):
        head = json.dumps(f'{{"name": {json.dumps(function.name)}, "arguments": ')
        lines.append(f'function_{i}: {head} arguments_{i} "}}"')
        lines.append(f"arguments_{i}: %json {json.dumps(arguments_schema(function.parameters))}")
    return GuidedDecoding(lark="\n".join(lines))


def arguments_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """The parameters schema as the arguments' constraint: an object (OpenAI's parameters describe one), written in
    the format of ARGUMENTS_JSON_FORMAT unless the schema sets its own x-guidance."""
    own = parameters.get("x-guidance", {})
    return {"type": "object", **parameters,
            "x-guidance": {**ARGUMENTS_JSON_FORMAT, **own} if isinstance(own, dict) else own}


def arguments_schema_error(parameters: dict[str, Any]) -> str:
    """Why llguidance cannot constrain arguments to this parameters schema ('' when it can), checked without a
    tokenizer: a schema feature it lacks, an unsatisfiable schema, a $ref that points nowhere."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(arguments_schema(parameters)))
    except ValueError as error:
        return str(error)
    return llguidance.LLMatcher.validate_grammar(grammar, None)
