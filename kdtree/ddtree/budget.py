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
  start (`measure_cut_cost`), and F, the rest of a step: the median of the last 5 of the host's intervals between
  steps, each minus the attention's time at the b and prefixes of the step it times, taken only where that step's
  neighbours are of its kind (tree or chain: a switch costs an interval of its own, which is no arm's).
Until F and rho have a sample, and whenever kdtree does not compute the verify (modes other than on: SGLang's kernel
computes every row, so a cut saves nothing), every b costs the same and the cap wins.

The chain, auto's other arm (`CHAIN`, offered when the worker captured a target verify of the chain's width): a step
of DFlash's own chain, B tokens, costs exactly a chain step, which a tree cut to the chain's size does not (the MLP, the
MoE and lm_head still run the cap's rows). tokens(chain) = bs * (1 + rho * E_chain), E_chain the drafter's expected
run of top-1 tokens (the draft graph's head computes it every step), rho the same calibration (a chain step observes
it as accepted over E_chain); seconds(chain) = F_chain + the chain's attention (kdtree's kernel at B tokens, timed with the
rest), F_chain learnt from the intervals after chain steps as F from the tree's. A tree is chosen over the chain
only if it promises `chain_margin` (5%) more tokens a second. Each kind's F is a time only its own steps observe,
so after `explore_every` (64) steps of one kind the best of the other runs for `explore_run` (3) steps (after 4 while
the other has fewer than 3 samples); each exploration that leaves the choice where it was doubles that interval, up to
`explore_max` (256), and a change of kind sets it back. Not offered under tensor parallelism: each rank's host chooses
on its own, and a step's kind must agree on every rank.

The policy is plain Python on host numbers (this module imports torch only in `measure_cut_cost`), tested on the CPU.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
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


CHAIN = 0  # auto's other arm: DFlash's chain step (a tree has at least one node, so no budget is 0)


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


@dataclass
class BudgetPolicy:
    """See the module. `choose` before a step, `observe` with a step's statistics when they reach the host."""

    budgets: Sequence[int]
    cost: VerifyCost | None
    chain: bool = False  # CHAIN is offered (the cost model then has its time)
    explore_every: int = 64  # steps of one kind (tree, chain) before one of the other
    # ... doubled after each exploration that leaves the choice where it was, up to explore_max, and back to
    # explore_every when the kind changes: an exploration that confirms costs a step's worth of time (at 32k on the
    # H200, a tree step 0.86 ms over a chain step, 3 steps in 64: 0.3% of the chain's rate)
    explore_max: int = 256
    # how much more than the chain's tokens a second a tree must promise to be chosen over it: the two kinds' F are
    # learnt from different steps, and the model's error between them was at least 3% on the H100 (batch 4, paper
    # profile, 2k: trees chosen over the chain ran at 0.97x of it); the chain is the baseline auto must not lose to
    chain_margin: float = 0.05
    # steps of the other kind an exploration runs: a sample of F is a step's whose neighbours are of its kind (a
    # switch's own cost must not count as the arm's), and under the overlap scheduler the middle one of 3 is that
    explore_run: int = 3
    weight: float = 0.2  # of a new sample in each average (acceptance)
    max_gap_s: float = (
        1.0  # a longer interval between two steps is not a step's time (idle, a prefill between)
    )
    chosen: Counter = field(default_factory=Counter)  # steps at each budget
    window: int = 5  # F and F_chain: the median of each one's last `window` samples
    _fixed: dict[bool, deque] = field(default_factory=dict)  # is the chain -> its last samples
    _expected: dict[int, float] = field(default_factory=dict)  # E(b) a request
    _accepted: float | None = None  # drafted tokens a request accepted, at the budget verified
    _expected_verified: float | None = None  # E of the budget verified, the same steps
    # the choices between a step and the host's interval that times it: 1 under SGLang's overlap scheduler, which
    # launches step k and then waits for step k - 1's results, so the interval after choosing k times step k - 1
    lag: int = 0
    # (time, b, sum of prefixes, kdtree served) of the last lag + 2 choices since an interruption
    _recent: deque = field(default_factory=deque)
    _explore_left: int = 0  # steps left of an exploration's run
    _streak: int = 0  # steps of the last choice's kind (tree or chain) in a row
    _last_kind_is_chain: bool = False
    _interval: int = 0  # steps of one kind before an exploration now (explore_every .. explore_max)
    _explored_from: bool | None = None  # the kind (is the chain) a running exploration left

    def __post_init__(self):
        self.budgets = tuple(sorted(self.budgets))
        if not self.budgets or self.budgets[0] < 1:
            raise ValueError(f"budgets must be positive (got {self.budgets})")
        if not 0 <= self.chain_margin < 1:
            raise ValueError(f"chain_margin must be at least 0 and below 1 (got {self.chain_margin})")
        if not 1 <= self.explore_every <= self.explore_max:
            raise ValueError(f"explore_every must be at least 1 and at most explore_max (got {self.explore_every}, "
                             f"{self.explore_max})")  # fmt: skip
        self._interval = self.explore_every
        if self.explore_run < self.lag + 2:
            raise ValueError(f"explore_run must be at least lag + 2 (got {self.explore_run}, lag {self.lag}): its "
                             "middle steps are the only ones timed clear of a switch")  # fmt: skip
        if self.cost is not None and any(b not in self.cost.fixed for b in self.arms):
            raise ValueError(f"the cost model has no time for some of the choices {self.arms}")

    @property
    def cap(self) -> int:
        return self.budgets[-1]

    @property
    def arms(self) -> tuple[int, ...]:
        """What a step may verify, in the order of the statistics `observe` takes: the budgets, then CHAIN if offered."""
        return (*self.budgets, CHAIN) if self.chain else self.budgets

    def interrupt(self) -> None:
        """A step of another kind (a prefill) ran since the last choice: the next interval is not a decode step's."""
        self._recent.clear()

    def choose(self, now: float, bs: int, sum_prefix: int, serving: bool, chain_ok: bool = True) -> int:
        """The budget (or CHAIN) for a decode step of bs requests whose prefixes sum to sum_prefix, at host time `now`
        (seconds); serving: kdtree computes this step's verify (mode on); chain_ok: the chain can run this batch."""
        self._learn_fixed(now)
        if not serving:
            # an exploration cut short by a mode change learnt nothing: it neither ran nor confirmed
            self._explore_left, self._explored_from = 0, None
        b = self._best(bs, sum_prefix, chain_ok) if serving else self.cap
        if self._last_kind_is_chain == (b == CHAIN):
            self._streak += 1
        else:
            self._streak = 1
        self._last_kind_is_chain = b == CHAIN
        self._recent.append((now, b, sum_prefix, serving))
        while len(self._recent) > self.lag + 2:
            self._recent.popleft()
        self.chosen[b] += 1
        return b

    def _learn_fixed(self, now: float) -> None:
        """The interval since the last choice times the step chosen `lag` choices before it; a sample of its kind's F
        only where the step before it and the `lag` after it are of its kind too. A switch between the tree and the
        chain costs an interval of its own (on the H100 at batch 4 the F of a kind run once in 64 steps, each time
        between steps of the other, came out 0.8-4.4 ms above its F in a run of its own), and that cost belongs to
        no arm: counted in the one explored, it held off the kind that was not running whichever it was."""
        if not self._recent:
            return
        if not 0 < now - self._recent[-1][0] <= self.max_gap_s:
            self._recent.clear()  # idle between: the next intervals time no step
            return
        if len(self._recent) < self.lag + 2 or self.cost is None:
            return  # that step, or the one before it, was chosen before an interruption
        _, b, sum_prefix, serving = self._recent[-(self.lag + 1)]
        if not serving or len({c == CHAIN for _, c, _, _ in self._recent}) > 1:
            return  # its verify was not kdtree's, or a switch is among its neighbours
        sample = max(0.0, (now - self._recent[-1][0]) - self.cost.seconds(b, sum_prefix))
        self._fixed.setdefault(b == CHAIN, deque(maxlen=self.window)).append(sample)

    @property
    def fixed_s(self) -> float | None:
        """F: a median, not a mean, because one interval can be far off (a kernel compiled at its first use in a new
        shape took 250 ms on the H100 beside 10 ms steps) and a mean would carry it for dozens of samples, which an
        arm chosen once in `explore_every` steps takes thousands of steps to gather."""
        return self._median(False)

    @property
    def chain_fixed_s(self) -> float | None:
        """F_chain, as F."""
        return self._median(True)

    def _median(self, chain: bool) -> float | None:
        samples = self._fixed.get(chain)
        return statistics.median(samples) if samples else None

    def expected_accepted(self, b: int) -> float | None:
        """Drafted tokens a request is expected to accept at b (rho * E(b)); None before any statistics."""
        if b not in self._expected or self._accepted is None:
            return None
        rho = self._accepted / self._expected_verified if self._expected_verified else 1.0
        return rho * self._expected[b]

    def _rate(self, b: int, bs: int, sum_prefix: int) -> float:
        fixed = self.chain_fixed_s if b == CHAIN else self.fixed_s
        return bs * (1.0 + self.expected_accepted(b)) / (fixed + self.cost.seconds(b, sum_prefix))

    def _best(self, bs: int, sum_prefix: int, chain_ok: bool) -> int:
        if self.cost is None or self.fixed_s is None or self._accepted is None:
            return self.cap
        tree, tree_rate = self.cap, -math.inf
        for b in self.budgets:  # ascending, >= keeps the larger of equal rates
            rate = self._rate(b, bs, sum_prefix)
            if rate >= tree_rate:
                tree, tree_rate = b, rate
        if not (self.chain and chain_ok) or self.expected_accepted(CHAIN) is None:
            self._explore_left, self._explored_from = 0, None  # an exploration cut short confirms nothing
            return tree
        if self.chain_fixed_s is None:  # its first timed steps (a few: what never gets timed is not offered)
            return CHAIN if self.chosen[CHAIN] < 8 else tree
        if self._explore_left > 0:  # an exploration's run goes on
            self._explore_left -= 1
            return CHAIN if self._last_kind_is_chain else tree
        # a tie, and anything within the margin, to the chain
        best = CHAIN if self._rate(CHAIN, bs, sum_prefix) * (1.0 + self.chain_margin) >= tree_rate else tree
        if self._explored_from is not None:  # the first choice after an exploration: did it move the choice?
            kept = (best == CHAIN) == self._explored_from
            self._interval = min(2 * self._interval, self.explore_max) if kept else self.explore_every
            self._explored_from = None
        elif (best == CHAIN) != self._last_kind_is_chain:  # the kind changed on its own: the rates moved
            self._interval = self.explore_every
        # the other kind once in a while, so that its F stays current: every `_interval` steps, or after 4 while it
        # has fewer than 3 samples (a median of 1 or 2 may still be an outlier's), for explore_run steps
        other = len(self._fixed.get(best != CHAIN, ()))
        if (best == CHAIN) == self._last_kind_is_chain and self._streak >= (
            self._interval if other >= 3 else 4
        ):
            self._explore_left = self.explore_run - 1
            if other >= 3:
                self._explored_from = best == CHAIN
            return tree if best == CHAIN else CHAIN
        return best

    def observe(self, chosen: int, bs: int, accepted: Sequence[float], expected: Sequence[float]) -> None:
        """A step's statistics, summed over its bs requests, one entry an arm (`arms`: `cut_stats`, then the chain's):
        drafted tokens accepted within each (valid at the chosen one, and within a tree's budgets below it) and the
        expected lengths E(b) and E_chain; NaN where the step did not measure it (a chain step walks no tree)."""
        if bs < 1:
            return
        for b, a, e in zip(self.arms, accepted, expected, strict=True):
            if math.isnan(e) or (b == chosen and math.isnan(a)):
                continue
            self._expected[b] = _ema(self._expected.get(b), e / bs, self.weight)
            if b == chosen:
                self._accepted = _ema(self._accepted, a / bs, self.weight)
                self._expected_verified = _ema(self._expected_verified, e / bs, self.weight)

    def snapshot(self) -> dict:
        """What the rank record shows of the policy."""
        return {
            "budgets": list(self.budgets),
            "steps_at": {
                arm_name(b): n for b, n in sorted(dict(self.chosen).items())
            },  # a copy: the serving thread adds
            "fixed_ms": None if self.fixed_s is None else round(self.fixed_s * 1e3, 3),
            "chain_fixed_ms": None if self.chain_fixed_s is None else round(self.chain_fixed_s * 1e3, 3),
            "expected_accepted": {
                arm_name(b): None if (x := self.expected_accepted(b)) is None else round(x, 3)
                for b in self.arms
            },
        }


def arm_name(b: int) -> str:
    """How the rank record and the metrics name a choice: the budget, or "chain"."""
    return "chain" if b == CHAIN else str(b)


def measure_cut_cost(
    heads: int,
    cap: int,
    budgets: Sequence[int],
    layers: int,
    device,
    prefixes: tuple[int, int] = (4096, 32768),
    chain_tokens: int | None = None,
) -> VerifyCost:
    """kdtree's kernel timed as the cut runs it: a CUDA graph of one call at N = cap + 1 (batch 1, `heads` query heads,
    bf16 pool), replayed with q_live = b + 1 for each budget, at two prefix lengths; the line through the two gives
    fixed and per_key of each budget. With chain_tokens (the chain's B), CHAIN's line too: a graph of its own at N = B,
    as the chain's own captured verify runs it. About 20 ms of replays a prefix on an H200. Runs at start (it
    synchronises)."""
    import torch

    from kdtree import kernel
    from kdtree.reference import kdtree_call, make_batch

    if prefixes[1] <= prefixes[0]:
        raise ValueError(f"the two prefixes must increase (got {prefixes})")
    shapes = [(cap + 1, {b: b + 1 for b in budgets})]  # (tokens captured, {choice: live tokens})
    if chain_tokens is not None:
        shapes.append((chain_tokens, {CHAIN: chain_tokens}))
    times: dict[int, list[float]] = {b: [] for _, lives in shapes for b in lives}
    live = torch.zeros(1, dtype=torch.int32, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for P in prefixes:
        for N, lives in shapes:
            batch = make_batch(1, heads, N, P, device=str(device), spare_slots=0)
            out = torch.empty(N, heads * 512, dtype=torch.bfloat16, device=device)
            ws = torch.empty(kernel.workspace_bytes(1, heads, N, device), dtype=torch.uint8, device=device)
            live.fill_(N)
            kdtree_call(batch, out, ws, q_live=live)  # outside the graph: lazy initialisation
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                kdtree_call(batch, out, ws, q_live=live)
            for b, tokens in lives.items():
                live.fill_(tokens)
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
