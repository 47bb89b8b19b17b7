"""Speculative decoding on the scheduler's side: which drafts each decode carries, what the
verification kept, and the metrics (vLLM's names).

Each step, a decoding sequence may carry up to `num_speculative_tokens` draft tokens
(ngram_proposer.py); the runner verifies them in the same forward pass as the rest of the batch
and the scheduler keeps what was accepted. Drafts are not free: every draft token is computed
whether it is kept or not, and while the step computes it the whole batch waits. The cost model
weighs that per sequence:

- a step's time is fitted online as t(T) = base + per_token * T over the steps' token counts
  (decayed least squares of measured steps; a prior until the counts vary);
- a sequence's acceptance rate alpha (the chance the next draft token is accepted once the ones
  before it were) is estimated from its own verifications, decayed, so it follows the text; a
  sequence not speculating keeps it fresh by checking the first token of the draft it would
  have sent against the token it then sampled (it costs nothing);
- k drafts are expected to yield E_k = 1 + alpha + ... + alpha^k tokens instead of 1, and to
  cost per_token * k seconds of the step, in which the batch would have produced
  per_token * k * (tokens sampled per step / t(T)) tokens. The sequence gets the k that maximises
  the gain E_k - 1 minus that loss, and no draft when no k gains. At batch 1 this speculates
  while alpha is worth the extra tokens; in a full batch it stops, as it should.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.config import SpeculativeConfig
from octavo.engine.ngram_proposer import propose_ngram

# a draft token's cost as a share of a one-token step, until measured steps say otherwise
PRIOR_PER_TOKEN_SHARE = 0.05
STEP_DECAY = 0.97  # weight of a measured step after each later one (about the last 30 count)
SEQ_DECAY = 0.9  # the same for a sequence's verifications (about the last 10 count)
PRIOR_ALPHA = 0.5  # a new sequence's acceptance rate, worth PRIOR_WEIGHT verified tokens
PRIOR_WEIGHT = 1.0


@dataclass(slots=True)
class DraftState:
    """One sequence's acceptance record (kept on the Sequence)."""

    accepted: float = 0.0  # decayed count of accepted draft tokens
    tested: float = 0.0  # decayed count of draft tokens verified (accepted or the one rejected)
    shadow: int | None = None  # first token of a draft not sent this step, to check
    idle: int = 0  # steps since it last drafted (a model's drafts are probed now and then)
    probe_every: int = 0  # steps between probes: PROBE_EVERY, doubling while they fail

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.tested + PRIOR_WEIGHT)

    def record(self, accepted: int, tested: int) -> None:
        self.accepted = self.accepted * SEQ_DECAY + accepted
        self.tested = self.tested * SEQ_DECAY + tested


class StepCostModel:
    """t(T) = base + per_token * T, fitted to measured (tokens, seconds) by decayed least
    squares."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.last_tokens = 1
        self.last_sampled = 1

    def observe(self, num_tokens: int, num_sampled: int, seconds: float) -> None:
        d = STEP_DECAY
        x, y = float(num_tokens), float(seconds)
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.last_tokens = max(1, num_tokens)
        self.last_sampled = max(1, num_sampled)

    def fit(self) -> tuple[float, float]:
        """(base, per_token) in seconds; base > 0 and per_token > 0."""
        if self._w <= 0:
            return 1.0, PRIOR_PER_TOKEN_SHARE
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > 0.25:  # the token counts varied enough to fit a slope
            slope = (self._xy / self._w - mx * my) / var
            base = my - slope * mx
            if slope > 0 and base > 0:
                return base, slope
        # one token count so far: split its mean time by the prior share
        base = my / (1.0 + PRIOR_PER_TOKEN_SHARE * mx)
        return base, base * PRIOR_PER_TOKEN_SHARE

    def draft_token_cost(self) -> float:
        """Tokens the batch loses to one more draft token in a step like the last one."""
        base, per_token = self.fit()
        step = base + per_token * self.last_tokens
        return per_token * self.last_sampled / step


def expected_tokens(alpha: float, k: int) -> float:
    """1 + alpha + ... + alpha^k: the tokens a step with k drafts yields, on average."""
    return sum(alpha**i for i in range(k + 1))


def best_num_drafts(alpha: float, max_k: int, token_cost: float) -> int:
    best, best_gain = 0, 0.0
    for k in range(1, max_k + 1):
        gain = expected_tokens(alpha, k) - 1.0 - token_cost * k
        if gain > best_gain + 1e-12:
            best, best_gain = k, gain
    return best


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode_* counters."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def as_stats(self) -> dict[str, int | float]:
        s: dict[str, int | float] = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
        for pos, n in enumerate(self.accepted_per_pos):
            s[f"spec_decode_num_accepted_tokens_per_pos_{pos}"] = n
        return s


# a sequence a model has stopped drafting for gets one draft after this many steps, then
# after twice as many while the probes keep failing, up to PROBE_MAX
PROBE_EVERY = 16
PROBE_MAX = 256


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.cost = StepCostModel()
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        # what drafting one token costs beyond verifying it, in tokens of a step: a drafting
        # model's share of the target's layers (the engine sets it; n-gram drafting is free)
        self.draft_token_share = 0.0

    def propose(self, state: DraftState, token_ids: list[int], room: int
                ) -> tuple[list[int], int]:
        """(draft tokens, number of drafts) a decoding sequence with `token_ids` carries this
        step: n-gram drafts are proposed here; a drafting model's are left to the runner
        (no tokens, only their number). `room`: draft tokens it may take (the step's token
        budget, max_tokens and max_model_len left)."""
        c = self.config
        state.shadow = None
        max_k = min(c.num_speculative_tokens, room, self.max_model_len - len(token_ids))
        if max_k < 1:
            return [], 0
        if c.drafts_in_runner:
            if not c.cost_model:
                return [], max_k
            cost = self.cost.draft_token_cost() + self.draft_token_share
            k = best_num_drafts(state.alpha, max_k, cost)
            if k:
                state.idle, state.probe_every = 0, PROBE_EVERY
                return [], k
            state.idle += 1
            state.probe_every = state.probe_every or PROBE_EVERY
            if state.idle >= state.probe_every:  # keep its acceptance rate fresh, ever less
                state.idle, state.probe_every = 0, min(2 * state.probe_every, PROBE_MAX)
                return [], 1
            return [], 0
        draft = propose_ngram(token_ids, max_k, c.prompt_lookup_min, c.prompt_lookup_max)
        if not draft or not c.cost_model:
            return draft, len(draft)
        k = best_num_drafts(state.alpha, len(draft), self.cost.draft_token_cost())
        if k == 0:
            state.shadow = draft[0]
        return draft[:k], k

    def record(self, state: DraftState, num_drafts: int, sampled: list[int]) -> None:
        """A step's verification: `sampled` are the tokens the sequence got (the accepted
        drafts, then one more)."""
        if num_drafts == 0:
            if state.shadow is not None and sampled:
                state.record(int(sampled[0] == state.shadow), 1)
            state.shadow = None
            return
        accepted = len(sampled) - 1
        state.record(accepted, accepted + (accepted < num_drafts))
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += num_drafts
        st.num_accepted_tokens += accepted
        for pos in range(accepted):
            st.accepted_per_pos[pos] += 1
