"""Serving traffic shaped like real users, for the SLO benchmarks: chat and agent sessions.

A `Traffic` is a list of sessions; a session is one or more turns sent one after another, each
turn a token-id prompt and a forced output length (ignore_eos), exact on every server.

- **chat**: one turn per session: a system prompt every request shares (~1,000 tokens) plus a
  user turn of ShareGPT's lognormal shape. A server with prefix caching computes the system
  prompt once.
- **agent**: multi-turn sessions (a coding agent's loop): a system prompt with tool schemas
  shared by every session, then per turn the model's answer and a tool result are appended and
  the whole growing history is sent again. The answer resent is a seeded stand-in of the
  length the server produced (the client sends token ids, not the server's own tokens), so a
  prefix cache hits the history up to the previous turn's prompt.

Everything is seeded: every server sees the same sessions, turn lengths and think times.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from octavo.bench.workloads import _ids, _lognormal


@dataclass(frozen=True, slots=True)
class Turn:
    prompt_token_ids: tuple[int, ...]
    output_len: int
    think_s: float = 0.0  # pause after the previous turn's answer before this one is sent

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class Traffic:
    name: str
    sessions: tuple[tuple[Turn, ...], ...]
    max_model_len: int
    params: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s) for s in self.sessions)

    @property
    def turns(self) -> list[Turn]:
        return [t for s in self.sessions for t in s]

    def describe(self) -> dict:
        turns = self.turns
        n = max(len(turns), 1)
        return {
            "name": self.name,
            "sessions": len(self.sessions),
            "requests": len(turns),
            "mean_prompt_len": round(sum(t.prompt_len for t in turns) / n, 1),
            "mean_output_len": round(sum(t.output_len for t in turns) / n, 1),
            "max_total_len": max((t.prompt_len + t.output_len for t in turns), default=0),
            "max_model_len": self.max_model_len,
            **self.params,
        }

    def session_starts(self, rate: float, seed: int) -> list[float]:
        """Poisson session arrivals such that `rate` requests per second are offered on
        average (a session of k turns counts k); rate=inf starts every session at once."""
        if math.isinf(rate):
            return [0.0] * len(self.sessions)
        per_session = self.num_requests / max(len(self.sessions), 1)
        rng = random.Random(seed)
        t, out = 0.0, []
        for _ in self.sessions:
            t += rng.expovariate(rate / per_session)
            out.append(t)
        return out


def _length(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    return min(max(lo, round(_lognormal(rng, mean, sigma))), hi)


def chat(num_requests: int, *, system_len: int = 1000, mean_in: float = 161,
         mean_out: float = 128, max_out: int = 256, max_model_len: int = 2048,
         vocab: int = 49152, seed: int = 0, turn_seed: int | None = None) -> Traffic:
    """One-turn sessions: a shared system prompt plus a ShareGPT-shaped user turn (lognormal,
    sigma 1.0 in, 0.8 out; outputs capped at `max_out`, prompt + output within the context).
    `turn_seed`: draw the user turns from their own seed, the system prompt still from `seed`
    (fresh turns behind the same system prompt, e.g. one set per offered rate)."""
    if system_len + 8 >= max_model_len:
        raise ValueError(f"system prompt of {system_len} tokens leaves no room in a "
                         f"{max_model_len}-token context")
    rng = random.Random(seed)
    system = _ids(rng, system_len, vocab)
    if turn_seed is not None:
        rng = random.Random(turn_seed)
    sessions = []
    for _ in range(num_requests):
        room = max_model_len - system_len
        user = _length(rng, mean_in, 1.0, 4, room // 2)
        out = _length(rng, mean_out, 0.8, 1, min(max_out, room - user))
        sessions.append((Turn(system + _ids(rng, user, vocab), out),))
    return Traffic("chat", tuple(sessions), max_model_len,
                   {"seed": seed, "turn_seed": turn_seed, "system_len": system_len,
                    "mean_in": mean_in,
                    "mean_out": mean_out, "max_out": max_out})


def agent(num_sessions: int, *, turns: int = 4, system_len: int = 1000, first_len: int = 200,
          mean_tool: float = 150, mean_out: float = 96, max_out: int = 192,
          mean_think_s: float = 0.5, max_model_len: int = 4096, vocab: int = 49152,
          seed: int = 0, turn_seed: int | None = None) -> Traffic:
    """Sessions of up to `turns` turns resending their growing history: system prompt (tool
    schemas, shared by every session) + the task, then per turn the previous answer and a tool
    result (lognormal, sigma 0.8). A session ends early when its next turn would not fit.
    `turn_seed`: as in chat()."""
    rng = random.Random(seed)
    system = _ids(rng, system_len, vocab)
    if turn_seed is not None:
        rng = random.Random(turn_seed)
    sessions = []
    for _ in range(num_sessions):
        history = system + _ids(rng, first_len, vocab)
        session: list[Turn] = []
        for k in range(turns):
            out = _length(rng, mean_out, 0.8, 1, max_out)
            if len(history) + out > max_model_len:
                break
            think = 0.0 if k == 0 else rng.expovariate(1 / mean_think_s) if mean_think_s else 0.0
            session.append(Turn(history, out, think))
            tool = _length(rng, mean_tool, 0.8, 4, max_model_len)
            history = history + _ids(rng, out, vocab) + _ids(rng, tool, vocab)
        if not session:
            raise ValueError(f"an agent session's first turn ({len(system) + first_len} "
                             f"tokens) does not fit a {max_model_len}-token context")
        sessions.append(tuple(session))
    return Traffic("agent", tuple(sessions), max_model_len,
                   {"seed": seed, "turn_seed": turn_seed, "turns": turns,
                    "system_len": system_len,
                    "first_len": first_len, "mean_tool": mean_tool, "mean_out": mean_out,
                    "max_out": max_out, "mean_think_s": mean_think_s})
