"""vLLM's /tokenize and /detokenize: a prompt, or messages rendered with the chat
template, as token ids (with their count and the model's context), and token ids as text.
Both run on a worker thread, as the tokenizer of a long prompt takes a while."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI

from jaxmtp.server.protocol import APIError, DetokenizeRequest, TokenizeRequest, check_text
from jaxmtp.server.serving import Server

CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


def add_tokenization_routes(app: FastAPI, server: Server, bad) -> None:
    """bad(err, body type, prompt field): an engine ValueError as the route's 400."""
    engine = server.engine

    def tokenizer():
        if engine.tokenizer is None:
            raise APIError(400, "the model has no tokenizer.json: it takes and gives token ids only")
        return engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.prompt is not None:
            given = [name for name in CHAT_ONLY if name in body.model_fields_set]
            if given:
                raise APIError(400, f"{given[0]} applies to messages, not to a prompt", param=given[0])
            check_text(body.prompt, "prompt")
            add_special_tokens = body.add_special_tokens is not False
        elif body.add_special_tokens:
            message = "add_special_tokens: messages get the special tokens their chat template writes, and no others"
            raise APIError(400, message, param="add_special_tokens")
        encoder = tokenizer()

        def encode() -> list[int]:
            if body.prompt is not None:
                return encoder.encode(body.prompt, add_special_tokens=add_special_tokens)
            return server.chat_prompt(body, body.messages, body.tools)

        try:
            ids = await asyncio.to_thread(encode)
        except ValueError as err:
            raise bad(err, TokenizeRequest, "prompt" if body.prompt is not None else "messages") from None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        vocab = engine.model_config.vocab_size
        outside = [t for t in body.tokens if t >= vocab]
        if outside:
            raise APIError(400, f"tokens out of vocabulary (size {vocab}): {outside[:5]}", param="tokens")
        decoder = tokenizer()
        # special tokens by name, so the text shows every token it was given
        return {"prompt": await asyncio.to_thread(decoder.decode, body.tokens, False)}
