"""Tokenizer tests: GGUF-built tokenizers against transformers' own GGUF tokenizers, streaming detokenization."""
from __future__ import annotations

import json
import os

import pytest

from specdec.models.loader import read_gguf_file
from specdec.models.tokenizer import GEMMA3_CHAT_TEMPLATE, IncrementalDetokenizer, Tokenizer
from real_models import one_gguf_reader, real_model_path
from tiny_models import write_tiny_tokenizer

REAL_TOKENIZER_MODELS = ("gemma-3-270m", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")

CORPUS = (
    "Hello world",
    " leading space and trailing space ",
    "  two spaces\tand a tab\n\nblank line\r\nwindows newline",
    "    \t\t   \n   indented\n\n\n\n",
    "日本語のテキスト、中文字符和标点。한국어 텍스트",
    "emoji 🙂👍🏽 🇫🇷 family 👨‍👩‍👧 🤖🤖🤖",
    "café naïve résumé Ångström façade Œuvre",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i]; }",
    "numbers 1234567 3.14159 -42 1e10 0x1F 2024-11-29",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhey<end_of_turn>\n<start_of_turn>model\n",
    "<|endoftext|> after end",
    "don't I'll WE'RE they've",
    "non\u00a0breaking and zero\u200bwidth",
    "<table><tr><td>1</td></tr></table>",
    "",
    " ",
    "\n",
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 🙂"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def tokenizer_pair(request):
    """(ours, transformers') for one real GGUF, cached per model."""
    cache = {}

    def get(name: str):
        if name not in cache:
            path = real_model_path(name)
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from transformers import AutoTokenizer

            with one_gguf_reader():
                reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            cache[name] = (Tokenizer.from_gguf(read_gguf_file(path).metadata), reference)
        return cache[name]

    return get


@pytest.mark.real
@pytest.mark.parametrize("name", REAL_TOKENIZER_MODELS)
def test_encode_decode_match_transformers(tokenizer_pair, name: str) -> None:
    ours, reference = tokenizer_pair(name)
    for text in CORPUS:
        expected = reference.encode(text, add_special_tokens=True)
        assert ours.encode(text) == expected, text
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(expected) == reference.decode(expected), text
        assert ours.decode(expected, skip_special_tokens=True) == reference.decode(
            expected, skip_special_tokens=True), text
    assert ours.vocab_size == len(reference)
    assert ours.bos_token_id == reference.bos_token_id
    assert reference.eos_token_id in ours.eos_token_ids


@pytest.mark.real
@pytest.mark.parametrize("name", REAL_TOKENIZER_MODELS)
def test_token_id_round_trip(tokenizer_pair, name: str) -> None:
    ours, reference = tokenizer_pair(name)
    for token_id in (0, 1, 2, 100, 1000, ours.vocab_size // 2, ours.vocab_size - 1):
        token = ours.id_to_token(token_id)
        assert token == reference.convert_ids_to_tokens(token_id)
        assert ours.token_to_id(token) == token_id


@pytest.mark.real
@pytest.mark.parametrize("name", ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"))
def test_chat_template_matches_transformers(tokenizer_pair, name: str) -> None:
    ours, reference = tokenizer_pair(name)
    for messages in (MESSAGES, MESSAGES[1:2]):
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_MESSAGES = [  # a call and its answer, in transformers' shape (the call's arguments as a dict)
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


@pytest.mark.real
def test_chat_template_with_tools_matches_transformers(tokenizer_pair) -> None:
    """Qwen2.5's template renders the tools (<tools></tools>), past calls (<tool_call>) and tool answers
    (<tool_response>) exactly as transformers' apply_chat_template does."""
    ours, reference = tokenizer_pair("qwen2.5-coder-0.5b-instruct")
    for messages in (MESSAGES, TOOL_MESSAGES):
        expected = reference.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False,
                                                 add_generation_prompt=True)
        rendered = ours.apply_chat_template(messages, tools=[WEATHER_TOOL])
        assert rendered == expected
        assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in rendered


@pytest.mark.real
def test_real_special_tokens() -> None:
    gemma = Tokenizer.from_gguf(read_gguf_file(real_model_path("gemma-3-270m")).metadata)
    assert (gemma.bos_token_id, gemma.add_bos) == (2, True)
    assert gemma.eos_token_ids == {gemma.token_to_id("<eos>"), gemma.token_to_id("<end_of_turn>")}
    assert gemma.chat_template == GEMMA3_CHAT_TEMPLATE  # the file has none
    qwen = Tokenizer.from_gguf(read_gguf_file(real_model_path("qwen2.5-coder-0.5b-instruct")).metadata)
    assert not qwen.add_bos
    assert qwen.eos_token_ids == {qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")}
    assert qwen.encode("<|im_start|>") == [qwen.token_to_id("<|im_start|>")]
    smollm = Tokenizer.from_gguf(read_gguf_file(real_model_path("smollm2-135m-instruct")).metadata)
    assert smollm.eos_token_ids == {smollm.token_to_id("<|im_end|>"), smollm.token_to_id("<|endoftext|>")}
    # SmolLM2's pre-tokenizer splits digits one by one.
    assert len(smollm.encode("1234567")) == 7


@pytest.mark.real
def test_gemma_builtin_chat_template() -> None:
    gemma = Tokenizer.from_gguf(read_gguf_file(real_model_path("gemma-3-270m")).metadata)
    prompt = gemma.apply_chat_template(MESSAGES)
    assert prompt == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi 🙂<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ids = gemma.encode(prompt)
    assert ids[:2] == [2, gemma.token_to_id("<start_of_turn>")]  # one BOS, not two
    assert gemma.encode(prompt, add_special_tokens=False) == ids
    with pytest.raises(Exception, match="alternate"):
        gemma.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


STREAM_TEXT = "Größe: 日本語 🙂👍🏽 done — ok\n\ttab ✓ 🇫🇷"


def _stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    pieces = [detokenizer.push(token_id) for token_id in ids]
    return [*pieces, detokenizer.flush()]


@pytest.mark.real
@pytest.mark.parametrize("name", REAL_TOKENIZER_MODELS)
def test_streaming_equals_full_decode(name: str) -> None:
    tokenizer = Tokenizer.from_gguf(read_gguf_file(real_model_path(name)).metadata)
    for text in (STREAM_TEXT, *CORPUS):
        ids = tokenizer.encode(text)
        pieces = _stream(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids), text
        assert not any("\ufffd" in piece for piece in pieces), text
        assert "".join(_stream(tokenizer, ids, True)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_streaming_holds_back_split_characters(tmp_path) -> None:
    tokenizer = Tokenizer.from_hf_dir(write_tiny_tokenizer(tmp_path))  # one token per byte
    ids = tokenizer.encode(STREAM_TEXT, add_special_tokens=False)
    pieces = _stream(tokenizer, ids)
    assert "".join(pieces) == STREAM_TEXT
    assert "" in pieces  # continuation bytes of multi-byte characters produced nothing yet
    assert not any("\ufffd" in piece for piece in pieces)
    emoji_bytes = len("🙂".encode())
    start = STREAM_TEXT.index("🙂")
    prefix_tokens = len(STREAM_TEXT[:start].encode())
    assert pieces[prefix_tokens:prefix_tokens + emoji_bytes] == ["", "", "", "🙂"]


def test_flush_returns_incomplete_tail(tmp_path) -> None:
    tokenizer = Tokenizer.from_hf_dir(write_tiny_tokenizer(tmp_path))
    ids = tokenizer.encode("a🙂", add_special_tokens=False)[:3]  # "a" + 2 of the emoji's 4 bytes
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push(token_id) for token_id in ids] == ["a", "", ""]
    assert detokenizer.flush() == tokenizer.decode(ids)[1:]
    assert detokenizer.flush() == ""


def test_hf_dir_tokenizer(tmp_path) -> None:
    tokenizer = Tokenizer.from_hf_dir(write_tiny_tokenizer(tmp_path))
    assert tokenizer.bos_token_id == tokenizer.token_to_id("<bos>")
    assert tokenizer.eos_token_ids == {tokenizer.token_to_id("<eos>")}
    assert tokenizer.add_bos
    ids = tokenizer.encode("hi")
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids, skip_special_tokens=True) == "hi"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<user>x\n<assistant>"


def test_chat_template_is_sandboxed(tmp_path) -> None:
    tokenizer = Tokenizer.from_hf_dir(write_tiny_tokenizer(tmp_path))
    tokenizer.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    tokenizer.chat_template = "{{ raise_exception('bad roles') }}"
    with pytest.raises(Exception, match="bad roles"):
        tokenizer.apply_chat_template([])


def test_unsupported_gguf_tokenizer_model() -> None:
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.model 'rwkv'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.pre 'mystery'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
                             "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "mystery"})
