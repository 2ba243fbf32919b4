"""Response bodies and stream chunks of /v1/completions and /v1/chat/completions. Both
render logprobs from one loop (token_logprobs) and differ only in the shape around it."""

from __future__ import annotations

import dataclasses
import itertools
import json
import uuid

from jaxmtp.engine.outputs import Logprob
from jaxmtp.server.generation import Choice


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and the top alternatives', each with its text."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


def token_text(token: int, logprob: Logprob) -> str:
    """The text the token adds (the engine's decoded_token); a model without a tokenizer
    names its tokens as vLLM's --return-tokens-as-token-ids does."""
    return f"token_id:{token}" if logprob.decoded_token is None else logprob.decoded_token


def token_logprob(token: int, entry: dict[int, Logprob], num_top: int) -> TokenLogprob:
    """One token's entry from the engine (the token, with its own rank, and the top n,
    ranks 1..n) as a TokenLogprob with the top num_top alternatives."""
    top = sorted(entry.items(), key=lambda item: item[1].rank)[:num_top]
    chosen = entry[token]
    return TokenLogprob(token_text(token, chosen), chosen.logprob, [(token_text(t, lp), lp.logprob) for t, lp in top])


def token_logprobs(choice: Choice, first_token: int, num_top: int) -> list[TokenLogprob]:
    """The logprobs of the choice's tokens from first_token on."""
    return [token_logprob(choice.token_ids[position], choice.logprobs[position], num_top)
            for position in range(first_token, len(choice.logprobs))]


class CompletionFormat:
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, num_logprobs: int | None, with_prompt_logprobs: bool = False, return_token_ids: bool = False):
        self.num_logprobs = num_logprobs
        self.with_prompt_logprobs = with_prompt_logprobs  # vLLM's prompt_logprobs field
        self.return_token_ids = return_token_ids  # vLLM's: prompt_token_ids and token_ids
        self._text_offsets: dict[int, int] = {}  # each choice's text length in its logprobs so far

    def choice(self, choice: Choice, text: str, first_token: int, done: bool, streaming: bool) -> dict:
        body = {"index": choice.index, "text": text, "logprobs": self.logprobs(choice, first_token)}
        return self.finish(body, choice, first_token, done)

    def finish(self, body: dict, choice: Choice, first_token: int, done: bool) -> dict:
        """The fields every choice ends with; a stream's chunk carries the tokens from
        first_token on, and the prompt's fields in its first chunk."""
        if first_token == 0:
            body.update(self.prompt_fields(choice))
        if self.return_token_ids:
            body["token_ids"] = choice.token_ids[first_token:]
        body["finish_reason"] = choice.finish_reason if done else None
        if done and choice.spec_stats is not None:
            body["spec_stats"] = choice.spec_stats
        return body

    def prompt_fields(self, choice: Choice) -> dict:
        """The prompt's logprobs (as vLLM's: per prompt token {id: {logprob, rank,
        decoded_token}}) and token ids, where the request asked for them."""
        fields = {}
        if self.with_prompt_logprobs:
            fields["prompt_logprobs"] = [
                None if entry is None else {str(t): dataclasses.asdict(lp) for t, lp in entry.items()}
                for entry in choice.prompt_logprobs or []
            ]
        if self.return_token_ids:
            fields["prompt_token_ids"] = choice.prompt_token_ids
        return fields

    def response_fields(self, generation) -> dict:
        """Fields of the whole response beside its choices."""
        return {}

    def opening(self, choice: Choice) -> dict | None:
        return None

    def usage(self, generation) -> dict:
        return generation.usage()

    def logprobs(self, choice: Choice, first_token: int) -> dict | None:
        if self.num_logprobs is None or choice.logprobs is None:
            return None
        return self.logprobs_body(choice, token_logprobs(choice, first_token, self.num_logprobs))

    def logprobs_body(self, choice: Choice, entries: list[TokenLogprob]) -> dict:
        """OpenAI's completion logprobs; text_offset: where each token's text starts in the
        choice's text, counted on from the tokens of a stream's earlier chunks (vLLM's)."""
        start = self._text_offsets.get(choice.index, 0)
        offsets = list(itertools.accumulate((len(e.token) for e in entries), initial=start))
        self._text_offsets[choice.index] = offsets[-1]
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries],
            "text_offset": offsets[:-1],
        }


class EchoFormat(CompletionFormat):
    """/v1/completions with echo: each choice's text and logprobs begin with its
    prompt's (the first prompt token has no logprob: null, as OpenAI's). With max_tokens 0
    the engine still samples one token, which the response leaves out."""

    def __init__(self, num_logprobs: int | None, with_prompt_logprobs: bool, return_token_ids: bool, tokenizer,
                 prompt_only: bool):
        """tokenizer: the text of prompts given as ids and of the first prompt token (None
        for a model without one: tokens are then named by id)."""
        super().__init__(num_logprobs, with_prompt_logprobs, return_token_ids)
        self.tokenizer = tokenizer
        self.prompt_only = prompt_only

    def choice(self, choice: Choice, text: str, first_token: int, done: bool, streaming: bool) -> dict:
        prompt = choice.prompt
        if prompt is None:
            ids = choice.prompt_token_ids
            prompt = str(ids) if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)
        body = {"index": choice.index, "text": prompt + ("" if self.prompt_only else text)}
        if self.num_logprobs is not None:
            entries = [] if self.prompt_only else token_logprobs(choice, 0, self.num_logprobs)
            logprobs = self.logprobs_body(choice, self.prompt_logprobs(choice) + entries)
            logprobs["token_logprobs"][0] = logprobs["top_logprobs"][0] = None
            body["logprobs"] = logprobs
        else:
            body["logprobs"] = None
        body = self.finish(body, choice, 0, done)
        if self.prompt_only:
            body["finish_reason"] = "length"
            if self.return_token_ids:
                body["token_ids"] = []
        return body

    def prompt_logprobs(self, choice: Choice) -> list[TokenLogprob]:
        """The prompt's tokens as TokenLogprobs; the first, which nothing scores, with its
        text (special tokens by name, as vLLM's) and a logprob the caller replaces by null."""
        first = choice.prompt_token_ids[0]
        text = f"token_id:{first}" if self.tokenizer is None else self.tokenizer.decode([first])
        return [TokenLogprob(text, 0.0, [])] + [
            token_logprob(token, entry, self.num_logprobs)
            for token, entry in zip(choice.prompt_token_ids[1:], choice.prompt_logprobs[1:])
        ]

    def usage(self, generation) -> dict:
        usage = generation.usage()
        if self.prompt_only:
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        return usage


class ChatFormat(CompletionFormat):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, num_logprobs: int | None, with_prompt_logprobs: bool = False, return_token_ids: bool = False,
                 new_tool_reader=None, tool_calls_finish: bool = False, max_tool_calls: int | None = None):
        """new_tool_reader: makes a reader of one choice's output into tool calls
        (jaxmtp.server.tool_choice.output_reader), or None for text; tool_calls_finish:
        a choice that called a tool and stopped finishes with "tool_calls"."""
        super().__init__(num_logprobs, with_prompt_logprobs, return_token_ids)
        self.new_tool_reader = new_tool_reader
        self.tool_calls_finish = tool_calls_finish
        self.max_tool_calls = max_tool_calls
        self._readers: dict[int, object] = {}  # a stream's reader of each choice
        self._called: set[int] = set()  # the choices that have made a call

    def choice(self, choice: Choice, text: str, first_token: int, done: bool, streaming: bool) -> dict:
        if self.new_tool_reader is None:
            message = {"content": text}
        elif streaming:
            message = self.delta_message(choice, text, done)
        else:
            parsed = self.new_tool_reader().parse(text)
            calls = parsed.tool_calls[: self.max_tool_calls]
            if calls:
                self._called.add(choice.index)
            message = {"content": parsed.content, "tool_calls": [
                {"id": tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]}
        if not streaming:
            message = {"role": "assistant", **message}
        body = {"index": choice.index, "delta" if streaming else "message": message}
        body["logprobs"] = self.logprobs(choice, first_token)
        return self.finish(body, choice, first_token, done)

    def delta_message(self, choice: Choice, text: str, done: bool) -> dict:
        """A stream's delta: the content and the tool calls decided by this text."""
        reader = self._readers.setdefault(choice.index, self.new_tool_reader())
        pieces = [reader.feed(text)] + ([reader.finish()] if done else [])
        message, calls = {}, []
        content = "".join(piece.content for piece in pieces)
        if content:
            message["content"] = content
        for delta in (d for piece in pieces for d in piece.tool_calls):
            if self.max_tool_calls is not None and delta.index >= self.max_tool_calls:
                continue
            call = {"index": delta.index, "function": {"arguments": delta.arguments}}
            if delta.name is not None:  # a call's first delta names it
                call.update(id=tool_call_id(), type="function", function={"name": delta.name, **call["function"]})
            calls.append(call)
        if calls:
            message["tool_calls"] = calls
            self._called.add(choice.index)
        return message

    def finish(self, body: dict, choice: Choice, first_token: int, done: bool) -> dict:
        body = super().finish(body, choice, first_token, done)
        if done and self.tool_calls_finish and choice.index in self._called and body["finish_reason"] == "stop":
            body["finish_reason"] = "tool_calls"
        return body

    def prompt_fields(self, choice: Choice) -> dict:
        return {}  # a chat has one prompt: its fields are the response's (response_fields)

    def response_fields(self, generation) -> dict:
        return super().prompt_fields(generation.choices[0])

    def opening(self, choice: Choice) -> dict:
        delta = {"role": "assistant", "content": ""}
        return {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}

    def logprobs_body(self, choice: Choice, entries: list[TokenLogprob]) -> dict:
        def token(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**token(e.token, e.logprob), "top_logprobs": [token(text, lp) for text, lp in e.top]} for e in entries
            ]
        }


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
