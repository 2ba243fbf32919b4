"""Tokenizer from tokenizer.json (via `tokenizers`) and the chat template beside it
(chat_template.jinja or tokenizer_config.json, rendered by jaxmtp.loading.chat_template).

Special tokens typed in a caller's text stay text: a completion prompt "</s>" is the
characters "</s>", not the EOS token, unless the caller asks for them to be parsed; in
a chat only the template's own control tokens are tokens.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from jaxmtp.loading import chat_template as templating

# the named special tokens transformers passes to chat templates
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# a token the ByteFallback decoder reads as one byte
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def check_unicode(obj: Any, field: str) -> None:
    """ValueError naming the field and position of a lone surrogate (a code point
    U+D800-U+DFFF, which no UTF-8 text holds) in a string of obj, searched recursively."""
    if isinstance(obj, str):
        bad = _SURROGATE.search(obj)
        if bad:
            raise ValueError(
                f"{field} contains the lone surrogate U+{ord(bad.group()):04X} at character {bad.start()}: "
                "text must be valid Unicode"
            )
    elif isinstance(obj, dict):
        for key, value in obj.items():
            check_unicode(key, f"{field} key")
            check_unicode(value, f"{field}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            check_unicode(value, f"{field}[{index}]")


def _encode(hf: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch releases the GIL while it works (encode does not): a long prompt
    # tokenised on a worker thread then leaves the server's event loop running
    return hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


class BatchEncoding(dict):
    """transformers' BatchEncoding as scripts read it: enc["input_ids"] or enc.input_ids."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def batch_encoding(ids: list[int] | list[list[int]]) -> BatchEncoding:
    """The ids of a text (or of each of several) with their all-ones attention mask."""
    if ids and isinstance(ids[0], list):
        return BatchEncoding(input_ids=ids, attention_mask=[[1] * len(i) for i in ids])
    return BatchEncoding(input_ids=ids, attention_mask=[1] * len(ids))


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model folder {model_dir!s} has no tokenizer.json")
        self.hf = HFTokenizer.from_file(str(path))
        # a second copy that reads special tokens as text: the flag is per tokenizer, and
        # flipping it on a shared one would race between threads
        self._hf_as_text = HFTokenizer.from_file(str(path))
        self._hf_as_text.encode_special_tokens = True
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {n: t for n in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(n))) is not None}
        self.chat_templates = templating.load_chat_templates(model_dir, config)
        self._chat_control_tokens = config.get("chat_control_tokens")
        added = self.hf.get_added_tokens_decoder()
        self._added_tokens = {token.content: token.special for token in added.values()}
        self.special_token_ids = frozenset(i for i, token in added.items() if token.special)
        self.byte_piece_ids = frozenset(
            i for piece, i in self.hf.get_vocab(with_added_tokens=False).items() if _BYTE_PIECE.fullmatch(piece)
        )
        self._newline_ids = self.hf.encode("\n", add_special_tokens=False).ids
        self._token_text_lengths: dict[tuple[int, bool], int] = {}

    def encode(self, text: str, add_special_tokens: bool = True, parse_special_tokens: bool | None = None) -> list[int]:
        """Token ids of text. parse_special_tokens: whether special tokens written in text
        ("</s>") are encoded as those tokens; by default only when add_special_tokens is
        False, i.e. when the caller writes its own special tokens (a rendered chat
        template). A prompt of plain text keeps them as text."""
        check_unicode(text, "prompt")
        if parse_special_tokens is None:
            parse_special_tokens = not add_special_tokens
        hf = self.hf if parse_special_tokens else self._hf_as_text
        return _encode(hf, text, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """transformers' decode: special tokens are shown unless skip_special_tokens."""
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    # ----- the rest of transformers' tokenizer surface, which scripts written for
    # vLLM's get_tokenizer() use

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> BatchEncoding:
        """{"input_ids", "attention_mask"} of a text, or of each of a list of texts; special
        tokens written in the text are those tokens, as transformers reads them."""
        if isinstance(text, str):
            return batch_encoding(self.encode(text, add_special_tokens, parse_special_tokens=True))
        return batch_encoding([self.encode(t, add_special_tokens, parse_special_tokens=True) for t in text])

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def __len__(self) -> int:
        """The vocabulary with the added tokens (transformers' len(tokenizer))."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without the added tokens (transformers' vocab_size)."""
        return self.hf.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self.hf.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False):
        """A token's text, or each of a list's; skip_special_tokens drops the named special
        tokens' (bos_token, eos_token, ...), as transformers does."""
        if isinstance(ids, int):
            return self.hf.id_to_token(ids)
        named = {self.hf.token_to_id(token) for token in self.special_tokens.values()} if skip_special_tokens else set()
        return [self.hf.id_to_token(i) for i in ids if i not in named]

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        """A token's id (the unknown token's, or None without one, for a token not in the
        vocabulary), or each of a list's."""
        if isinstance(tokens, str):
            found = self.hf.token_to_id(tokens)
            return found if found is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def _special_token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.hf.token_to_id(token)

    bos_token = property(lambda self: self.special_tokens.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens.get("eos_token"))
    unk_token = property(lambda self: self.special_tokens.get("unk_token"))
    pad_token = property(lambda self: self.special_tokens.get("pad_token"))
    bos_token_id = property(lambda self: self._special_token_id("bos_token"))
    eos_token_id = property(lambda self: self._special_token_id("eos_token"))
    unk_token_id = property(lambda self: self._special_token_id("unk_token"))
    pad_token_id = property(lambda self: self._special_token_id("pad_token"))

    def token_text_length(self, token_id: int, skip_special_tokens: bool = True) -> int:
        """len(decode([token_id])), cached: the incremental detokeniser's usual context."""
        key = (token_id, skip_special_tokens)
        length = self._token_text_lengths.get(key)
        if length is None:
            length = self._token_text_lengths[key] = len(self.decode([token_id], skip_special_tokens))
        return length

    def token_texts(
        self, previous_ids: list[int], token_ids: list[int], context: int = 4, skip_special_tokens: bool = True
    ) -> list[str]:
        """The text each of token_ids would add right after previous_ids (alternatives at
        one position). Decoding a token alone would drop the space a SentencePiece-style
        decoder strips from the first token ("time" for " time"), so each is decoded after
        a few tokens before it, whose text is cut off."""
        before = list(previous_ids[-context:])
        head = self.decode(before, skip_special_tokens)
        texts = []
        for token in token_ids:
            whole = self.decode(before + [token], skip_special_tokens)
            texts.append(whole[len(head) :] if whole.startswith(head) else self.decode([token], skip_special_tokens))
        return texts

    def apply_chat_template(
        self,
        conversation: list[dict] | list[list[dict]],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        return_dict: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        """The chat as the model's template renders it, with transformers 5's signature and
        defaults: {"input_ids", "attention_mask"} (tokenize=True; return_dict=False: the
        ids alone), with control tokens typed in messages, tools,
        documents or template variables encoded as text (transformers'
        sanitize_control_tokens=True); tokenize=False returns the rendered text as is.
        chat_template: a template's source or the name of one of the model's; the
        template's variables come from kwargs and chat_template_kwargs (vLLM's spelling).
        A list of conversations gives a list of results."""
        if conversation and isinstance(conversation[0], (list, tuple)):
            results = [
                self.apply_chat_template(
                    c, tools, documents, chat_template, add_generation_prompt, continue_final_message, tokenize, False,
                    chat_template_kwargs, **kwargs,
                )
                for c in conversation
            ]
            return batch_encoding(results) if tokenize and return_dict else results
        variables = {**(chat_template_kwargs or {}), **kwargs}
        for name in templating.TEMPLATE_VARIABLES:
            if name in variables:
                raise ValueError(f"chat_template_kwargs: {name!r} is set by its own argument")
        for value, field in ((conversation, "messages"), (tools, "tools"), (documents, "documents"), (variables, "chat_template_kwargs")):
            check_unicode(value, field)
        source = templating.select_template(self.chat_templates, tools, chat_template)
        markers_re = None
        if tokenize:
            controls = templating.control_tokens(source, self._added_tokens, self._chat_control_tokens)
            tokens_re, markers_re = templating.control_token_patterns(controls)
            conversation, tools, documents, variables = (
                templating.mark_control_tokens(value, tokens_re) for value in (conversation, tools, documents, variables)
            )
        text = templating.render(
            source,
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            variables={**self.special_tokens, **variables},
        )
        if not tokenize:
            return text
        ids = self._encode_marked(text, markers_re)
        return batch_encoding(ids) if return_dict else ids

    def _encode_marked(self, text: str, markers_re: re.Pattern) -> list[int]:
        """Encode a chat rendered from marked inputs: marked control tokens as plain text,
        the rest (the template's own control tokens included) as usual. Splitting on the
        markers gives [text, marked token, text, ...], None for a lone marker (a template
        string method split a marked token), which still breaks the text."""
        pieces = markers_re.split(text)
        ids = _encode(self.hf, pieces[0], False)
        for index, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = index % 2 == 1
            piece_ids = self._encode_piece(piece, as_text)
            if as_text and self.hf.token_to_id(piece) in piece_ids:
                raise ValueError(f"cannot encode {piece!r} as text: the tokenizer makes that token from text")
            ids += piece_ids
        return ids

    def _encode_piece(self, piece: str, as_text: bool) -> list[int]:
        # After a newline, so that a SentencePiece normalizer does not prepend the space
        # it adds at the start of a text; the newline's ids are then cut off again.
        encode = self._encode_without_added_tokens if as_text else self._encode_parsing_special
        piece_ids = encode("\n" + piece)
        newline = self._newline_ids
        return piece_ids[len(newline) :] if piece_ids[: len(newline)] == newline else encode(piece)

    def _encode_parsing_special(self, text: str) -> list[int]:
        return _encode(self.hf, text, False)

    def _encode_without_added_tokens(self, text: str) -> list[int]:
        """text through the normalizer, pre-tokenizer and model only: no added token,
        special or not, is matched."""
        if self.hf.normalizer is not None:
            text = self.hf.normalizer.normalize_str(text)
        splits = [text]
        if self.hf.pre_tokenizer is not None:
            splits = [split for split, _ in self.hf.pre_tokenizer.pre_tokenize_str(text)]
        return [token.id for split in splits for token in self.hf.model.tokenize(split)]
