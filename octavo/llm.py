"""The offline API, with vLLM's names: LLM(...).generate / chat / stats."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from octavo.engine.engine import LLMEngine
from octavo.engine_args import EngineArgs, from_kwargs
from octavo.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from octavo.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """An LLM for offline inference over a paged KV cache.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        """`engine_options`: any field of octavo.engine_args.EngineArgs (vLLM's names:
        dtype, block_size, max_model_len, max_num_seqs, enable_prefix_caching, ...)."""
        self.engine = LLMEngine(from_kwargs(model=model, **engine_options))
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        return cls(**args.as_dict())

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                    "pass one, or one per prompt"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        requests = [
            dict(prompt=prompt, params=p, priority=priority[i] if priority else 0)
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
        ]
        return self._submit_and_run(requests, use_tqdm)

    def beam_search(
        self,
        prompts: Seq[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over copy-on-write forks: beams share blocks, a dying beam frees its own.

        Returns, per prompt, up to `beam_width` sequences best first (tokens include the prompt,
        as vLLM's BeamSearchSequence).
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        finished = self._submit_and_run(
            [dict(prompt=prompt, beam_params=params) for prompt in prompts], use_tqdm
        )
        results = []
        for out in finished:
            results.append(BeamSearchOutput(sequences=[
                BeamSearchSequence(
                    tokens=out.prompt_token_ids + o.token_ids,
                    cum_logprob=o.cumulative_logprob or 0.0,
                    text=o.text,
                    finish_reason=o.finish_reason,
                )
                for o in out.outputs
            ]))
        return results

    def _submit_and_run(self, requests: list[dict], use_tqdm: bool) -> list[RequestOutput]:
        """Add every request, run them to completion, return outputs in input order. On any
        error (bad input, a failed step, Ctrl-C) all of them are aborted: no block is leaked."""
        ids = [f"{next(self._ids)}" for _ in requests]
        try:
            for rid, kwargs in zip(ids, requests, strict=True):
                self.engine.add_request(rid, **kwargs)
            finished = self._run(ids, use_tqdm)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [finished[rid] for rid in ids]

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        wanted = set(ids)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    finished[out.request_id] = out
                    in_tokens += len(out.prompt_token_ids)
                    out_tokens += sum(len(o.token_ids) for o in out.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(
                        f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                        f"output: {out_tokens / elapsed:.2f} toks/s"
                    )
                    bar.update(1)
        bar.close()
        return finished

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(
        self, conversation: list[dict[str, str]], add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[int]:
        tok = self.engine.tokenizer
        if chat_template is None and not tok.chat_template:
            raise ValueError("the model's tokenizer has no chat template; pass chat_template=")
        ids = tok.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
            chat_template=chat_template, return_dict=False,
        )
        return list(ids)

    def stats(self) -> dict[str, int | float | str]:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this LLM is garbage
        collected, and when the process exits)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
