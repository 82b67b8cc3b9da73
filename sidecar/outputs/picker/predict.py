"""What one request would cost on one endpoint, in seconds: the predicted-latency scorer's model.

For a request of P prompt tokens, of which the endpoint probably holds C (the prefix index),
expected to generate O tokens (`expected_output`: what its max_tokens says of its answer, or the
pool's mean answer when it sets none), on an endpoint with n requests (the picker's own in-flight
count or the engine's running + waiting, whichever is larger) and c slots:

    tpot(b)  = a + s * b                     time per output token at batch b (learned fit)
    S        = O_mean * tpot(c) + k * P_mean  how long one resident request holds a slot
    wait     = max(0, n + 1 - c) * S / c     the queue ahead, drained c slots at a time
    prefill  = k * (P - C)                   uncached prompt tokens at the endpoint's prefill speed
    decode   = O * tpot(min(c, n + 1))
    stall    = max(0, tpot(min(c, n)) / 2 - wait) when n >= 1, else 0
                                             the rest of the step under way: a busy engine admits an
                                             arrival at its next step, half a step later on average
                                             (tpot is the learned time per token, the prefill stalls
                                             of the steps included); a queue wait already covers it
    own      = wait + stall + prefill + decode
                                             when this request would finish there
    others   = min(n, c) * (prefill + s * min(O, O_mean / 2))
                                             what its admission costs the requests already running
                                             there: they stall through its prefill, and each of
                                             their remaining tokens is a little slower
    cost     = own + externality * others    seconds of latency added to the fleet

`wait` alone is what admission compares with a class's budget (the queue for a slot).

Every coefficient is learned per endpoint from what its engine reports (`Learner`), each
cycle from the counters' deltas between two scrapes:

    a, s     least-squares fit of the inter-token latency (histogram sum/count deltas) against
             the running batch, with exponential forgetting; the slope falls back to
             `growth` * a while the batch has not varied enough to measure it
    k        prefill seconds / prompt tokens prefilled (cached ones excluded), the prefill-phase
             histogram less one decode step per request (vLLM), or llama.cpp's own counters
    O_mean   generated tokens per finished request (the engine's per-request histogram)
    P_mean   prompt tokens prefilled per finished request
    bound    the share of finished requests that stopped at their max_tokens (vLLM's
             finished_reason="length"): how far a request's max_tokens says its answer's length

c is the endpoint's slots, or fewer when its engine is bound by its KV cache (requests wait
while slots are free: then what runs is what fits).

An endpoint whose engine reports nothing of one coefficient takes the pool's median of those
that do; a coefficient nobody reports falls back to a prior (`CostPolicy`); a pool where no
endpoint has a measured token latency is not predicted at all (the caller keeps the
weighted rule).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CostPolicy", "Estimate", "Learner", "Prediction", "Workload", "expected_output", "pool_estimates",
           "predict"]


@dataclass(frozen=True, slots=True)
class CostPolicy:
    externality: float = 1.0  # weight of the delay imposed on the endpoint's running requests
    queue_externality: float = 1.0  # weight of the delay a queued request imposes on those queued after it
    growth: float = 0.03  # prior slope of time per token per extra sequence, as a share of a
    prefill_ratio: float = 0.004  # prior prefill seconds per prompt token, as a share of tpot(1)
    default_output: int = 256  # prior output tokens per request
    # where no engine of the pool says how many answers reach their max_tokens: a request's max_tokens
    # predicts at most this many times the pool's mean answer (`expected_output`)
    output_cap: float = 2.0
    forget: float = 0.9  # per cycle, for the latency fit
    alpha: float = 0.3  # smoothing of the prefill speed and the output length
    evidence_tokens: float = 500.0  # an endpoint's own speed counts half once this many tokens measured it


@dataclass(frozen=True, slots=True)
class Estimate:
    """One endpoint's coefficients, resolved (own where measured, else the pool's, else priors)."""

    a: float  # seconds per token, batch-independent part
    s: float  # seconds per token added by each sequence in the batch
    k: float  # prefill seconds per uncached prompt token
    out: float  # mean generated tokens per request
    prompt: float = 0.0  # mean uncached prompt tokens per request
    bound: float | None = None  # share of requests that stopped at their max_tokens (None: not reported)

    def tpot(self, batch: float) -> float:
        return self.a + self.s * max(1.0, batch)


@dataclass(frozen=True, slots=True)
class Workload:
    """The request being placed."""

    prompt_tokens: int
    output_tokens: float
    cached_tokens: int  # on this endpoint


@dataclass(frozen=True, slots=True)
class Prediction:
    wait_s: float  # the queue for a slot
    prefill_s: float
    decode_s: float
    others_s: float
    cost_s: float
    stall_s: float = 0.0  # the rest of the step under way there, which it joins after

    @property
    def own_s(self) -> float:
        return self.wait_s + self.stall_s + self.prefill_s + self.decode_s


def predict(w: Workload, e: Estimate, load: float, capacity: int, policy: CostPolicy) -> Prediction:
    c = max(1, capacity)
    n = max(0.0, load)
    service = e.out * e.tpot(c) + e.k * e.prompt
    wait = max(0.0, n + 1.0 - c) * service / c
    prefill = e.k * max(0, w.prompt_tokens - w.cached_tokens)
    decode = w.output_tokens * e.tpot(min(c, n + 1.0))
    queued = max(0.0, n + 1.0 - c)
    others = min(n, c) * (prefill + e.s * min(w.output_tokens, e.out / 2.0))
    others += policy.queue_externality * queued * (prefill + decode) / c
    # a busy engine is mid-step when the request arrives: it joins the batch at the next step
    stall = max(0.0, 0.5 * e.tpot(min(c, n)) - wait) if n >= 1.0 else 0.0
    cost = wait + stall + prefill + decode + policy.externality * others
    return Prediction(wait, prefill, decode, others, cost, stall)


def expected_output(max_tokens: float, typical: float, bound: float | None, cap: float) -> float:
    """The tokens a request asking for at most `max_tokens` is expected to generate, in a pool whose
    answers average `typical` tokens. max_tokens is a bound, not a length: clients send 1,024 or 4,096
    for answers of a few hundred tokens, and taken as the length such a bound makes every worker a
    request joins look seconds slower (bench/results/max-tokens-bound: 14-47 points of prefix hits lost
    and 12-1,928 requests refused at 80 % load in the virtual-time sweep). Where the engines say what
    share of answers ran to their bound (`bound`), that share is expected to reach max_tokens and the
    rest to stop at the typical answer (never past the bound); where none says, max_tokens at most
    `cap` times the typical answer."""
    if bound is None:
        return min(max_tokens, cap * typical)
    return bound * max_tokens + (1.0 - bound) * min(max_tokens, typical)


class Learner:
    """One endpoint's learned coefficients, fed each cycle with its engine's cumulative counters.

    `observe` takes the counters of one scrape (None where the engine does not report one); a
    counter that goes down (an engine restart) restarts that coefficient's deltas."""

    __slots__ = ("_fit", "_last", "_tokens", "batch", "bound", "itl", "k", "out", "prompt")

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._fit = [0.0, 0.0, 0.0, 0.0, 0.0]  # forgetting sums: w, x, y, xx, xy
        self.k: float | None = None
        self.out: float | None = None
        self.prompt: float | None = None
        self.bound: float | None = None  # share of finished requests that stopped at their max_tokens
        self.itl: float | None = None  # the recent time per token (token-weighted, forgetting), at ...
        self.batch = 0.0  # ... this recent batch (the same weights)
        self._tokens = 0.0  # the tokens behind them (forgetting): how much to trust them

    def _delta(self, name: str, value: float | None) -> float | None:
        if value is None or not math.isfinite(value):
            self._last.pop(name, None)
            return None
        prev = self._last.get(name)
        self._last[name] = value
        if prev is None or value < prev:
            return None
        return value - prev

    def observe(self, *, running: float, itl_sum: float | None, itl_count: float | None,
                prefill_s: float | None, prefill_tokens: float | None, finished: float | None,
                finished_tokens: float | None, policy: CostPolicy, finished_bounded: float | None = None) -> None:
        d_sum, d_n = self._delta("itl_sum", itl_sum), self._delta("itl_n", itl_count)
        if d_sum is not None and d_n is not None and d_n >= 1:
            itl = d_sum / d_n
            self._add_point(running, itl, forget=policy.forget)
            # token-weighted: a cycle of three tokens says little against one of three hundred
            kept = self._tokens * 0.5
            self._tokens = kept + d_n
            share = d_n / self._tokens
            if self.itl is None:
                self.itl, self.batch = itl, running
            else:
                self.itl += share * (itl - self.itl)
                self.batch += share * (running - self.batch)
        d_prefill, d_tokens = self._delta("prefill_s", prefill_s), self._delta("prefill_tokens", prefill_tokens)
        d_done, d_done_tokens = self._delta("finished", finished), self._delta("finished_tokens", finished_tokens)
        if d_done is not None and d_done_tokens is not None and d_done >= 1:
            mean = d_done_tokens / d_done
            self.out = mean if self.out is None else self.out + policy.alpha * (mean - self.out)
        d_bounded = self._delta("finished_bounded", finished_bounded)
        if d_bounded is not None and d_done is not None and d_done >= 1:
            share = min(1.0, d_bounded / d_done)
            self.bound = share if self.bound is None else self.bound + policy.alpha * (share - self.bound)
        if d_tokens is not None and d_done is not None and d_done >= 1:
            mean = d_tokens / d_done
            self.prompt = mean if self.prompt is None else self.prompt + policy.alpha * (mean - self.prompt)
        if d_prefill is not None and d_tokens is not None and d_tokens >= 64:
            # vLLM's prefill phase ends with the first token: one decode step per request in it.
            step = self.tpot_fit(running, policy.growth) if d_done is not None else None
            requests = d_done or 0.0
            seconds = max(0.25 * d_prefill, d_prefill - (step or 0.0) * requests)
            k = seconds / d_tokens
            self.k = k if self.k is None else self.k + policy.alpha * (k - self.k)

    def _add_point(self, x: float, y: float, *, forget: float) -> None:
        """One cycle's point; every cycle counts alike (a busy cycle must not drown the others)."""
        f = self._fit
        for i in range(5):
            f[i] *= forget
        f[0] += 1.0
        f[1] += x
        f[2] += y
        f[3] += x * x
        f[4] += x * y

    def fit(self, growth: float) -> tuple[float, float] | None:
        """(a, s) of tpot(b) = a + s b; None before any latency was measured. The slope is the
        fit's; the level is the recent time per token at the recent batch (the fit's intercept
        would carry every error of its slope)."""
        raw = self._raw_fit(growth)
        if raw is None or self.itl is None:
            return raw
        s = raw[1]
        a = max(0.25 * self.itl, self.itl - s * max(1.0, self.batch))
        return a, s

    def _raw_fit(self, growth: float) -> tuple[float, float] | None:
        w, sx, sy, sxx, sxy = self._fit
        if w <= 1e-9:
            return None
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var >= 0.5:  # the batch moved by about a sequence or more: the slope is measurable
            s = (sxy / w - mx * my) / var
            s = min(max(s, 0.0), my)  # never negative, never more than the mean itself
            a = my - s * mx
            if a > 0:
                return a, s
        # the prior slope, scaled to the level measured at the mean batch
        base = my / (1.0 + growth * max(1.0, mx))
        return base, growth * base

    @property
    def evidence(self) -> float:
        """Tokens behind the measured level (with forgetting)."""
        return self._tokens

    def tpot_fit(self, batch: float, growth: float) -> float | None:
        fit = self.fit(growth)
        return None if fit is None else fit[0] + fit[1] * max(1.0, batch)


def pool_estimates(learned: Sequence[Learner | None], token_latency: Sequence[float | None],
                   policy: CostPolicy) -> list[Estimate] | None:
    """Each endpoint's coefficients: its own, else the pool's median, else the priors. `token_latency`
    is the fleet view's smoothed time per token, used where an engine has no latency histogram
    deltas yet. None when no endpoint of the pool has any measured token latency."""
    fits: list[tuple[float, float] | None] = []
    own: list[bool] = []  # the fit is the endpoint's own (else the fleet view's smoothed latency)
    for learner, tl in zip(learned, token_latency, strict=True):
        fit = learner.fit(policy.growth) if learner is not None else None
        own.append(fit is not None)
        if fit is None and tl:
            base = tl / (1.0 + policy.growth)
            fit = (base, policy.growth * base)
        fits.append(fit)
    known = [f for f in fits if f is not None]
    if not known:
        return None
    median_fit = (statistics.median(f[0] for f in known), statistics.median(f[1] for f in known))
    ks = [lr.k for lr in learned if lr is not None and lr.k is not None]
    outs = [lr.out for lr in learned if lr is not None and lr.out is not None]
    median_k = statistics.median(ks) if ks else None
    median_out = statistics.median(outs) if outs else float(policy.default_output)
    prompts = [lr.prompt for lr in learned if lr is not None and lr.prompt is not None]
    median_prompt = statistics.median(prompts) if prompts else 0.0
    bounds = [lr.bound for lr in learned if lr is not None and lr.bound is not None]
    median_bound = statistics.median(bounds) if bounds else None
    out = []
    for learner, fit, mine in zip(learned, fits, own, strict=True):
        a, s = fit if fit is not None else median_fit
        if mine and learner is not None:
            # shrunk toward the pool's level while little traffic stands behind the endpoint's own
            trust = learner.evidence / (learner.evidence + policy.evidence_tokens)
            a = trust * a + (1.0 - trust) * median_fit[0]
        k = learner.k if learner is not None and learner.k is not None else median_k
        if k is None:
            k = policy.prefill_ratio * (a + s)
        o = learner.out if learner is not None and learner.out is not None else median_out
        p = learner.prompt if learner is not None and learner.prompt is not None else median_prompt
        b = learner.bound if learner is not None and learner.bound is not None else median_bound
        out.append(Estimate(a, s, k, max(1.0, o), p, b))
    return out
