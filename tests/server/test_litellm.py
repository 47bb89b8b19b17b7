"""LiteLLM against the server: an over-long prompt must become LiteLLM's
ContextWindowExceededError (which drives its fallback routing). LiteLLM recognises the condition
only by the wording of the error, so the server words it as vLLM and OpenAI do."""

from __future__ import annotations

import os

import pytest

from tests.server.conftest import RunningServer

# LiteLLM's own import-time noise
pytestmark = pytest.mark.filterwarnings("ignore:Items? .* ReadOnly:UserWarning")


@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    return pytest.importorskip("litellm")


def test_an_over_long_prompt_is_a_context_window_error(litellm, tiny_server: RunningServer):
    kw = dict(model="hosted_vllm/tiny", api_base=tiny_server.v1, api_key="unused",
              num_retries=0, timeout=60)
    ok = litellm.completion(messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kw)
    assert ok.choices[0].message.content is not None
    for max_tokens in (16, None):  # prompt + completion too long; the prompt alone too long
        with pytest.raises(litellm.ContextWindowExceededError) as info:
            litellm.completion(messages=[{"role": "user", "content": "x" * 600}],
                               max_tokens=max_tokens, **kw)
        assert "maximum context length is 512 tokens" in str(info.value)
    with pytest.raises(litellm.BadRequestError) as other:  # other 400s stay what they are
        litellm.completion(messages=[{"role": "user", "content": "hi"}], temperature=-1, **kw)
    assert not isinstance(other.value, litellm.ContextWindowExceededError)
