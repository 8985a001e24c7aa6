"""Tokenizers built from GGUF metadata or a Hugging Face directory, plus streaming detokenization.

GGUF tokenizers are rebuilt the way the original Hugging Face ``tokenizer.json`` files (and transformers' GGUF
converter) define them:

* ``gpt2`` (byte-level BPE): the vocabulary and merges from the file; the pre-tokenizer chosen by
  ``tokenizer.ggml.pre`` (``qwen2``: Qwen2's split regex and an NFC normalizer; ``smollm``: single digits then the
  GPT-2 regex; ``llama-bpe``: Llama 3's split regex; ``default``/``gpt2``: the GPT-2 regex).
* ``llama`` (SentencePiece BPE, Gemma): byte fallback, spaces become ``▁``, no prefix space. GGUF files carry no
  merges, so they are rebuilt from the vocabulary, ranked by token position as transformers does for Gemma.

Tokens the file marks CONTROL are special (split out of the text whole, dropped by ``skip_special_tokens``);
USER_DEFINED ones are matched whole but are not special.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

# llama.cpp's token types (gguf.TokenType).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Token texts that end a turn or a document besides the file's declared EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|eom_id|>")

QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Used when a file has no chat template (Gemma 3 GGUF files): the official Gemma 3 turn format, text only.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special-token facts and chat template the engine needs."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata: a ``GGUFReader.fields`` mapping or a plain ``{key: value}`` dict.

        When the file has no ``tokenizer.chat_template`` and uses Gemma's turn tokens, the built-in Gemma 3
        template (``<start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n``) is used.
        """
        meta = _GGUFTokenizerMetadata(fields)
        model = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta.require("tokenizer.ggml.tokens")
        token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if model == "gpt2":
            backend, tokens = _byte_level_bpe(tokens, meta.require("tokenizer.ggml.merges"),
                                              meta.get("tokenizer.ggml.pre", "default"))
        elif model == "llama":
            backend, tokens = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.unknown_token_id"))
        else:
            raise ValueError(f"unsupported tokenizer.ggml.model {model!r}; supported: gpt2, llama")
        _add_marked_tokens(backend, tokens, token_types)
        bos_token_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_ids = {meta.get(key) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                             "tokenizer.ggml.eom_token_id")}
        eos_ids |= {backend.token_to_id(text) for text in END_OF_TURN_TOKENS}
        chat_template = meta.get("tokenizer.chat_template")
        if chat_template is None and backend.token_to_id("<start_of_turn>") is not None:
            chat_template = GEMMA3_CHAT_TEMPLATE
        default_add_bos = model == "llama"  # llama.cpp adds BOS to SentencePiece vocabularies by default
        return cls(
            backend,
            bos_token_id=None if bos_token_id is None else int(bos_token_id),
            eos_token_ids={int(i) for i in eos_ids if i is not None},
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos_token_id is not None,
            chat_template=chat_template,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``) in a directory."""
        path = Path(path)
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        bos_text = _token_text(config.get("bos_token"))
        eos_text = _token_text(config.get("eos_token"))
        bos_token_id = backend.token_to_id(bos_text) if bos_text else None
        eos_ids = {backend.token_to_id(text) for text in (eos_text, *END_OF_TURN_TOKENS) if text}
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        eos_ids |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        chat_template = config.get("chat_template")
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text()
        if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
            chat_template = next((t["template"] for t in chat_template if t.get("name") == "default"), None)
        if chat_template is None and backend.token_to_id("<start_of_turn>") is not None:
            chat_template = GEMMA3_CHAT_TEMPLATE
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds(backend, bos_token_id)
        return cls(
            backend,
            bos_token_id=bos_token_id,
            eos_token_ids={int(i) for i in eos_ids if i is not None},
            add_bos=bool(add_bos) and bos_token_id is not None,
            chat_template=chat_template,
        )

    # ------------------------------------------------------------------ queries

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) become their ids.

        With ``add_special_tokens`` and a tokenizer that adds BOS, BOS is prepended unless the text already
        starts with it (a chat template that writes ``{{ bos_token }}``), so there is never a doubled BOS.
        The backend's batch call releases the GIL while it runs: a long prompt tokenized in a server's prompt
        thread does not stall the event loop.
        """
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    **template_kwargs: Any) -> list[int]:
        """The prompt ids of a chat: ``messages`` (and ``tools``) rendered with the chat template (with the
        generation prompt), then encoded without a second BOS. The one chat encoding of the CLI, the Python API,
        the server, the benchmarks and training data. Template errors (unknown roles, raise_exception) propagate."""
        text = self.apply_chat_template(messages, add_generation_prompt=True, tools=tools, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """Render ``messages`` with the file's chat template (jinja2 sandbox, like transformers).

        ``tools``: OpenAI function tools (``{"type": "function", "function": {"name", "description",
        "parameters"}}``), passed to the template as transformers' ``apply_chat_template(tools=...)`` passes them
        (None when absent, as there); Qwen2.5's template writes them into the system prompt.

        Gemma 3 GGUF files carry no template; for them the built-in Gemma 3 turn template is used. The result
        may start with the BOS token; ``encode`` does not add a second one.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        template = _compile_template(self.chat_template)
        return template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_or_empty(self.bos_token_id),
            eos_token=self._token_or_empty(min(self.eos_token_ids) if self.eos_token_ids else None),
            **template_kwargs,
        )

    def _token_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces that never split a UTF-8 character.

    ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (a clean character boundary)
        self._read_offset = 0  # ids before this have been emitted

    def push(self, token_id: int) -> str:
        """Append one token; returns the newly completed text (maybe empty while a character is incomplete)."""
        self._ids.append(token_id)
        emitted, window = self._decode_window()
        if len(window) > len(emitted) and not window.endswith("\ufffd"):
            return self._advance(window[len(emitted):])
        return ""

    def flush(self) -> str:
        """Everything not yet returned, including an incomplete trailing character (as U+FFFD)."""
        emitted, window = self._decode_window()
        return self._advance(window[len(emitted):])

    def _decode_window(self) -> tuple[str, str]:
        window_ids = self._ids[self._prefix_offset:]
        emitted_count = self._read_offset - self._prefix_offset
        decode = self._tokenizer.decode
        return (decode(window_ids[:emitted_count], self._skip_special_tokens),
                decode(window_ids, self._skip_special_tokens))

    def _advance(self, text: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text


# ---------------------------------------------------------------------------------------------------------------
# GGUF helpers
# ---------------------------------------------------------------------------------------------------------------


class _GGUFTokenizerMetadata:
    """Reads values from ``GGUFReader.fields`` (ReaderField objects) or from plain values."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self._fields = fields

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._fields:
            return default
        value = self._fields[key]
        return value.contents() if hasattr(value, "contents") else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return value


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def _byte_level_pre_tokenizer(pre: str) -> tuple[normalizers.Normalizer | None, pre_tokenizers.PreTokenizer]:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        split = pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated")
        return normalizers.NFC(), pre_tokenizers.Sequence([split, byte_level])
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT_REGEX), behavior="isolated")
        return None, pre_tokenizers.Sequence([split, byte_level])
    if pre == "smollm":  # llama.cpp: "\p{N}" then the GPT-2 regex; HF: Digits(individual) + ByteLevel
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in ("default", "gpt2", "gpt-2"):
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}; supported: qwen2, llama-bpe, smollm, default, gpt2")


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> tuple[BackendTokenizer, list[str]]:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet is spelled in raw UTF-8; re-spell it in the alphabet.
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(BPE(vocab=vocab, merges=merge_pairs, dropout=None, fuse_unk=False))
    normalizer, pre_tokenizer = _byte_level_pre_tokenizer(pre)
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend, spelled


def _sentencepiece_bpe(tokens: list[str], unk_token_id: int | None) -> tuple[BackendTokenizer, list[str]]:
    # Whitespace-only tokens are stored with real spaces; SentencePiece spells them with U+2581.
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    unk_token = spelled[unk_token_id] if unk_token_id is not None else "<unk>"
    model = BPE(vocab=vocab, merges=_merges_from_vocab(vocab), dropout=None, fuse_unk=True,
                unk_token=unk_token, byte_fallback=True)
    backend = BackendTokenizer(model)
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend, spelled


def _merges_from_vocab(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ranked by the merged token's position (earlier = higher rank).

    Within one merged token pairs go by the (left id, right id); across equal ranks, shorter left pieces first —
    the same ordering as transformers' ``generate_merges`` for Gemma.
    """
    ranked: list[tuple[int, int, int, str, str]] = []
    for merged, merged_id in vocab.items():
        pairs = []
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                pairs.append((vocab[left], vocab[right], left, right))
        pairs.sort()
        ranked.extend((merged_id, len(left), len(right), left, right) for _, _, left, right in pairs)
    ranked.sort(key=lambda item: (item[0], -item[1], -item[2]))
    return [(left, right) for _, _, _, left, right in ranked]


def _add_marked_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int]) -> None:
    control = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_CONTROL]
    user_defined = [AddedToken(token, normalized=False, special=False)
                    for token, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)


# ---------------------------------------------------------------------------------------------------------------
# HF directory and chat template helpers
# ---------------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        return value.get("content")
    return value


def _post_processor_adds(backend: BackendTokenizer, bos_token_id: int | None) -> bool:
    if bos_token_id is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_token_id


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    """The sandboxed jinja2 template of a chat template source, compiled once per source (1–3 ms each; rendering
    a compiled template is thread-safe)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(source)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
