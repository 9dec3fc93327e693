"""DDTREE's auto budget (KDTREE_DDTREE_BUDGET=auto): each decode step verifies the first b nodes of the tree, b chosen
among `cut_budgets(cap)`, the captured budget `cap` (--speculative-num-draft-tokens - 1) and the 2^k - 1 below it.

Why a cut: the tree's node order is best-first with parents first, so its first b nodes are exactly the tree of budget b
(Algorithm 1 stopped at b). The verify graph stays captured at N = cap + 1; the kernel reads each request's live
token count on the device (kdtree_verify_args.q_live) and computes only those rows, and the walk treats the nodes past
the cut as absent. So b moves only the verify's attention, the part of a step that grows with the prefix: the MLP, the
MoE, lm_head and the drafter run at N rows whatever b is, and the captured budget stays the user's cap.

The choice, made on the host before each step from what earlier steps left in pinned memory (never waiting on the
device): b = argmax over the budgets of tokens(b) / seconds(b), ties to the larger b.
- tokens(b) = bs * (1 + rho * E(b)): E(b) is the tree's sum of exp(score) over its first b nodes (the drafter's
  expected accepted length of that tree: Proposition 1 of the DDTree paper), averaged over requests and steps; rho the
  drafter's calibration, the drafted tokens accepted over the E of the budget verified, averaged over the same steps.
  Every step observes E at every budget and rho at the one it verified, so no budget's estimate goes stale while
  another is chosen. One rho for every budget, not one a budget: a budget's own ratio is observed only when it or a
  larger one is verified, and the noise of a few steps' acceptance (a geometric count) then decides the choice.
- seconds(b) = F + the verify attention's time at b for the batch's prefixes: `VerifyCost`, kdtree's kernel timed at
  start (`measure_cut_cost`), and F, the rest of a step, an average of the host's interval between steps minus the
  attention's time at the b and prefixes of the step before.
Until F and rho have a sample, and whenever kdtree does not compute the verify (modes other than on: SGLang's kernel
computes every row, so a cut saves nothing), every b costs the same and the cap wins.

The policy is plain Python on host numbers (this module imports torch only in `measure_cut_cost`), tested on the CPU.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


def cut_budgets(cap: int) -> tuple[int, ...]:
    """The budgets auto chooses among: 3, 7, 15, 31, ... below the captured budget, and the captured budget.

    Budgets of 2^k - 1 nodes verify 2^k tokens, whole row tiles of the kernel (64 rows of token x head: 8 tokens at 8
    heads a rank, 4 at 16), so a cut pays for no padded tile. At 8 heads and 32k on an H100, 17 tokens (b = 16, three
    tiles) cost 78 us a layer and 9 tokens (two tiles, as b = 15's 16) 65: one node more for a fifth more time."""
    if cap < 1:
        raise ValueError(f"the captured budget must be at least 1 (got {cap})")
    return tuple([b for b in ((4 << i) - 1 for i in range(12)) if b < cap] + [cap])


@dataclass(frozen=True)
class VerifyCost:
    """Seconds of the verify's attention a step when the tree is cut at b: layers * (fixed[b] + per_key[b] * the sum
    of the batch's prefixes), from kdtree's kernel timed at two prefix lengths (a request's work grows linearly in its
    prefix, and the kernel spreads one request over the device, so a batch's time is about its prefixes' sum's)."""

    layers: int
    fixed: dict[int, float]
    per_key: dict[int, float]

    def seconds(self, b: int, sum_prefix: int) -> float:
        return self.layers * (self.fixed[b] + self.per_key[b] * sum_prefix)


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


@dataclass
class BudgetPolicy:
    """See the module. `choose` before a step, `observe` with a step's statistics when they reach the host."""

    budgets: Sequence[int]
    cost: VerifyCost | None
    weight: float = 0.2  # of a new sample in each average
    max_gap_s: float = (
        1.0  # a longer interval between two steps is not a step's time (idle, a prefill between)
    )
    chosen: Counter = field(default_factory=Counter)  # steps at each budget
    fixed_s: float | None = None  # F
    _expected: dict[int, float] = field(default_factory=dict)  # E(b) a request
    _accepted: float | None = None  # drafted tokens a request accepted, at the budget verified
    _expected_verified: float | None = None  # E of the budget verified, the same steps
    _last: tuple[float, int, int, bool] | None = (
        None  # (time, b, sum of prefixes, kdtree served) of the last choice
    )

    def __post_init__(self):
        self.budgets = tuple(sorted(self.budgets))
        if not self.budgets or self.budgets[0] < 1:
            raise ValueError(f"budgets must be positive (got {self.budgets})")
        if self.cost is not None and any(b not in self.cost.fixed for b in self.budgets):
            raise ValueError(f"the cost model has no time for some of the budgets {self.budgets}")

    @property
    def cap(self) -> int:
        return self.budgets[-1]

    def interrupt(self) -> None:
        """A step of another kind (a prefill) ran since the last choice: the next interval is not a decode step's."""
        self._last = None

    def choose(self, now: float, bs: int, sum_prefix: int, serving: bool) -> int:
        """The budget for a decode step of bs requests whose prefixes sum to sum_prefix, at host time `now` (seconds);
        serving: kdtree computes this step's verify (mode on)."""
        self._learn_fixed(now)
        b = self._best(bs, sum_prefix) if serving else self.cap
        self._last = (now, b, sum_prefix, serving)
        self.chosen[b] += 1
        return b

    def _learn_fixed(self, now: float) -> None:
        last, self._last = self._last, None
        if last is None or self.cost is None or not last[3]:
            return
        t, b, sum_prefix, _ = last
        if 0 < now - t <= self.max_gap_s:
            sample = max(0.0, (now - t) - self.cost.seconds(b, sum_prefix))
            self.fixed_s = _ema(self.fixed_s, sample, self.weight)

    def expected_accepted(self, b: int) -> float | None:
        """Drafted tokens a request is expected to accept at b (rho * E(b)); None before any statistics."""
        if b not in self._expected or self._accepted is None:
            return None
        rho = self._accepted / self._expected_verified if self._expected_verified else 1.0
        return rho * self._expected[b]

    def _best(self, bs: int, sum_prefix: int) -> int:
        if self.cost is None or self.fixed_s is None or self._accepted is None:
            return self.cap
        best, best_rate = self.cap, -math.inf
        for b in self.budgets:  # ascending, >= keeps the larger of equal rates
            rate = bs * (1.0 + self.expected_accepted(b)) / (self.fixed_s + self.cost.seconds(b, sum_prefix))
            if rate >= best_rate:
                best, best_rate = b, rate
        return best

    def observe(self, chosen: int, bs: int, accepted: Sequence[float], expected: Sequence[float]) -> None:
        """A step's statistics, summed over its bs requests, one entry a budget (`cut_stats`): drafted tokens accepted
        within each budget (valid up to the chosen one) and the trees' E(b)."""
        if bs < 1:
            return
        for b, a, e in zip(self.budgets, accepted, expected, strict=True):
            self._expected[b] = _ema(self._expected.get(b), e / bs, self.weight)
            if b == chosen:
                self._accepted = _ema(self._accepted, a / bs, self.weight)
                self._expected_verified = _ema(self._expected_verified, e / bs, self.weight)

    def snapshot(self) -> dict:
        """What the rank record shows of the policy."""
        return {
            "budgets": list(self.budgets),
            "steps_at": {
                str(b): n for b, n in sorted(dict(self.chosen).items())
            },  # a copy: the serving thread adds
            "fixed_ms": None if self.fixed_s is None else round(self.fixed_s * 1e3, 3),
            "expected_accepted": {
                str(b): None if (x := self.expected_accepted(b)) is None else round(x, 3)
                for b in self.budgets
            },
        }


def measure_cut_cost(
    heads: int,
    cap: int,
    budgets: Sequence[int],
    layers: int,
    device,
    prefixes: tuple[int, int] = (4096, 32768),
) -> VerifyCost:
    """kdtree's kernel timed as the cut runs it: a CUDA graph of one call at N = cap + 1 (batch 1, `heads` query heads,
    bf16 pool), replayed with q_live = b + 1 for each budget, at two prefix lengths; the line through the two gives
    fixed and per_key of each budget. About 20 ms of replays a prefix on an H200. Runs at start (it synchronises)."""
    import torch

    from kdtree import kernel
    from kdtree.reference import kdtree_call, make_batch

    if prefixes[1] <= prefixes[0]:
        raise ValueError(f"the two prefixes must increase (got {prefixes})")
    times: dict[int, list[float]] = {b: [] for b in budgets}
    live = torch.zeros(1, dtype=torch.int32, device=device)
    for P in prefixes:
        batch = make_batch(1, heads, cap + 1, P, device=str(device), spare_slots=0)
        out = torch.empty(cap + 1, heads * 512, dtype=torch.bfloat16, device=device)
        ws = torch.empty(kernel.workspace_bytes(1, heads, cap + 1, device), dtype=torch.uint8, device=device)
        live.fill_(cap + 1)
        kdtree_call(batch, out, ws, q_live=live)  # outside the graph: lazy initialisation
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kdtree_call(batch, out, ws, q_live=live)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for b in budgets:
            live.fill_(b + 1)
            for _ in range(3):
                graph.replay()
            rounds = []
            for _ in range(5):
                start.record()
                for _ in range(4):
                    graph.replay()
                end.record()
                end.synchronize()
                rounds.append(start.elapsed_time(end) / 4e3)  # seconds a call
            times[b].append(sorted(rounds)[2])
        del graph, batch, out, ws
    span = prefixes[1] - prefixes[0]
    per_key = {b: max(0.0, (t[1] - t[0]) / span) for b, t in times.items()}
    fixed = {b: max(0.0, t[0] - per_key[b] * prefixes[0]) for b, t in times.items()}
    return VerifyCost(layers=layers, fixed=fixed, per_key=per_key)
