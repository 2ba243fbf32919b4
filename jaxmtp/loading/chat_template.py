"""Chat templates rendered as transformers renders them (transformers 5's
utils/chat_template_utils.py): the same sandboxed Jinja environment and helpers, the
same variables, and the same marking of control tokens typed in the caller's strings.

Control tokens are the tokenizer's special tokens plus the added tokens that the
template's own text contains (or, if tokenizer_config.json lists them,
`chat_control_tokens`). Marked with private-use characters in the caller's messages,
tools, documents and template variables before rendering, they are encoded as plain text
afterwards (see Tokenizer.apply_chat_template), while the template's own control tokens
stay tokens: transformers' `apply_chat_template(..., sanitize_control_tokens=True)`.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when the model ships no chat template: BOS, one line per message, then the
# assistant's turn. Documented in README.md.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

CONTROL_TOKEN_START = "\U000f0000"  # transformers' markers, so marked text reads the same
CONTROL_TOKEN_END = "\U000f0001"
TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def load_chat_templates(model_dir: Path, config: dict) -> dict[str, str]:
    """The model's templates by name: chat_template.jinja and additional_chat_templates/
    take priority over tokenizer_config.json's chat_template (a string or a named list)."""
    templates = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    source = config.get("chat_template")
    if isinstance(source, list):
        return {t["name"]: t["template"] for t in source}
    return {"default": source or DEFAULT_CHAT_TEMPLATE}


CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's chat_template_content_format


def conversation_of(messages: list[dict], content_format: str = "auto") -> list[dict]:
    """OpenAI-style messages as the template reads them: a content given as parts
    ([{"type": "text", "text": ...}]) joined into one string ("auto", "string"), or
    every content as text parts ("openai", for templates that loop over parts). Only
    text parts: the models here read no images or audio."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {content_format!r}")
    conversation = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{index}] is not a message: a dict with a role")
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"messages[{index}].content: a {kind!r} part; only text parts are supported")
            content = "".join(part["text"] for part in content)
        if content_format == "openai" and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        turn = {**message, "content": content}
        if message.get("tool_calls"):
            turn["tool_calls"] = [_with_parsed_arguments(call, index) for call in message["tool_calls"]]
        conversation.append(turn)
    return conversation


def _with_parsed_arguments(call: dict, index: int) -> dict:
    """A call of an assistant message with its arguments as a dict, as chat templates
    read them (vLLM's); OpenAI sends them as JSON text."""
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ValueError(f"messages[{index}].tool_calls: arguments {arguments[:40]!r} are not JSON") from None
    return {**call, "function": {**function, "arguments": arguments}}


def select_template(templates: dict[str, str], tools, chosen: str | None = None) -> str:
    """transformers' choice: the caller's (one of the model's templates by name, or a
    template's source), else "tool_use" when tools are given and it exists, else
    "default"."""
    if chosen is not None:
        return templates.get(chosen, chosen)
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if len(templates) == 1:
        return next(iter(templates.values()))
    raise ValueError(f"the model has several chat templates and none is named 'default': {sorted(templates)}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with
    it); renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateDict:
    # `dict` without attribute access to the type, as transformers exposes it
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # namespaces refuse underscore-prefixed names, which lead to CPython internals
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters and sorts keys; templates expect neither
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


@lru_cache(maxsize=16)
def template_literal_text(source: str) -> str:
    """The template's raw text and string constants, joined by NULs so that a search
    cannot match across two of them."""
    ast = compile_template(source).environment.parse(source)
    literals = {node.data for node in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in ast.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(literals)


def control_tokens(source: str, added_tokens: dict[str, bool], listed: list[str] | None) -> tuple[str, ...]:
    """added_tokens: each added token's text -> whether it is special."""
    if listed is not None:
        return tuple(t for t, special in added_tokens.items() if special or t in listed)
    text = template_literal_text(source)
    return tuple(t for t, special in added_tokens.items() if special or (t in text and not t.isspace()))


@lru_cache(maxsize=16)
def control_token_patterns(tokens: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    """A regex matching any control token (longest first), and one matching a marked
    control token (group 1) or a lone marker."""
    pattern = "|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) or "(?!)"
    marked = f"{CONTROL_TOKEN_START}({pattern}){CONTROL_TOKEN_END}|[{CONTROL_TOKEN_START}{CONTROL_TOKEN_END}]"
    return re.compile(pattern), re.compile(marked)


def mark_control_tokens(obj: Any, tokens_re: re.Pattern) -> Any:
    """Wrap control tokens in the strings of obj (dict keys excepted) in markers; markers
    already there are dropped first, so none can be forged."""
    if isinstance(obj, str):
        obj = obj.replace(CONTROL_TOKEN_START, "").replace(CONTROL_TOKEN_END, "")
        return tokens_re.sub(f"{CONTROL_TOKEN_START}\\g<0>{CONTROL_TOKEN_END}", obj)
    if isinstance(obj, dict):
        return {key: mark_control_tokens(value, tokens_re) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [mark_control_tokens(value, tokens_re) for value in obj]
    return obj


def _alias_reasoning(message: dict) -> dict:
    # templates read `reasoning_content`; gpt-oss templates read `thinking`
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render(
    source: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool | str,
    tools: list[dict] | None,
    documents: list[dict] | None,
    variables: dict[str, Any],
) -> str:
    """The rendered chat. variables: the special tokens' texts and the caller's template
    variables (chat_template_kwargs), which override them."""
    if not messages:
        raise ValueError("messages is empty")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    # keys whose value is None are dropped, as templates handle a missing key better
    chat = [_alias_reasoning({k: v for k, v in message.items() if v is not None}) for message in messages]
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(field)
        if not isinstance(final, str):
            raise ValueError(f"continue_final_message: the final message has no text {field!r} to continue")
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final] if field in _REASONING_FIELDS else [field]
        if not any(f in source for f in fields):
            raise ValueError(f"continue_final_message: the chat template does not read {field!r}")
        chat[-1] = {**chat[-1], **{f: chat[-1][f] + _CONTINUE_TAG for f in fields}}
    try:
        text = compile_template(source).render(
            messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.exceptions.TemplateError as err:
        raise ValueError(f"chat template error: {err}") from None
    if final is not None:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("continue_final_message: the chat template drops part of the final message")
        at = text.rindex(tag)
        # a template that trims the message also trimmed its trailing space
        text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
