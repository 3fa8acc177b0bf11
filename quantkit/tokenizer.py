"""A tokenizer.json read through `tokenizers` alone, with the chat template rendered here.

The runtime and the server need five things of a tokenizer: encode, decode, its size, its special ids and its
chat template. transformers provides them, but importing it costs ~1.2 s of a server's start (its lazy module
tables) where `tokenizers` costs 0.03 s. For the tokenizer classes whose AutoTokenizer is the generic fast
tokenizer over tokenizer.json (`PLAIN`), `Tokenizer` gives the same ids, text and prompts (tested against
AutoTokenizer on the built-in models); other classes keep AutoTokenizer (models.open_tokenizer).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

# tokenizer_config.json classes whose AutoTokenizer is PreTrainedTokenizerFast over tokenizer.json with nothing
# added (no BOS/EOS post-processor edits, no legacy normalisation)
PLAIN = ("TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast", "Qwen2Tokenizer",
         "Qwen2TokenizerFast")
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def plain(path: Path) -> bool:
    """Whether `Tokenizer` loads this directory as AutoTokenizer would."""
    config = path / "tokenizer_config.json"
    if not (config.exists() and (path / "tokenizer.json").exists()):
        return False
    return json.loads(config.read_text()).get("tokenizer_class") in PLAIN


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as Backend

        self.backend = Backend.from_file(str(path / "tokenizer.json"))
        self.config = config = json.loads((path / "tokenizer_config.json").read_text())
        self.special_tokens_map = {name: _content(config[name]) for name in NAMED if _content(config.get(name))}
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        extra = list(extra.values()) if isinstance(extra, dict) else extra
        self.chat_template = _chat_template(path, config)
        names = list(self.special_tokens_map.values()) + [_content(t) for t in extra]
        self.all_special_tokens = list(dict.fromkeys(names))
        self.all_special_ids = [self.backend.token_to_id(t) for t in self.all_special_tokens]
        for name in NAMED:
            token = self.special_tokens_map.get(name)
            setattr(self, name, token)
            setattr(self, name + "_id", None if token is None else self.backend.token_to_id(token))

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int] | int, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        """The conversation through the model's template, as transformers renders it: the same sandboxed jinja
        environment and helpers, the special tokens as variables."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        template = _compile(_pick(self.chat_template, tools))
        text = template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _chat_template(path: Path, config: dict) -> str | list | None:
    """chat_template.jinja beside the tokenizer (transformers 5 writes it there), else tokenizer_config.json's."""
    file = path / "chat_template.jinja"
    if file.exists():
        return file.read_text()
    file = path / "chat_template.json"
    if file.exists():
        return json.loads(file.read_text()).get("chat_template")
    return config.get("chat_template")


def _pick(template: str | list, tools: list | None) -> str:
    """Named templates (a list of {name, template}): "tool_use" when tools are given and there is one, else
    "default", as transformers chooses."""
    if isinstance(template, str):
        return template
    named = {t["name"]: t["template"] for t in template}
    if tools and "tool_use" in named:
        return named["tool_use"]
    if "default" not in named:
        raise ValueError(f"no default chat template among {sorted(named)}")
    return named["default"]


@cache
def _compile(source: str):
    """A template compiled in the environment transformers gives chat templates: sandboxed, trimmed blocks,
    loop controls, a tojson that keeps non-ASCII, raise_exception and strftime_now; {% generation %} renders
    its body (the assistant-mask tag, which only matters to training)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
