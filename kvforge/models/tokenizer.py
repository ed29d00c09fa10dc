"""Tokenizer: HF `tokenizers` for text <-> ids, jinja2 for chat templates; built from a GGUF or a directory."""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import tokenizers
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from kvforge.errors import InvalidRequestError, ModelLoadError
from kvforge.models.chat_templates import default_chat_template
from kvforge.models.spm_tokenizer import sentencepiece_bpe

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3 = {"llama3", "llama-bpe", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral"}
_QWEN2 = {"qwen2", "deepseek-r1-qwen"}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _LLAMA3 or pre in _QWEN2:
        split = _LLAMA3_SPLIT if pre in _LLAMA3 else _QWEN2_SPLIT
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _byte_level_bpe(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer from llama.cpp's `tokenizer.ggml.*` keys (tokenizer.ggml.model == "gpt2")."""
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        key = tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(key, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre")
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3)
    tk = tokenizers.Tokenizer(bpe)
    if pre in _QWEN2:
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = _pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", []))
    special = [t for i, (t, k) in enumerate(zip(tokens, types)) if k == _CONTROL and vocab.get(t) == i]
    user = [t for i, (t, k) in enumerate(zip(tokens, types)) if k == _USER_DEFINED and vocab.get(t) == i]
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tk.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tk


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile_template(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids, plus the model's chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        chat_template_source: str | None = None,
    ) -> None:
        self._tk = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.chat_template = chat_template
        # where the template comes from, for start-up lines; None when there is none
        self.chat_template_source = (chat_template_source or "the model's own") if chat_template else None

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from a GGUF file's metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelLoadError(
                f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
                "'llama' (SentencePiece BPE). Load the tokenizer from a directory with tokenizer.json instead."
            )
        if "tokenizer.ggml.tokens" not in meta:
            raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens; cannot build the tokenizer")
        tokens = meta["tokenizer.ggml.tokens"]

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        own = meta.get("tokenizer.chat_template")
        arch = meta.get("general.architecture")
        fallback = None if own else default_chat_template(arch, meta)
        return cls(
            _byte_level_bpe(meta) if kind == "gpt2" else sentencepiece_bpe(meta),
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=own or fallback,
            chat_template_source=f"kvforge's {arch} template: the GGUF names an instruct model but ships none"
            if fallback else None,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str) -> Tokenizer:
        """Build from a Hugging Face model directory: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ModelLoadError(f"{path}: no tokenizer.json; a model directory must contain one")
        try:
            backend = tokenizers.Tokenizer.from_file(tok_file)
        except Exception as e:
            raise ModelLoadError(f"{tok_file}: not a valid tokenizers JSON file ({e})") from e
        config: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            try:
                with open(cfg_file, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"{cfg_file}: not valid JSON ({e})") from e
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        bos = _token_text(config.get("bos_token"))
        bos_id = backend.token_to_id(bos) if bos else None
        post_adds_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        add_bos = bool(config.get("add_bos_token", False)) and not post_adds_bos
        return cls(backend, bos, _token_text(config.get("eos_token")), add_bos, template)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The Hugging Face `tokenizers` object (grammar libraries read its JSON)."""
        return self._tk

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._tk.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self._tk.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def all_special_ids(self) -> list[int]:
        ids = {i for i, t in self._tk.get_added_tokens_decoder().items() if t.special}
        ids.update(i for i in (self.bos_token_id, self.eos_token_id) if i is not None)
        return sorted(ids)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text. Through encode_batch, which releases the GIL (encode holds it), so a long prompt
        encoded on another thread does not stall the caller's other threads (the server's event loop).
        InvalidRequestError for text that is not valid Unicode (a lone UTF-16 surrogate, which JSON can carry)."""
        if not text.isascii():
            _check_unicode(text)
        ids = self._tk.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos_token:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's jinja chat template, as transformers does (tokenize=False)."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead of messages")
        try:
            return _compile_template(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected these messages: {e}") from e


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"text has an unpaired UTF-16 surrogate ({text[e.start]!r} at character {e.start}), "
                                  "which is not a Unicode character; send valid Unicode text") from None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, holding back bytes of a character not yet complete."""

    _MAX_HELD = 4  # a UTF-8 character spans at most 4 bytes, hence at most 4 byte-level tokens

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)[-6:]  # context so leading-space rules see the previous tokens
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(force=False)

    def flush(self) -> str:
        """Whatever is still held back (e.g. an unfinished character at the end of generation)."""
        return self._emit(force=True) if self._read < len(self._ids) else ""

    def _emit(self, force: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], self._skip)
        new_text = decode(self._ids[self._prefix :], self._skip)
        held = len(self._ids) - self._read
        complete = not new_text.endswith("\ufffd") or held >= self._MAX_HELD
        if len(new_text) <= len(prefix_text) or not (complete or force):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
