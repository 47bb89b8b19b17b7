"""The HF transformers baseline: static batching with `generate`, padded on the left.

This is what serving looked like before continuous batching: the whole batch is prefilled
together, padded to the longest prompt, and decodes until the longest output is done. Lengths
are forced by removing EOS from the generation config; for traces with unequal output lengths,
only each request's own tokens count as useful output (the rest is the padding static batching
pays for).
"""

from __future__ import annotations

import time

import torch

from octavo.bench.workloads import Workload

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFGenerate:
    def __init__(self, model: str | None, dtype: str, batch_size: int = 64) -> None:
        from transformers import AutoModelForCausalLM

        from octavo.model.hf_reference import hf_reference_dir

        self.model = AutoModelForCausalLM.from_pretrained(
            str(hf_reference_dir(model)), dtype=DTYPES[dtype]
        ).eval()
        gc = self.model.generation_config
        gc.eos_token_id = None  # forced lengths: nothing may stop a row early
        gc.pad_token_id = 0
        gc.do_sample = False
        gc.temperature = gc.top_p = gc.top_k = None
        self.batch_size = batch_size

    @torch.inference_mode()
    def run(self, wl: Workload) -> dict[str, float]:
        t0 = time.perf_counter()
        useful = generated = 0
        reqs = list(wl.requests)
        for i in range(0, len(reqs), self.batch_size):
            batch = reqs[i : i + self.batch_size]
            width = max(r.prompt_len for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, r in enumerate(batch):  # left padding: every row ends at the same column
                ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
                mask[row, width - r.prompt_len :] = 1
            steps = max(r.output_len for r in batch)
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps,
                                      min_new_tokens=steps)
            assert out.shape[1] == width + steps, "HF stopped early: lengths were not forced"
            useful += sum(r.output_len for r in batch)
            generated += len(batch) * steps
        return {"elapsed_s": time.perf_counter() - t0, "output_tokens": useful,
                "generated_tokens": generated}
