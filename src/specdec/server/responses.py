"""OpenAI response bodies and stream chunks built from StepOutputs (one builder per request).

Completions:  choices[0].text, logprobs {tokens, token_logprobs, top_logprobs, text_offset}
Chat:         choices[0].message.content / delta.content, logprobs {content: [{token, logprob, bytes, top_logprobs}]}
              With tools (server/tool_calls.py): message.tool_calls and finish_reason "tool_calls" when the output
              holds well-formed calls; streamed, the content stops at a `<tool_call>` tag and the calls come whole
              in the last chunk's delta.tool_calls (each with its index).
Text comes from StepOutput.new_text (UTF-8 safe, stop-string aware), so the concatenated stream equals the
non-streamed text; logprobs come from StepOutput.new_logprobs (the target's raw distribution).

Provenance (`return_token_kinds: true`; absent otherwise, so OpenAI clients see nothing new), per token:
  token_kinds      "target" (plain decode / prefill), "accepted" (a draft token the target accepted),
                   "recovered" (the target's token at the first rejected draft position), "bonus" (the
                   target's extra token after a fully accepted draft)
  draft_positions  1-based slot in the step's draft: accepted tokens 1..a, the recovered token a + 1 (the
                   slot it replaced), the bonus token k + 1; null for "target" tokens
  token_texts      each token decoded alone (as logprobs' token strings): a character split over tokens
                   shows as U+FFFD there, while `text` / `content` stays exact
"""
from __future__ import annotations

import abc
import json
import math
import time
from typing import Any

from specdec.engine.engine import StepOutput, TokenLogprob
from specdec.engine.sequence import TokenKind
from specdec.models.tokenizer import Tokenizer
from specdec.server.tool_calls import ToolCallParser, ToolCallStream

MIN_LOGPROB = -9999.0  # JSON has no -inf


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


def _finite(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def draft_positions(step_kinds) -> list[int | None]:
    """One step's token kinds -> each token's 1-based draft slot (None for target-only tokens)."""
    return [None if kind == TokenKind.TARGET else i + 1 for i, kind in enumerate(step_kinds)]


class ResponseBuilder(abc.ABC):
    """Accumulates one request's outputs; renders stream chunks and the final body."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, tokenizer: Tokenizer, prompt_tokens: int,
                 return_token_ids: bool, return_token_kinds: bool = False) -> None:
        self.request_id = request_id
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_tokens = prompt_tokens
        self.return_token_ids = return_token_ids
        self.return_token_kinds = return_token_kinds
        self.created = int(time.time())
        self.text = ""
        self.token_ids: list[int] = []
        self.token_kinds: list[str] = []
        self.draft_positions: list[int | None] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # prompt tokens the prefix cache supplied

    # ---- shared ----------------------------------------------------------------------------------------
    def add(self, output: StepOutput) -> None:
        self.text += output.new_text
        self.token_ids.extend(output.new_token_ids)
        self.token_kinds.extend(kind.value for kind in output.new_token_kinds)
        self.draft_positions.extend(draft_positions(output.new_token_kinds))
        if output.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(output.new_logprobs)
        self.finish_reason = output.finish_reason
        if output.cached_prompt_tokens is not None:
            self.cached_tokens = output.cached_prompt_tokens

    def usage(self) -> dict[str, Any]:
        completion = len(self.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def _with_extensions(self, choice: dict[str, Any], token_ids, kinds, positions) -> dict[str, Any]:
        """Adds the requested extensions (token ids; provenance) for these tokens."""
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        if self.return_token_kinds:
            choice["token_kinds"] = list(kinds)
            choice["draft_positions"] = list(positions)
            choice["token_texts"] = [self.token_text(token_id) for token_id in token_ids]
        return choice

    def _with_step_extensions(self, choice: dict[str, Any], output: StepOutput) -> dict[str, Any]:
        return self._with_extensions(choice, output.new_token_ids, [kind.value for kind in output.new_token_kinds],
                                     draft_positions(output.new_token_kinds))

    def _with_all_extensions(self, choice: dict[str, Any]) -> dict[str, Any]:
        return self._with_extensions(choice, self.token_ids, self.token_kinds, self.draft_positions)

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name, []), "usage": self.usage()}

    def start_chunks(self) -> list[dict[str, Any]]:
        return []

    @abc.abstractmethod
    def chunk(self, output: StepOutput) -> dict[str, Any]:
        """The stream chunk for one step's output (also accumulates it)."""

    @abc.abstractmethod
    def response(self) -> dict[str, Any]:
        """The non-streamed body from everything added."""


class CompletionBuilder(ResponseBuilder):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._text_offset = 0

    def _logprobs(self, logprobs) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        tokens, offsets = [], []
        for entry in logprobs:
            tokens.append(self.token_text(entry.token_id))
            offsets.append(self._text_offset)
            self._text_offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(entry.logprob) for entry in logprobs],
            "top_logprobs": [{self.token_text(t): _finite(v) for t, v in entry.top} for entry in logprobs],
            "text_offset": offsets,
        }

    def chunk(self, output: StepOutput) -> dict[str, Any]:
        self.add(output)
        choice = {"index": 0, "text": output.new_text, "logprobs": self._logprobs(output.new_logprobs),
                  "finish_reason": output.finish_reason}
        return self._envelope(self.chunk_object_name, [self._with_step_extensions(choice, output)])

    def response(self) -> dict[str, Any]:
        self._text_offset = 0
        choice = {"index": 0, "text": self.text, "logprobs": self._logprobs(self.logprobs),
                  "finish_reason": self.finish_reason}
        return {**self._envelope(self.object_name, [self._with_all_extensions(choice)]),
                "usage": self.usage()}


class ChatBuilder(ResponseBuilder):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, tool_parser: ToolCallParser | None = None, **kwargs) -> None:
        """tool_parser: the request's tools (None: no tools, or tool_choice "none": the text is all content)."""
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser
        self.tool_stream = ToolCallStream(tool_parser) if tool_parser else None

    def _logprobs(self, logprobs) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        return {"content": [
            {**self._entry(entry.token_id, entry.logprob),
             "top_logprobs": [self._entry(token_id, value) for token_id, value in entry.top]}
            for entry in logprobs
        ]}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def start_chunks(self) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self._envelope(self.chunk_object_name, [choice])]

    def chunk(self, output: StepOutput) -> dict[str, Any]:
        self.add(output)
        content, finish_reason, tool_calls = output.new_text, output.finish_reason, None
        if self.tool_stream is not None:
            if output.finished:
                final = self.tool_stream.finish(self.text, output.finish_reason)
                content, finish_reason, tool_calls = final.content, final.finish_reason, final.tool_calls
            else:
                content = self.tool_stream.content_delta(self.text)
        delta: dict[str, Any] = {"content": content} if content or not output.finished else {}
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **call.to_openai()} for i, call in enumerate(tool_calls)]
        choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(output.new_logprobs),
                  "finish_reason": finish_reason}
        return self._envelope(self.chunk_object_name, [self._with_step_extensions(choice, output)])

    def response(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        finish_reason = self.finish_reason
        parsed = self.tool_parser.parse(self.text, finish_reason) if self.tool_parser else None
        if parsed is not None:
            message = {"role": "assistant", "content": parsed.content,
                       "tool_calls": [call.to_openai() for call in parsed.tool_calls]}
            finish_reason = "tool_calls"
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(self.logprobs),
                  "finish_reason": finish_reason}
        return {**self._envelope(self.object_name, [self._with_all_extensions(choice)]),
                "usage": self.usage()}
