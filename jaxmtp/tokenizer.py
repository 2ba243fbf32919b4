"""Tokenizer from tokenizer.json (via `tokenizers`) and the chat template from
tokenizer_config.json (via jinja2)."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as HFTokenizer

# Used when the model ships no chat template: BOS, one line per message, then the
# assistant's turn. Documented in README.md. Chat prompts are encoded without adding
# special tokens, since templates write their own.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model folder {model_dir!s} has no tokenizer.json")
        self.hf = HFTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template_source = config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        if isinstance(self.chat_template_source, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in self.chat_template_source}
            self.chat_template_source = named.get("default", next(iter(named.values())))
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self.chat_template = env.from_string(self.chat_template_source)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_continuation(
        self, previous_ids: list[int], ids: list[int], context: int = 4, skip_special_tokens: bool = True
    ) -> str:
        """Text of ids as it continues previous_ids. Decoding ids alone would drop the
        space a SentencePiece-style decoder strips from the first token ("time" for
        " time"), so decode with a few tokens before them and cut those off."""
        before = previous_ids[-context:]
        head = self.decode(before, skip_special_tokens)
        whole = self.decode(before + ids, skip_special_tokens)
        return whole[len(head) :] if whole.startswith(head) else self.decode(ids, skip_special_tokens)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.hf.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _raise_template_error(message: str):
    raise ValueError(f"chat template error: {message}")
