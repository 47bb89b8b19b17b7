"""RequestOutputKind: what each output carries. CUMULATIVE (the default) repeats everything so
far, DELTA only the step's additions (which add up to the cumulative output), FINAL_ONLY one
output at the end; the scheduler alone applies the stops the output processor finds."""

from __future__ import annotations

import pytest

from octavo.outputs import CompletionOutput, RequestOutput
from octavo.sampling_params import RequestOutputKind, SamplingParams

PROMPT = {"prompt_token_ids": [1, 5, 9, 14, 3]}


def _run(engine, params: SamplingParams) -> list[RequestOutput]:
    engine.add_request("r", PROMPT, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == "r"]
    return outputs


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir):
    from octavo.engine.engine import LLMEngine
    from octavo.engine_args import EngineArgs

    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=64))
    yield engine
    engine.shutdown()


def params(kind: RequestOutputKind, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2,
                          output_kind=kind, **kw)


def test_deltas_add_up_to_the_cumulative_outputs(tiny_engine):
    cumulative = _run(tiny_engine, params(RequestOutputKind.CUMULATIVE))
    deltas = _run(tiny_engine, params(RequestOutputKind.DELTA))
    assert len(deltas) == len(cumulative) == 24
    assert [len(d.outputs[0].token_ids) for d in deltas] == [1] * 24
    merged = deltas[0]
    for d in deltas[1:]:
        merged.add(d)
    final = cumulative[-1].outputs[0]
    assert merged.outputs[0].token_ids == final.token_ids
    assert merged.outputs[0].text == final.text
    assert merged.outputs[0].logprobs == final.logprobs
    assert merged.finished and merged.outputs[0].finish_reason == "length"


def test_cumulative_outputs_copy_everything_so_far_and_deltas_do_not(tiny_engine):
    processor = tiny_engine.output_processor
    before = processor.tokens_copied
    _run(tiny_engine, params(RequestOutputKind.CUMULATIVE))
    cumulative = processor.tokens_copied - before
    before = processor.tokens_copied
    _run(tiny_engine, params(RequestOutputKind.DELTA))
    delta = processor.tokens_copied - before
    assert cumulative == sum(range(1, 25))  # 1 + 2 + ... + 24: it grows with the length
    assert delta == 24


def test_final_only_gives_one_output_and_metrics_still_see_every_step(tiny_engine):
    touched = 0
    tiny_engine.add_request("r", PROMPT, params(RequestOutputKind.FINAL_ONLY))
    outputs = []
    while tiny_engine.has_unfinished_requests():
        outputs += [o for o in tiny_engine.step() if o.request_id == "r"]
        touched += sum(p.request_id == "r" for p in tiny_engine.step_progress)
    assert len(outputs) == 1 and outputs[0].finished
    assert len(outputs[0].outputs[0].token_ids) == 24
    assert touched == 24


def test_a_stop_string_in_a_delta_stream_ends_the_text_before_it(tiny_engine):
    full = _run(tiny_engine, params(RequestOutputKind.CUMULATIVE))[-1].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string here")
    cut = full[: full.index(stop)]
    deltas = _run(tiny_engine, params(RequestOutputKind.DELTA, stop=[stop]))
    assert "".join(d.outputs[0].text for d in deltas) == cut
    assert deltas[-1].outputs[0].finish_reason == "stop"
    assert deltas[-1].outputs[0].stop_reason == stop
    assert tiny_engine.kv.stats()["kv_blocks_used"] == 0


def test_output_kind_must_be_a_request_output_kind():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_merging_deltas_appends_per_sequence():
    a = RequestOutput("r", None, [1], None, [CompletionOutput(0, "ab", [3, 4], None, None)],
                      False)
    b = RequestOutput("r", None, [1], None, [CompletionOutput(0, "c", [5], None, None, "stop"),
                                             CompletionOutput(1, "x", [9], None, None)], True)
    a.add(b)
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in a.outputs] == [
        (0, "abc", [3, 4, 5], "stop"), (1, "x", [9], None)]
    assert a.finished
