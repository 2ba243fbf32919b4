"""The Python API in the vLLM style: LLM(...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path
from typing import Iterator, Sequence

from tqdm import tqdm

from jaxmtp.engine.llm_engine import LLMEngine
from jaxmtp.engine.outputs import RequestOutput
from jaxmtp.engine.sampling_params import RequestOutputKind, SamplingParams
from jaxmtp.loading.chat_template import conversation_of

Prompt = str | list[int] | dict  # dicts as vLLM's: {"prompt": text} or {"prompt_token_ids": ids}


def _as_prompt_list(prompts) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return [_from_dict(p) if isinstance(p, dict) else p for p in prompts]


def _from_dict(prompt: dict) -> str | list[int]:
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown:
        raise ValueError(f"prompt fields {unknown} are not supported (supported: prompt, prompt_token_ids)")
    if len(prompt) != 1:
        raise ValueError("a prompt dict holds exactly one of prompt and prompt_token_ids")
    return prompt.get("prompt", prompt.get("prompt_token_ids"))


class LLM:
    """LLM("checkpoints/stories260K", dtype="float32", page_size=16, ...): the keyword
    arguments are EngineConfig's fields, under vLLM's names where vLLM has the option."""

    def __init__(self, model: str | Path, **engine_kwargs):
        self.engine = LLMEngine(model, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine under vLLM's name for it."""
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams whose defaults are the sampling fields of the model's
        generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, and
        max_new_tokens as max_tokens; see the engine option generation_config), what
        generate and chat use when given no sampling_params."""
        return self.engine.default_sampling_params()

    def get_tokenizer(self):
        """The model's jaxmtp.loading.tokenizer.Tokenizer (None for a model without tokenizer.json)."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; outputs in prompt order.
        Every request is validated before any runs, so bad input raises ValueError
        and leaves the engine as it was."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for prompt, p in zip(prompts, params):
            p.validate()
            _, ids = self.engine.encode_prompt(prompt)
            self.engine.validate(ids, p)
        order: dict[str, int] = {}
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, p in zip(prompts, params):
                request_id = f"gen-{next(self._ids)}"
                order[request_id] = len(order)
                # one output per request, when it finishes: nothing is copied per step
                self.engine.add_request(request_id, prompt, dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY))
            with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm) as bar:
                while len(results) < len(order):
                    for out in self.engine.step():
                        if out.finished and out.request_id in order:
                            if out.error:
                                raise RuntimeError(f"the engine failed request {out.request_id}: {out.error}")
                            results[out.request_id] = out
                            bar.update(1)
        finally:
            self._abort_unfinished([rid for rid in order if rid not in results])
        return [results[rid] for rid in sorted(order, key=order.get)]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of message dicts) or a list of them,
        each rendered with the model's chat template (or chat_template: a template's
        source or the name of one of the model's) and generated as generate() does;
        each output's prompt is the rendered text."""
        for name, value in (("lora_request", lora_request), ("mm_processor_kwargs", mm_processor_kwargs)):
            if value is not None:
                raise ValueError(f"{name} is not supported: this engine serves text models without adapters")
        if self.tokenizer is None:
            raise ValueError("chat needs the model's tokenizer.json (and its chat template)")
        conversations = [messages] if not messages or isinstance(messages[0], dict) else list(messages)
        rendered = []
        for conversation in conversations:
            conversation = conversation_of(conversation, chat_template_content_format)
            render = functools.partial(
                self.tokenizer.apply_chat_template, conversation, tools, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
            rendered.append((render(tokenize=False), render(return_dict=False)))
        outputs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm)
        return [dataclasses.replace(out, prompt=text) for out, (text, _) in zip(outputs, rendered)]

    def _abort_unfinished(self, request_ids: list[str]) -> None:
        """Leave the engine as it was: abort these requests and free their pages."""
        if not request_ids:
            return
        for request_id in request_ids:
            self.engine.abort_request(request_id)
        self.engine.step()  # admits what is still incoming, then ends them all

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield outputs of one request as tokens arrive, cumulative or only what is new
        (sampling_params.output_kind, RequestOutputKind.DELTA). The engine runs here;
        the server runs its own engine loop instead."""
        request_id = f"stream-{next(self._ids)}"
        self.engine.add_request(request_id, _as_prompt_list(prompt)[0], sampling_params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:  # the caller stopped early, or a step raised: free the request's pages
                self._abort_unfinished([request_id])
