"""The OpenAPI 3.1 document of the HTTP API, served at GET /openapi.json and fuzzed by the tests (schemathesis).

Request bodies come from the pydantic models in protocol.py, so the document and the parser cannot drift apart;
`model` is narrowed to the served id. Responses name every status a route can answer with: the error statuses
all carry the OpenAI error body. Success bodies are described by their top-level keys only.
"""
from __future__ import annotations

from typing import Any

from specdec.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestLimits,
                                     TokenizeChatRequest, TokenizeCompletionRequest)

ERROR_BODY = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
ERROR_STATUSES = {  # status -> when (every one answers with ERROR_BODY)
    "400": "a malformed or out-of-range field, an unknown model, a prompt over a limit or the context",
    "401": "an API key is set and the request does not carry it",
    "413": "the body is larger than the server's limit",
    "415": "the Content-Type is not application/json",
    "500": "the engine failed while running the request",
    "503": "the server is at capacity, stopping, or its engine has failed or stalled (Retry-After: 1)",
    "504": "the request did not finish within the server's request timeout",
}
TOOLS_NOTE = ("Tools: `tools`, `tool_choice` and `parallel_tool_calls` as OpenAI; calls are parsed from the Qwen2.5 "
              "/ Hermes format (`<tool_call>\\n{\"name\": ..., \"arguments\": {...}}\\n</tool_call>`) into "
              "message.tool_calls (finish_reason 'tool_calls'); with tool_choice 'required' or a named function the "
              "output is constrained by a grammar to such calls, arguments matching the parameters schema, under "
              "speculation as in plain decoding. Streamed, content stops where a call begins and the calls come "
              "whole in the last chunk. ")
COMPLETION_RESPONSE = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"]}


def openapi_document(model_name: str, limits: RequestLimits) -> dict[str, Any]:
    components: dict[str, Any] = {"Error": ERROR_BODY}
    completion = _request_schema(CompletionRequest, model_name, components)
    chat = _request_schema(ChatCompletionRequest, model_name, components)
    tokenize = {"oneOf": [_request_schema(TokenizeCompletionRequest, model_name, components),
                          _request_schema(TokenizeChatRequest, model_name, components)]}
    detokenize = _request_schema(DetokenizeRequest, model_name, components)
    body_note = (f"Bodies over {limits.max_body_bytes} bytes get 413; prompts over {limits.max_prompt_chars} "
                 f"characters, more than {limits.max_stop_strings} stop strings or a stop string over "
                 f"{limits.max_stop_chars} characters get 400.")
    return {
        "openapi": "3.1.0",
        "info": {"title": "specdec", "version": "0.1.0",
                 "description": "OpenAI-compatible completions and chat completions with speculative decoding."},
        "paths": {
            "/v1/completions": {"post": _generation("Text completion of one prompt. " + body_note, completion)},
            "/v1/chat/completions": {"post": _generation("Chat completion with the model's chat template. "
                                                         + TOOLS_NOTE + body_note, chat)},
            "/tokenize": {"post": _post("Token ids of a prompt, or of messages rendered with the chat template "
                                        "(vLLM's shape).", tokenize,
                                        {"type": "object", "required": ["tokens", "count", "max_model_len"]})},
            "/detokenize": {"post": _post("The text of token ids (vLLM's shape).", detokenize,
                                          {"type": "object", "required": ["prompt"]})},
            "/v1/models": {"get": _get("The served model.", {"type": "object", "required": ["object", "data"]},
                                       ["401"])},
            "/v1/specdec/info": {"get": _get("Speculation settings and the kernel path.", {"type": "object"},
                                             ["401"])},
            "/health": {"get": _get("ok while the engine thread runs, steps and is not stalled; else 503 with the "
                                    "reason", {"type": "object", "required": ["status"]}, ["503"])},
            "/status": {"get": _get("Running and waiting requests, slots, health, speculation counters.",
                                    {"type": "object"}, [])},
            "/metrics": {"get": {"summary": "Prometheus metrics (text format 0.0.4).",
                                 "responses": {"200": {"description": "metrics",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": _get("This document.", {"type": "object"}, [])},
        },
        "components": {"schemas": components},
    }


def _request_schema(model_cls, model_name: str, components: dict[str, Any]) -> dict[str, Any]:
    schema = model_cls.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    model = {"type": "string", "enum": [model_name], "description": "the served model id"}
    schema["properties"]["model"] = (
        model if "model" in schema.get("required", []) else {"anyOf": [model, {"type": "null"}]}
    )
    components[model_cls.__name__] = schema
    return {"$ref": f"#/components/schemas/{model_cls.__name__}"}


def _error_responses(statuses: list[str]) -> dict[str, Any]:
    return {status: {"description": ERROR_STATUSES[status],
                     "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for status in statuses}


def _generation(summary: str, body_schema: dict[str, Any]) -> dict[str, Any]:
    ok = {"description": "the answer: a JSON body, or server-sent events with `stream: true`",
          "content": {"application/json": {"schema": COMPLETION_RESPONSE},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    return {"summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body_schema}}},
            "responses": {"200": ok, **_error_responses(list(ERROR_STATUSES))}}


def _post(summary: str, body_schema: dict[str, Any], ok_schema: dict[str, Any]) -> dict[str, Any]:
    ok = {"description": summary, "content": {"application/json": {"schema": ok_schema}}}
    return {"summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body_schema}}},
            "responses": {"200": ok, **_error_responses(["400", "401", "413", "415"])}}


def _get(summary: str, body_schema: dict[str, Any], error_statuses: list[str]) -> dict[str, Any]:
    ok = {"description": summary, "content": {"application/json": {"schema": body_schema}}}
    return {"summary": summary, "responses": {"200": ok, **_error_responses(error_statuses)}}
