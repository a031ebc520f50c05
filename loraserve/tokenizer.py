"""Tokenizer, chat template and incremental detokenizer of a Hugging Face model directory.

`tokenizer.json` is run by the `tokenizers` library; the chat template (from
`tokenizer_config.json` or `chat_template.jinja`) is rendered with a sandboxed jinja2 environment
that offers what transformers offers templates (`raise_exception`, `tojson`, `strftime_now`).
The engine does the stopping; this module provides the EOS ids and text deltas.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPLACEMENT_CHAR = "\ufffd"
MAX_HELD_TOKENS = 8   # never hold back more than this many tokens waiting for a UTF-8 tail


class TokenizerError(ValueError):
    """A tokenizer directory or chat request loraserve cannot handle."""


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, holding back incomplete UTF-8.

    Each step decodes a short window (the last emitted tokens plus the new ones) so a token whose
    bytes complete a character emits that whole character at once."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool = True):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0   # start of the decode window (already-emitted context)
        self._read = 0     # end of what has been emitted
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        """Add one token; return the newly completed text ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        done = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        held = len(self._ids) - self._read
        if len(full) <= len(done) or (full.endswith(REPLACEMENT_CHAR) and held < MAX_HELD_TOKENS):
            return ""
        return self._emit(full[len(done):])

    def flush(self) -> str:
        """Emit whatever is held back (incomplete bytes become U+FFFD); call at end of stream."""
        if self._read == len(self._ids):
            return ""
        done = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        return self._emit(full[len(done):])

    def _emit(self, delta: str) -> str:
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _pick_template(value: Any) -> str | None:
    """A template string, or the "default" one of transformers' named-template list."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled jinja2 chat template plus the special-token variables it may use."""

    def __init__(self, source: str, variables: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"chat template does not compile: {e}") from None
        self._variables = variables
        self.source = source

    def render(self, messages: list[dict], add_generation_prompt: bool,
               tools: list[dict] | None = None, variables: dict[str, Any] | None = None) -> str:
        """The prompt text; `tools` (OpenAI's tool objects) go to the template as `tools`, as
        transformers passes them (None: the template renders no tools); `variables` are more of
        the template's variables (vLLM's `chat_template_kwargs`: Qwen3's `enable_thinking`),
        over the special tokens' as transformers puts them."""
        try:
            return self._template.render(**{**self._variables, **(variables or {})},
                                         messages=messages,
                                         add_generation_prompt=add_generation_prompt, tools=tools)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TokenizerError(f"messages[{i}] must be an object with a string 'role'")


class Tokenizer:
    """The tokenizer of a model directory: ids <-> text, chat rendering, EOS ids."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_ids: list[int],
                 chat_template: ChatTemplate | None):
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: list[int] = eos_token_ids
        self._chat = chat_template

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json, chat_template.jinja and the EOS ids of
        config.json / generation_config.json / tokenizer_config.json (their union, in that order)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{file} not found (loraserve needs a fast tokenizer.json)")
        tok = tokenizers.Tokenizer.from_file(str(file))
        tcfg = _read_json(path / "tokenizer_config.json")
        specials = {k: _token_content(tcfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        eos: list[int] = []
        eos += _as_id_list(_read_json(path / "config.json").get("eos_token_id"))
        eos += _as_id_list(_read_json(path / "generation_config.json").get("eos_token_id"))
        if specials["eos_token"] is not None and tok.token_to_id(specials["eos_token"]) is not None:
            eos.append(tok.token_to_id(specials["eos_token"]))
        source = _pick_template(tcfg.get("chat_template"))
        if source is None and (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text()
        variables = {k: v for k, v in specials.items() if v is not None}
        chat = ChatTemplate(source, variables) if source else None
        return cls(tok, list(dict.fromkeys(eos)), chat)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. With `add_special_tokens`, the tokenizer's own post-processor adds
        what the model expects around a text (Llama 3's `<|begin_of_text|>`; nothing for Qwen or
        SmolLM2, whose files add none): what vLLM and transformers do for a completion prompt."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self._check_ids(ids)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token (special tokens included), e.g. for logprobs' token strings."""
        return self.decode([token_id], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def chat_template(self) -> str | None:
        """The chat template's source (None: the model has none); its tool-call markers tell
        which format the model calls tools in (server/tool_calls.family_of)."""
        return None if self._chat is None else self._chat.source

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            variables: dict[str, Any] | None = None) -> str:
        """Render `messages` ([{"role", "content"}, ...]) and `tools` with the model's chat
        template, and `variables` (more template variables) when given."""
        if self._chat is None:
            raise TokenizerError("this model has no chat template (tokenizer_config.json "
                                 "chat_template or chat_template.jinja); use /v1/completions")
        _check_messages(messages)
        return self._chat.render(messages, add_generation_prompt, tools, variables)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok, skip_special_tokens)

    def _check_ids(self, ids: list[int]) -> None:
        # ids past the tokenizer's vocab (a model's padded vocab rows) decode to nothing
        bad = [i for i in ids if int(i) < 0]
        if bad:
            raise TokenizerError(f"token ids must be >= 0, got {bad[:5]}")
