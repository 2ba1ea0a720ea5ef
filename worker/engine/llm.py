"""LLM: the offline batch API, in vLLM's shape.

llm = LLM(model="path/to/folder", dtype="auto")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.engine.outputs import RequestOutput
from worker.engine.sampling_params import SamplingParams

Prompt = str | list[int] | list[dict]


class LLM:
    def __init__(self, model: str, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`.

        A prompt is a string, a list of token ids, or a chat (a list of OpenAI-style message dicts,
        rendered with the model's chat template, with `tools` if given; `tool_choice` as in
        `LLMEngine.add_request`).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                ids.append(
                    self.engine.add_request(
                        None,
                        params=p,
                        messages=prompt,
                        tools=tools,
                        tool_choice=tool_choice,
                        parallel_tool_calls=parallel_tool_calls,
                    )
                )
            else:
                ids.append(self.engine.add_request(None, prompt, p))
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, **kw) -> list[RequestOutput]:
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        return self.generate(messages, sampling_params, **kw)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix(gen_tok=self.engine.snapshot().generation_tokens, refresh=False)
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]
