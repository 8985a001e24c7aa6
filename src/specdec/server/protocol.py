"""OpenAI-compatible request bodies, their validation, and the error bodies the server answers with.

Requests are parsed strictly (no "5" -> 5 coercion, no true -> 1): a malformed field is a 400 naming the
field (`param`), never a 5xx. No field is silently ignored: one the request models below do not declare is a
400 naming it (`unsupported_parameter` for the OpenAI fields we do not implement, the deprecated `functions`
and `function_call`; `unknown_parameter` for any other), except `user` and `metadata`, which are accepted
and ignored as OpenAI itself does. Fields we implement only in part are accepted when harmless (n=1, echo=false).

Penalties and biases (verify/penalties.py, exact under speculation): `presence_penalty`, `frequency_penalty`,
`logit_bias` (token id strings -> bias in [-100, 100]) as OpenAI; `repetition_penalty`, `min_tokens`, `min_p`,
`stop_token_ids` as vLLM.

Structured output (verify/grammar.py, exact under speculation): `response_format` {"type": "text"} (no
constraint), {"type": "json_object"} (one JSON object) or {"type": "json_schema", "json_schema": {"name", "schema",
"description"?, "strict"?}} (JSON matching the schema), as OpenAI; the output is constrained whether or not
`strict` is set.

Tool calls (server/tool_calls.py): `tools` (function tools: name, description?, parameters?, strict?),
`tool_choice` ("none" | "auto" | "required" | {"type": "function", "function": {"name"}}) and
`parallel_tool_calls`, as OpenAI; assistant messages with `tool_calls` and `role: "tool"` messages with
`tool_call_id` go to the chat template. The deprecated `functions` / `function_call` are refused.

Extensions (as vLLM): `top_k`, `ignore_eos`, `speculative` (false = decode this request without drafts),
`return_token_ids` (each choice/chunk carries the generated token ids), `return_token_kinds` (each choice/chunk
also carries per-token provenance: `token_kinds`, `draft_positions`, `token_texts`; see responses.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from specdec.config import GuidedDecoding, SamplingParams
from specdec.server.tool_calls import EMPTY_PARAMETERS, FunctionSpec, ToolCallSetup, arguments_schema_error

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class RequestLimits:
    """What one request may carry. A request past a limit is refused with a precise error before it costs the
    server more than reading up to the limit: 413 for the body, 400 for the prompt and the stop strings."""

    max_body_bytes: int = 4 * 2**20  # body bytes, counted while the body is read (and from Content-Length)
    max_prompt_chars: int = 1_000_000  # characters of a prompt string, or of all chat messages' text together
    max_stop_strings: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters of one stop string

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "max_stop_strings", "max_stop_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}  # extra response headers (503s also get Retry-After)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# OpenAI request fields we do not implement (a 400 naming the field, code "unsupported_parameter"), with why
UNSUPPORTED_FIELDS = {
    "functions": "function calls (functions, deprecated by OpenAI) are not implemented; use tools",
    "function_call": "function calls (function_call, deprecated by OpenAI) are not implemented; use tool_choice",
}
IGNORED_FIELDS = ("user", "metadata")  # accepted and ignored, as OpenAI does


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")  # OpenAI's `schema`; {} = any JSON
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def guided(self) -> GuidedDecoding | None:
        """The constraint the format asks for (None for text); a 400 naming the field when it is inconsistent."""
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise bad_request(f"response_format.json_schema is only for type 'json_schema', got type "
                                  f"{self.type!r}", "response_format.json_schema")
            return GuidedDecoding(json_object=True) if self.type == "json_object" else None
        if self.json_schema is None:
            raise bad_request("response_format of type 'json_schema' needs json_schema: {'name', 'schema'}",
                              "response_format.json_schema", "missing_required_parameter")
        return GuidedDecoding(json_schema=self.json_schema.json_schema)


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for function names


class FunctionDefinition(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the arguments' JSON schema (an object); absent = no arguments
    strict: bool | None = None  # accepted; a call is constrained to the schema only when tool_choice forces it

    def spec(self, param: str) -> FunctionSpec:
        """The function as the parser and the grammar see it; a 400 naming param when parameters is no schema of
        an object (checked against JSON Schema draft 2020-12)."""
        if self.parameters is None:
            return FunctionSpec(self.name, EMPTY_PARAMETERS)
        try:
            Draft202012Validator.check_schema(self.parameters)
        except SchemaError as error:
            path = "".join(f"[{part!r}]" for part in error.path)
            raise bad_request(f"{param} is not a valid JSON schema: {error.message} (at parameters{path})",
                              param) from None
        if self.parameters.get("type", "object") != "object":
            raise bad_request(f"{param} must describe a JSON object (type 'object'), got type "
                              f"{self.parameters['type']!r}", param)
        return FunctionSpec(self.name, self.parameters)


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


# An object is a named function, anything else a mode: each gets its own branch's error (tags never in a param)
ToolChoice = Annotated[Union[Annotated[Literal["none", "auto", "required"], Tag("mode")],
                             Annotated[NamedToolChoice, Tag("named")]],
                       Discriminator(lambda value: "named" if isinstance(value, (dict, NamedToolChoice)) else "mode")]


class MessageToolCallFunction(_Strict):
    name: str
    arguments: str  # a JSON object, as text


class MessageToolCall(_Strict):
    """A call in an assistant message sent back (what a response's tool_calls held)."""

    id: str
    type: Literal["function"]
    function: MessageToolCallFunction

    def template_call(self, param: str) -> dict[str, Any]:
        """The call as chat templates receive it (transformers' shape): the arguments as a dict."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError as error:
            raise bad_request(f"{param} is not JSON: {error}", param) from None
        if not isinstance(arguments, dict):
            raise bad_request(f"{param} must be a JSON object, got {type(arguments).__name__}", param)
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


class _CommonRequest(_Strict):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # 0 (and -1, as vLLM) = off
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)] = 1.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    ignore_eos: bool = False
    speculative: bool = True
    return_token_ids: bool = False
    return_token_kinds: bool = False

    def stop_strings(self, limits: RequestLimits) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > limits.max_stop_strings:
            raise bad_request(f"at most {limits.max_stop_strings} stop strings, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise bad_request("stop strings must be non-empty", "stop")
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_chars:
            raise bad_request(f"a stop string may have at most {limits.max_stop_chars} characters, got {longest}",
                              "stop", "stop_too_long")
        return tuple(stops)

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias's token id strings as ints; a key that is not a token id is a 400 naming logit_bias."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise bad_request(f"logit_bias keys must be token ids (decimal strings), got {key!r}", "logit_bias")
            pairs.append((int(key), float(bias)))
        return tuple(pairs)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_limits(self, limits: RequestLimits) -> None:
        """The cheap checks of the limits, run before the prompt is rendered or tokenized."""
        self.stop_strings(limits)
        self.check_prompt_length(limits)

    def check_prompt_length(self, limits: RequestLimits) -> None:
        raise NotImplementedError


Prompt = Union[str, Annotated[list[int], Field(min_length=1)], Annotated[list[str], Field(min_length=1, max_length=1)],
               Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=1)]]


class CompletionRequest(_CommonRequest):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1] | None = None

    def single_prompt(self) -> str | list[int]:
        """Only one prompt per request (a one-element batch is unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        return prompt

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def check_prompt_length(self, limits: RequestLimits) -> None:
        """A 400 for a prompt string longer than the limit, before it is tokenized."""
        prompt = self.single_prompt()
        if isinstance(prompt, str) and len(prompt) > limits.max_prompt_chars:
            raise prompt_too_long(len(prompt), limits, "prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages only (required there)

    def template_message(self, index: int) -> dict[str, Any]:
        """The message as the chat template receives it: role, content (text), and the tool fields it carries."""
        message: dict[str, Any] = {"role": self.role, "content": self.text_content()}
        param = f"messages.{index}"
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            if self.role != "assistant":
                raise bad_request(f"only assistant messages carry tool_calls, not {self.role!r} ones",
                                  f"{param}.tool_calls")
            message["tool_calls"] = [call.template_call(f"{param}.tool_calls.{i}.function.arguments")
                                     for i, call in enumerate(self.tool_calls)]
        if self.role == "tool":
            if self.tool_call_id is None:
                raise bad_request("a tool message needs tool_call_id (the id of the call it answers)",
                                  f"{param}.tool_call_id", "missing_required_parameter")
            message["tool_call_id"] = self.tool_call_id
        elif self.tool_call_id is not None:
            raise bad_request(f"only tool messages carry tool_call_id, not {self.role!r} ones", f"{param}.tool_call_id")
        return message

    def text_length(self) -> int:
        """Characters of the message's text: content and its calls' arguments."""
        return len(self.text_content()) + sum(len(call.function.arguments) for call in self.tool_calls or ())

    def text_content(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts ({'type': 'text', 'text': ...}) are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class _ChatMessages:
    """What the chat requests (chat completions, /tokenize with messages) do with their `messages`."""

    messages: list[ChatMessage]
    tools: list[Tool] | None

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.template_message(i) for i, message in enumerate(self.messages)]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them (as the client sent them); None: none to render."""
        return None if self.tools is None else [tool.model_dump(exclude_unset=True) for tool in self.tools]

    def check_prompt_length(self, limits: RequestLimits) -> None:
        """A 400 when the messages' text and the tools together are longer than the limit, before the template
        renders them."""
        self.template_messages()  # the 400s of malformed messages come first
        total = sum(message.text_length() for message in self.messages)
        total += sum(len(json.dumps(tool)) for tool in self.template_tools() or ())
        if total > limits.max_prompt_chars:
            raise prompt_too_long(total, limits, "messages")


class ChatCompletionRequest(_ChatMessages, _CommonRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = Field(None, description=(
        "function tools, rendered into the prompt by the model's chat template (a template that ignores them is a "
        "400 tools_not_supported); calls in the output (Qwen2.5 / Hermes `<tool_call>` format) come back as "
        "message.tool_calls with finish_reason 'tool_calls'"))
    tool_choice: ToolChoice | None = Field(None, description=(
        "'auto' (the default with tools): the output is free and parsed for calls; 'required': constrained to one "
        "or more calls (one with parallel_tool_calls false) to any tool, the arguments matching its parameters "
        "schema; a named function: constrained to one call to it; 'none': the tools are not rendered, no parsing"))
    parallel_tool_calls: bool | None = Field(None, description=(
        "false: tool_choice 'required' makes exactly one call (default: one or more)"))

    def template_tools(self) -> list[dict[str, Any]] | None:
        """tool_choice "none" renders no tools (the model is not told about them, as vLLM by default)."""
        return None if self.tool_choice == "none" else super().template_tools()

    def tool_setup(self) -> ToolCallSetup | None:
        """What the tools ask for (None: no tools, or tool_choice "none"); a 400 naming the field when the tools,
        the choice or their combination with response_format is wrong."""
        choice = self.tool_choice
        if self.tools is None:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None
        functions = [tool.function.spec(f"tools.{i}.function.parameters") for i, tool in enumerate(self.tools)]
        names = [function.name for function in functions]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise bad_request(f"tool names must be unique, got {', '.join(map(repr, duplicates))} more than once",
                              "tools")
        if choice == "none":
            return None
        if self.response_format is not None and self.response_format.type != "text":
            raise bad_request("response_format constrains the whole output, so it cannot be combined with tools "
                              "unless tool_choice is 'none'", "response_format")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among "
                                  f"the tools ({', '.join(map(repr, names))})", "tool_choice.function.name")
            chosen = [functions[names.index(choice.function.name)]]
            mode = "named"
        else:
            chosen, mode = functions, choice or "auto"
        if mode != "auto":  # the arguments will be constrained: the grammar engine must accept the schemas
            for function in chosen:
                param = f"tools.{names.index(function.name)}.function.parameters"
                error = arguments_schema_error(function.parameters)
                if error:
                    raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} "
                                      f"constrains the arguments to {param}, which the grammar engine cannot "
                                      f"enforce: {error}", param)
        return ToolCallSetup(tuple(self.template_tools()), tuple(chosen), frozenset(names), mode,
                             self.parallel_tool_calls is not False)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize with a prompt (vLLM's shape): the prompt's token ids."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True

    def check_prompt_length(self, limits: RequestLimits) -> None:
        if len(self.prompt) > limits.max_prompt_chars:
            raise prompt_too_long(len(self.prompt), limits, "prompt")


class TokenizeChatRequest(_ChatMessages, _Strict):
    """POST /tokenize with messages (vLLM's shape): the chat template's rendering, encoded."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None  # rendered by the template
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's shape): the text of token ids."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def prompt_too_long(num_chars: int, limits: RequestLimits, param: str) -> APIError:
    return bad_request(f"the prompt has {num_chars} characters; this server accepts at most {limits.max_prompt_chars} "
                       "(--max-prompt-chars)", param, "prompt_too_long")


def parse_tokenize_request(raw: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """POST /tokenize's body: a chat request when it carries messages, else a prompt request."""
    try:
        carries_messages = isinstance(data := json.loads(raw), dict) and "messages" in data
    except (json.JSONDecodeError, UnicodeDecodeError):
        carries_messages = False  # parse_request answers the 400
    return parse_request(raw, TokenizeChatRequest if carries_messages else TokenizeCompletionRequest)


def parse_request(raw: bytes, model_cls: type[BaseModel]) -> Any:
    """Body bytes -> a validated request, or a 400 APIError naming the first offending field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"malformed JSON body: {error}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    check_fields(data, model_cls)
    try:
        return model_cls.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = _param_path(data, first["loc"], first["type"] == "missing")
        raise bad_request(
            f"invalid value for {param}: {first['msg']}",
            param=param,
            code="missing_required_parameter" if first["type"] == "missing" else "invalid_value",
        ) from None


def check_fields(data: dict[str, Any], model_cls: type[BaseModel]) -> None:
    """A 400 naming the first field of the body that the request model does not declare."""
    for name in data:
        if name in model_cls.model_fields:
            continue
        if name in UNSUPPORTED_FIELDS:
            raise bad_request(f"{UNSUPPORTED_FIELDS[name]}; remove {name!r} from the request", name,
                              "unsupported_parameter")
        raise bad_request(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")


def _param_path(data: Any, loc: tuple, missing: bool) -> str | None:
    """The error location as the client wrote it ('messages.0.role'), without pydantic's union-member tags."""
    parts, current = [], data
    for part in loc:
        if (
            isinstance(current, dict)
            and part in current
            or isinstance(current, list)
            and isinstance(part, int)
            and 0 <= part < len(current)
        ):
            parts.append(str(part))
            current = current[part]
    if missing and loc and (not parts or parts[-1] != str(loc[-1])):
        parts.append(str(loc[-1]))
    return ".".join(parts) or None


def sampling_params(request: _CommonRequest, max_tokens: int, num_logprobs: int | None,
                    limits: RequestLimits, vocab_size: int | None = None,
                    tool_guided: GuidedDecoding | None = None) -> SamplingParams:
    """The request's SamplingParams; vocab_size: token ids in logit_bias / stop_token_ids must be below it;
    tool_guided: the tool-call constraint (ToolCallSetup.guided), used instead of response_format's (which
    tool_setup refuses beside it)."""
    top_k = 0 if request.top_k == -1 else request.top_k
    seed = None if request.seed is None else request.seed % 2**63  # torch seeds are 64-bit
    logit_bias = request.logit_bias_pairs()
    stop_token_ids = tuple(request.stop_token_ids or ())
    if vocab_size is not None:
        for param, ids in (
            ("logit_bias", [token_id for token_id, _ in logit_bias]),
            ("stop_token_ids", stop_token_ids),
        ):
            bad = [token_id for token_id in ids if token_id >= vocab_size]
            if bad:
                raise bad_request(f"{param} names token ids out of range [0, {vocab_size}): {bad[:5]}", param)
    if request.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({request.min_tokens}) must be at most max_tokens ({max_tokens})",
                          "min_tokens")
    try:
        return SamplingParams(temperature=float(request.temperature), top_k=top_k, top_p=float(request.top_p),
                              seed=seed, max_tokens=max_tokens, stop=request.stop_strings(limits),
                              ignore_eos=request.ignore_eos, logprobs=num_logprobs,
                              presence_penalty=float(request.presence_penalty),
                              frequency_penalty=float(request.frequency_penalty),
                              repetition_penalty=float(request.repetition_penalty), logit_bias=logit_bias,
                              min_tokens=request.min_tokens, min_p=float(request.min_p),
                              stop_token_ids=stop_token_ids,
                              guided=tool_guided or (request.response_format.guided()
                                                     if request.response_format else None))
    except ValueError as error:
        raise bad_request(str(error)) from None


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """Defaults to the rest of the context; a request that cannot fit is a 400 with both lengths (as vLLM)."""
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_len} tokens; at least one token must remain for the completion.",
            "prompt", "context_length_exceeded")
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion).",
            "max_tokens", "context_length_exceeded")
    return requested
