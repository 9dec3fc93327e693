"""An oracle set-up for DDTREE and DFLASH in the real server (GPU only): a target whose greedy continuation is known and
a drafter whose candidates are scripted, so that accepted lengths and tokens can be predicted.

- The target becomes a bigram map: every attention and MLP output projection is zeroed (o_proj, down_proj, the
  experts' w2), so each position's last hidden state is its token's embedding; the final norm's weight is set to
  ones and lm_head's row perm(x) to HEAD_SCALE * embed(x), so the greedy next token after x is perm(x) =
  (A x + C) mod V. The greedy continuation of a prompt ending in x is perm(x), perm(perm(x)), ... The scale makes
  perm(x)'s logit hundreds above any other (dummy weights are ~1e-3), so a sampled request (temperature 1, any
  top-p or top-k) draws that continuation too.
- The drafter is scripted by where the true token perm^d(root) sits among depth d's candidates (`Script`):
  - fixed ranks (DDTREE_ORACLE_RANKS, comma-separated, one a drafted depth): the same every step, log-probs
    log-softmax(-STEEP * rank); the tree is the same every step and how deep the true path reaches into it is what
    `expected_accepted` computes with the reference heap (kdtree.ddtree.reference): the tests' exact checks;
  - a rank profile (DDTREE_ORACLE_PROFILE, a file: P(rank r) for r = 0, 1, ...; PROFILES): each true token's rank
    is drawn from the profile, on the device, by a hash of the token itself (`uniform_of`); the log-probs are the
    profile's, so the tree is the best one for it. Accepted lengths then average `expected_tree_accepted` (DDTREE) or
    `expected_chain_accepted` (DFLASH): the benchmark's. Drawn by token, every algorithm meets the same luck at the
    same token of a continuation (common random numbers: a chain and a tree are compared on the same draws, where
    separate random streams left a token of spread in a row's accept length), and the draws are still those of a
    fresh draw a step: a walk observes a token's rank once (past its first miss, the target's own token is committed
    there and the next step drafts after it; tokens past a miss are not observed).
  DDTREE's candidates are `TreeDraftSampler.candidates` (and `candidates_from_logits`); DFLASH's chain is its
  captured draft head (`_DflashDraftSampler`), which drafts the true token where the script puts it at rank 0 and
  another one elsewhere. Under auto, DDTREE's chain (`TreeDraftSampler.chain`: a chain step's head) runs on the real
  logits for its cost, then takes the same scripted tokens and the script's E_chain.

It says what it measures: the system (the tree, the verify, the walk, the commit's bookkeeping and the scheduler's
handling of accepted tokens), not a drafter. With the attention's output zeroed, the verify's attention does not
reach the outputs (it still runs, at its full cost), so the KV cache's contents are not what this checks.

The teacher (DDTREE_ORACLE_TEACHER=<file>, beside fixed ranks) checks them: the target is left untouched (attention
live, no bigram), and the true token after x is read from a next-token table (`Teacher`) that the test writes from a
server without speculation's greedy outputs, so the drafter proposes the target's own continuation and most drafted
tokens are accepted. Every accepted token's KV (what the commit kept, in the slots it permuted) is then read by the
later steps' attention: a wrong slot or a stale row changes the target's tokens, and the greedy outputs part from the
reference's. A token the table does not know (or whose successors disagree) drafts another token, which the target
rejects.

Enabled in a server process by either variable: the engine site's sitecustomize calls `install_after_import()`, which
patches SGLang's DFlash worker module and kdtree.ddtree.worker as they are imported.

Apart from the oracle, DDTREE_SYNC_REPORT=<file> (any DDTREE server) runs every decode step of DDTreeWorker under
torch.cuda.set_sync_debug_mode("warn") and keeps in that file (JSON) the steps seen and each host synchronisation
torch reported, with the line of kdtree's or SGLang's code that asked for it. DDTREE_HOST_REPORT=<folder> (any
DDTREE or DFLASH server) times the host side of the worker's decode steps (`install_host_report`): where a step's
Python goes, DDTREE's against DFlash's chain, and how long the scheduler's loop waits for each step's results (near
zero: the host sets the period).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import math
import os
import sys

A, C = 7, 13  # perm(x) = (A x + C) mod V: a permutation when A is prime to V (V = 8192 in the tests' model)
STEEP = 1.0
HEAD_SCALE = 1000.0
ENV = "DDTREE_ORACLE_RANKS"
PROFILE_ENV = "DDTREE_ORACLE_PROFILE"
SYNC_ENV = "DDTREE_SYNC_REPORT"
HOST_ENV = "DDTREE_HOST_REPORT"
TEACHER_ENV = "DDTREE_ORACLE_TEACHER"
# "chain": DDTREE's auto policy chooses its chain arm wherever that can run (the GPU suite's check that a chain step
# is DFlash's own: the same accepted lengths as DFLASH on the same script)
ARM_ENV = "DDTREE_FORCE_ARM"
# The benchmark's two acceptance profiles (P(the true token at rank r) at every drafted depth, independently).
# "paper": matched to the mean acceptance lengths the DDTree paper reports, not to per-depth rates: a block-16 chain
# accepts 5.86 drafted tokens a step (tau 6.86, DFlash's range on math and code) and the best tree of 256 nodes 9.12
# (tau 10.1, DDTree's at its best budgets). "pessimistic": a weak drafter, where a chain accepts 1.5 a step.
PROFILES = {"paper": (0.87, 0.06, 0.025, 0.01, 0.005), "pessimistic": (0.6, 0.15, 0.05)}


def perm(x: int, vocab: int) -> int:
    return (A * x + C) % vocab


def continuation(last_token: int, n: int, vocab: int) -> list[int]:
    out, x = [], last_token
    for _ in range(n):
        x = perm(x, vocab)
        out.append(x)
    return out


def scripted_lp(K: int) -> list[float]:
    logits = [-STEEP * k for k in range(K)]
    top = max(logits)
    lse = top + math.log(sum(math.exp(v - top) for v in logits))
    return [v - lse for v in logits]


def expected_accepted(ranks: list[int], K: int, budget: int) -> int:
    """Drafted tokens a step accepts: how deep the rank path `ranks` reaches into the tree the reference heap
    builds from the scripted log-probs (float32 sums, as the GPU builder adds them)."""
    from kdtree.ddtree.reference import build_ddtree_tree, follow_verified_tree

    L = len(ranks)
    lp = [scripted_lp(K)] * L
    ids = [list(range(K))] * L  # token = rank at every depth: the true child at depth d has token ranks[d-1]
    tree = build_ddtree_tree(lp, ids, budget, root_token=0)
    parents, tokens = tree.parents, tree.tokens
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    target = [ranks[depth[i]] if depth[i] < L else -2 for i in range(len(parents))]
    path, _ = follow_verified_tree(parents, tokens, target)
    return len(path) - 1


class Script:
    """Where the true token sits among each drafted depth's candidates: fixed ranks (ENV: the same every step), or
    a rank profile (PROFILE_ENV: a file; each step draws every depth's rank independently, P(rank r) = profile[r],
    and with the remaining probability the true token is not a candidate). The file is read again when it changes
    (a host-to-device copy between steps), so one server serves several profiles in turn."""

    MAX_RANKS = 16

    def __init__(self, ranks: list[int] | None = None, profile_path: str | None = None):
        self.fixed, self.path = ranks, profile_path
        self.profile: tuple[float, ...] | None = None
        self._seen = None  # the profile file's (mtime, size) last read
        self._cdf = None  # device float32 [MAX_RANKS]: the profile's cumulative sums, padded with the total
        self._fixed_dev = None
        if self.path is not None:
            self.profile = read_profile(self.path)

    def check(self, L: int, K: int | None) -> None:
        if self.fixed is not None and (len(self.fixed) != L or (K is not None and max(self.fixed) >= K)):
            raise ValueError(f"{ENV}={self.fixed}: one rank below K={K} for each of the L={L} drafted depths")

    def lp(self, K: int) -> list[float]:
        return scripted_lp(K) if self.profile is None else profile_lp(self.profile, K)

    def prepare(self, device) -> None:
        """Before any capture (a host-to-device copy cannot run inside one): the device tensors the draws read."""
        import torch

        if self.fixed is not None:
            self._fixed_dev = torch.tensor(self.fixed, dtype=torch.int64, device=device)
        else:
            self.refresh(device)

    def refresh(self, device) -> bool:
        """Between steps (host code): re-read a changed profile file into the device. True if it changed."""
        import torch

        if self.path is None:
            return False
        st = os.stat(self.path)
        if self._cdf is not None and (st.st_mtime_ns, st.st_size) == self._seen:
            return False
        self.profile = read_profile(self.path)
        cdf = [sum(self.profile[: r + 1]) for r in range(len(self.profile))]
        cdf += [cdf[-1]] * (self.MAX_RANKS - len(cdf))
        host = torch.tensor(cdf, dtype=torch.float32)
        if self._cdf is None:
            self._cdf = host.to(device)
        else:
            self._cdf.copy_(host)
        self._seen = (st.st_mtime_ns, st.st_size)
        return True

    def ranks(self, tokens):
        """int64, tokens' shape [bs, L]: the rank of each drafted depth's true token (`tokens`) among the depth's
        candidates (MAX_RANKS: not a candidate): fixed ranks by depth, or a profile's draw by the token (module
        docstring). Tensor ops only (graph-safe: no host read)."""
        import torch

        if self._fixed_dev is None and self._cdf is None:
            self.prepare(tokens.device)
        if self.fixed is not None:
            return self._fixed_dev.expand_as(tokens)
        return torch.searchsorted(self._cdf, uniform_of(tokens), right=True)


def uniform_of(tokens):
    """float32 in [0, 1), tokens' shape: a token's draw, the same wherever and whenever it is drafted (a 32-bit
    integer hash, Wellons' lowbias32 after a golden-ratio multiply; every constant below 2^32 and every product below
    2^63, so int64 arithmetic never overflows for a vocabulary below 2^31)."""
    x = (tokens.long() * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x735A2D97) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    return (x >> 8).float() / float(1 << 24)  # 24 bits: exact in float32, so never 1.0


def true_tokens(root, L: int, vocab: int):
    """int64 [bs, L]: the target's greedy continuation of each root: perm^d(root) for d = 1..L under the bigram
    target, the teacher's table followed d times under the teacher (`Teacher.follow`)."""
    import torch

    if _teacher is not None:
        return _teacher.follow(root, L, vocab)
    out, tok = [], root
    for _ in range(L):
        tok = (A * tok + C) % vocab
        out.append(tok)
    return torch.stack(out, dim=1)


class Teacher:
    """The live-attention oracle's next-token table (module docstring): a JSON list with one entry a token id, the
    token that follows it in the reference's greedy outputs, or -1 where none or several do. Read again when the file
    changes (a host-to-device copy between steps), so that a server started before its reference ran learns the table
    once the test writes it; until then every entry is -1."""

    def __init__(self, path: str):
        self.path = path
        self._seen = None
        self.table = None  # device int64 [vocab]

    def prepare(self, device, vocab: int) -> None:
        """Before any capture: the device table, every entry -1, then the file's if it is there."""
        import torch

        if self.table is None:
            self.table = torch.full((vocab,), -1, dtype=torch.int64, device=device)
        self.refresh()

    def refresh(self) -> bool:
        """Between steps (host code): a changed file into the device table. True if it changed."""
        import json

        import torch

        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        if self.table is None or (st.st_mtime_ns, st.st_size) == self._seen:
            return False
        entries = json.loads(open(self.path).read())
        if len(entries) != self.table.numel():
            raise ValueError(f"{self.path}: {len(entries)} entries, the vocabulary has {self.table.numel()}")
        self.table.copy_(torch.tensor(entries, dtype=torch.int64))
        self._seen = (st.st_mtime_ns, st.st_size)
        return True

    def follow(self, root, L: int, vocab: int):
        """int64 [bs, L]: the table followed from each root; an unknown entry continues with the next token id (a
        draft the target will reject). Tensor ops only (graph-safe)."""
        import torch

        out, tok = [], root.long()
        for _ in range(L):
            nxt = self.table[tok]
            tok = torch.where(nxt >= 0, nxt, (tok + 1) % vocab)
            out.append(tok)
        return torch.stack(out, dim=1)


def teacher_table(outputs: list[list[int]], vocab: int) -> list[int]:
    """The table `Teacher` reads, from greedy token sequences (each the prompt's last token, then its output): for
    every token, the token that follows it everywhere, or -1 where none or several different ones do."""
    table, clash = [-1] * vocab, set()
    for seq in outputs:
        for x, y in zip(seq, seq[1:], strict=False):
            if x in clash:
                continue
            if table[x] not in (-1, y):
                table[x] = -1
                clash.add(x)
            else:
                table[x] = y
    return table


_teacher: Teacher | None = Teacher(os.environ[TEACHER_ENV]) if os.environ.get(TEACHER_ENV) else None


def read_profile(path: str) -> tuple[float, ...]:
    """A profile file: one line of comma-separated probabilities, rank 0 first, non-increasing, summing to at most
    1 (the rest: the true token is not a candidate)."""
    text = open(path).read().strip()
    try:
        p = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"{path}: a profile is comma-separated probabilities, rank 0 first (got {text!r})"
        ) from None
    if not (
        0 < len(p) <= Script.MAX_RANKS
        and all(0 < x <= 1 for x in p)
        and all(p[i] >= p[i + 1] for i in range(len(p) - 1))
        and sum(p) <= 1 + 1e-9
    ):
        raise ValueError(
            f"{path}: a profile is 1 to {Script.MAX_RANKS} probabilities in (0, 1], non-increasing, summing to at "
            f"most 1 (got {text!r})"
        )
    return p


def write_profile(path, profile: tuple[float, ...]) -> None:
    """A profile file (`read_profile`'s), replaced whole: a server never reads half a profile."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(",".join(repr(p) for p in profile))
    os.replace(tmp, path)


def profile_lp(profile: tuple[float, ...], K: int) -> list[float]:
    """The drafter's log-probs under a profile (each depth alike): log profile[r], then the remaining probability
    spread over the other K - R ranks (kept non-increasing). The tree built from them is the tree that maximises
    the expected accepted length under the profile (the paper's Prop. 2 with q the true distribution)."""
    R = len(profile)
    rest = max(1.0 - sum(profile), 1e-30) / max(K - R, 1)
    return [math.log(x) for x in profile[:K]] + [math.log(min(profile[-1], rest))] * max(K - R, 0)


def expected_chain_accepted(profile: tuple[float, ...], L: int) -> float:
    """Drafted tokens a DFLASH chain of L depths accepts per step on average: sum over d of profile[0]^d."""
    return sum(profile[0] ** d for d in range(1, L + 1))


def expected_tree_accepted(profile: tuple[float, ...], K: int, budget: int, L: int) -> float:
    """Drafted tokens a DDTREE step accepts on average: the sum over the tree's nodes of the probability that the
    true path passes through the node (the paper's Prop. 1), the tree built by the reference heap."""
    from kdtree.ddtree.reference import build_ddtree_tree

    tree = build_ddtree_tree([profile_lp(profile, K)] * L, [list(range(K))] * L, budget)
    return sum(math.prod(profile[r] if r < len(profile) else 0.0 for r in ranks) for ranks in tree.ranks[1:])


def _script_from_env() -> Script | None:
    if os.environ.get(ENV) and os.environ.get(PROFILE_ENV):
        raise ValueError(f"set one of {ENV} (fixed ranks) and {PROFILE_ENV} (a profile file), not both")
    if os.environ.get(ENV):
        return Script(ranks=[int(r) for r in os.environ[ENV].split(",")])
    if os.environ.get(PROFILE_ENV):
        return Script(profile_path=os.environ[PROFILE_ENV])
    return None


def _make_bigram(model, vocab: int) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "w2_weight")):
                p.zero_()
        model.model.norm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        x = torch.arange(vocab, device=head.device)
        head[:vocab].zero_()
        head[(A * x + C) % vocab] = (HEAD_SCALE * embed[:vocab]).to(head.dtype)


def install_sync_report(worker_module, path: str) -> None:
    import json
    import warnings

    import torch

    worker_cls = worker_module.DDTreeWorker
    step = worker_cls.forward_batch_generation
    # standin_syncs: those inside the torch stand-ins of SGLang's compiled kernels (standins/torch_standins.py: on the
    # device the compiled packages cannot be installed, and a stand-in reads its inputs back to the host where the
    # real kernel, e.g. the chain's sampled acceptance in auto's chain arm, runs on the device): counted, not a finding
    report = {"decode_steps": 0, "syncs": [], "standin_syncs": 0}
    # the first set_sync_debug_mode warns once that the mode is a prototype: let it warn here, outside any step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.set_sync_debug_mode("default")

    def forward_batch_generation(self, batch, *args, **kwargs):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle():
            return step(self, batch, *args, **kwargs)
        torch.cuda.synchronize()  # the step's own work only
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return step(self, batch, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                report["decode_steps"] += 1
                for w in seen:
                    if "synchroniz" in str(w.message) and w.filename.endswith("torch_standins.py"):
                        report["standin_syncs"] += 1
                    elif "synchroniz" in str(w.message):
                        report["syncs"].append(
                            {"message": str(w.message)[:300], "at": f"{w.filename}:{w.lineno}"}
                        )
                with open(path, "w") as f:
                    json.dump(report, f)

    worker_cls.forward_batch_generation = forward_batch_generation


def install_host_report(
    worker_cls,
    folder: str,
    skip: int = 20,
    plain: int = 60,
    profiled: int = 60,
    scheduler_cls=None,
    clock=None,
) -> None:
    """The host's time in `worker_cls.forward_batch_generation`'s decode steps, into <folder>/<pid>-<class>.json (two
    steps after the plain window) and .txt (after the profiled one): after `skip` steps, `plain` steps timed (the
    call's host time, and the interval between consecutive calls: under overlap scheduling the scheduler's period,
    the step's wall time), then `profiled` steps under cProfile (its tables in the .txt: the functions by own and by
    cumulative time; a benchmark's rounds that overlap this window are slowed by it). A host time near the interval means the
    step waits on the host, not the GPU. Given SGLang's Scheduler class, also how long its loop waits for each
    decode step's results during the plain window (`process_batch_result`'s copy_done, waited for here first): near
    zero, the loop is as long as the GPU's step or longer, and the host sets the period. And, in the plain window,
    the GPU's time in each phase of the step (`gpu_phase_ms`: events recorded in the stream at the step's start and
    end and around the draft forward, the target's verify and the drafter's KV append, `clock()` making each; CUDA
    events with timing by default): with the host waiting on results, the GPU sets the period, and the phases say
    where it goes; `between_steps` is the GPU's time from one step's end to the next one's start."""
    import cProfile
    import io
    import itertools
    import json
    import pstats
    import statistics
    import time

    os.makedirs(folder, exist_ok=True)  # a missing folder would end the server at the report's write
    if clock is None:
        import torch

        def clock():
            return torch.cuda.Event(enable_timing=True)

    step = worker_cls.forward_batch_generation
    prof = cProfile.Profile()
    st = {"n": 0, "last": None, "fresh": 0, "host": [], "interval": [], "wait": [], "timing": False}
    marks: list[list] = []  # per timed step: (phase, event) in stream order
    base = os.path.join(folder, f"{os.getpid()}-{worker_cls.__name__}")

    def mark(name: str) -> None:
        if st["timing"] and marks:
            event = clock()
            event.record()
            marks[-1].append((name, event))

    def around(obj, attr: str, name: str) -> None:
        """obj.attr marked before and after each call, patched once on the instance."""
        fn = getattr(obj, attr, None)
        if fn is None or getattr(fn, "_phase_marked", False):
            return

        def marked(*args, **kwargs):
            mark(name)
            try:
                return fn(*args, **kwargs)
            finally:
                mark(name + " end")

        marked._phase_marked = True
        setattr(obj, attr, marked)

    def gpu_phases() -> dict:
        """Per phase (from a mark to the next), its ms in each timed step that had it, and their mean and median
        (a window can span two requests whose steps differ)."""
        spans: dict[str, list[float]] = {}
        previous_end = None
        for step_marks in marks:
            if previous_end is not None and step_marks:
                spans.setdefault("between_steps", []).append(previous_end.elapsed_time(step_marks[0][1]))
            for (name, a), (_, b) in itertools.pairwise(step_marks):
                spans.setdefault(name, []).append(a.elapsed_time(b))
            previous_end = step_marks[-1][1] if step_marks and step_marks[-1][0] == "end" else None
        return {
            k: {
                "mean": round(statistics.fmean(v), 4),
                "median": round(statistics.median(v), 4),
                "each": [round(x, 4) for x in v],
            }
            for k, v in spans.items()
        }

    def write_times(self) -> None:
        def ms(xs):
            if not xs:
                return None
            return {
                "mean": 1e3 * statistics.fmean(xs),
                "median": 1e3 * statistics.median(xs),
                "each": [round(1e3 * x, 3) for x in xs],
            }

        last = next((m[-1][1] for m in reversed(marks) if m), None)
        if last is not None:
            last.synchronize()  # the window's events are done by now; this one wait (once, past the plain window) makes sure
        with open(base + ".json", "w") as f:
            json.dump(
                {
                    "worker": worker_cls.__name__,
                    "verify_tokens": int(getattr(self, "speculative_num_draft_tokens", 0)),
                    "budget_setting": os.environ.get("KDTREE_DDTREE_BUDGET"),
                    "steps_timed": len(st["host"]),
                    "steps_profiled": profiled,
                    "host_ms": ms(st["host"]),
                    "interval_ms": ms(st["interval"]),
                    "scheduler_wait_ms": ms(st["wait"]),
                    "gpu_phase_ms": gpu_phases() if marks else None,
                },
                f,
            )

    def write_profile_tables() -> None:
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        for key in ("tottime", "cumulative"):
            stats.sort_stats(key).print_stats(40)
        with open(base + ".txt", "w") as f:
            f.write(out.getvalue())

    def forward_batch_generation(self, batch, *args, **kwargs):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle():
            # a prefill is not a decode step's period: under overlap the second decode step after it still waits
            # for the prefill's result, so neither of the next two intervals is one
            st["last"], st["timing"], st["fresh"] = None, False, 2
            if marks and marks[-1]:
                marks.append([])  # nor is the GPU's time across it
            return step(self, batch, *args, **kwargs)
        n, t0 = st["n"], time.perf_counter()
        st["n"] = n + 1
        if st["last"] is not None and not st["fresh"] and skip <= n < skip + plain:
            st["interval"].append(t0 - st["last"])
        st["fresh"] = max(0, st["fresh"] - 1)
        st["last"] = t0
        st["timing"] = skip <= n < skip + plain
        profiling = skip + plain <= n < skip + plain + profiled
        if st["timing"]:
            around(getattr(self, "draft_model_runner", None), "forward", "draft")
            around(getattr(self, "target_worker", None), "forward_batch_generation", "verify")
            around(self, "_append_target_hidden_to_draft_kv_by_loc", "append")
            marks.append([])
            mark("start")
        if profiling:
            prof.enable()
        try:
            return step(self, batch, *args, **kwargs)
        finally:
            mark("end")
            if profiling:
                prof.disable()
                if n == skip + plain + profiled - 1:
                    write_profile_tables()
            elif skip <= n < skip + plain:
                st["host"].append(time.perf_counter() - t0)
            if (
                n == skip + plain + 1
            ):  # the window's last results have been waited for (overlap's one-step lag)
                write_times(self)

    worker_cls.forward_batch_generation = forward_batch_generation
    if scheduler_cls is None:
        return
    process = scheduler_cls.process_batch_result

    def process_batch_result(self, batch, result, *args, **kwargs):
        # Under overlap this is step n - 1's result, handled after step n's launch: the window is one step early.
        # The wait comes before the original's own bookkeeping, so it is an upper bound of the loop's wait.
        done = getattr(result, "copy_done", None)
        if st["timing"] and done is not None and batch.forward_mode.is_decode():
            t0 = time.perf_counter()
            done.synchronize()  # the original's own wait then returns at once
            st["wait"].append(time.perf_counter() - t0)
        return process(self, batch, result, *args, **kwargs)

    scheduler_cls.process_batch_result = process_batch_result


def force_arm(policy_cls, arm: str) -> None:
    """The auto policy's choice forced to `arm` ("chain") wherever the step can run it, from the first step."""
    from kdtree.ddtree.budget import CHAIN

    if arm != "chain":
        raise ValueError(f"{ARM_ENV}={arm!r}: the one arm it forces is 'chain'")
    best = policy_cls._best

    def chain_first(self, bs, sum_prefix, chain_ok):
        return CHAIN if self.chain and chain_ok else best(self, bs, sum_prefix, chain_ok)

    policy_cls._best = chain_first


def _scheduler_cls():
    """SGLang's Scheduler, when its module is loaded (a server's scheduler process imports it before any worker)."""
    return getattr(sys.modules.get("sglang.srt.managers.scheduler"), "Scheduler", None)


def install(worker_module) -> None:
    """kdtree.ddtree.worker, just imported: the sync and host reports, and the scripted tree candidates."""
    if os.environ.get(SYNC_ENV):
        install_sync_report(worker_module, os.environ[SYNC_ENV])
    if os.environ.get(HOST_ENV):
        install_host_report(worker_module.DDTreeWorker, os.environ[HOST_ENV], scheduler_cls=_scheduler_cls())
    if os.environ.get(ARM_ENV):
        force_arm(worker_module.BudgetPolicy, os.environ[ARM_ENV])
    script = _script_from_env()
    if script is None:
        return
    import torch

    from kdtree.ddtree.tree import chain_expected

    sampler_cls, worker_cls = worker_module.TreeDraftSampler, worker_module.DDTreeWorker

    def candidates(self, hs, root):
        bs, L, K = root.shape[0], self.L, self.K
        vocab = int(self.lm_head.org_vocab_size)
        ks = torch.arange(K, device=root.device)
        true = true_tokens(root, L, vocab)
        rank = script.ranks(true)  # [bs, L]; K or more: the true token is not among the K
        lp = self.oracle_lp.expand(bs, L, K).contiguous()
        row = (true[:, :, None] + 1 + ks) % vocab  # K tokens other than the true one
        ids = torch.where(ks == rank[:, :, None], true[:, :, None], row)
        return lp, ids

    def candidates_from_logits(self, logits, root):
        return candidates(self, None, root)

    real_chain = sampler_cls.chain

    def chain(self, logits, root, o):
        # the split head's chain runs on the real logits (its cost), then takes the script's tokens as DFLASH's
        # scripted head drafts them (the true token where it is at rank 0) and the script's E_chain
        bs, L = root.shape[0], self.L
        real_chain(self, logits, root, o)
        vocab = int(self.lm_head.org_vocab_size)
        true = true_tokens(root, L, vocab)
        o.chain[:bs].copy_(torch.where(script.ranks(true) == 0, true, (true + 1) % vocab))
        o.chain_expected[:bs].copy_(self.oracle_chain_expected.expand(bs))

    sampler_init = sampler_cls.__init__

    def sampler_init_with_lp(self, *args, **kwargs):
        sampler_init(self, *args, **kwargs)
        script.check(self.L, self.K)
        script.prepare(self.captured.parents.device)
        if _teacher is not None:
            _teacher.prepare(self.captured.parents.device, int(self.lm_head.org_vocab_size))
        # made before any capture (a host-to-device copy cannot run inside one); a profile rewrites it in place
        self.oracle_lp = torch.tensor(
            script.lp(self.K), dtype=torch.float32, device=self.captured.parents.device
        )
        self.oracle_chain_expected = torch.zeros((), dtype=torch.float32, device=self.oracle_lp.device)
        set_chain_expected(self)

    step = worker_cls.forward_batch_generation

    def forward_batch_generation(self, batch, *args, **kwargs):
        if script.refresh(self.device) and self._tree_sampler is not None:  # a new profile: its log-probs too
            lp = self._tree_sampler.oracle_lp
            lp.copy_(torch.tensor(script.lp(int(lp.numel())), dtype=lp.dtype))
            set_chain_expected(self._tree_sampler)
        if _teacher is not None:
            _teacher.refresh()
        return step(self, batch, *args, **kwargs)

    def set_chain_expected(sampler):  # E_chain of the script's log-probs: its rank-0 one at every depth
        lp0 = sampler.oracle_lp[:1].expand(1, sampler.L)
        sampler.oracle_chain_expected.copy_(chain_expected(lp0)[0])

    sampler_cls.__init__ = sampler_init_with_lp
    sampler_cls.candidates = candidates
    sampler_cls.candidates_from_logits = candidates_from_logits
    sampler_cls.chain = chain
    worker_cls.forward_batch_generation = forward_batch_generation


def install_dflash(dflash_module) -> None:
    """sglang.srt.speculative.dflash_worker_v2, just imported: the bigram target (for DFLASH and DDTREE, whose worker
    is a DFlashWorkerV2) and, for DFLASH, a scripted chain: at depth d the captured draft head proposes the true
    token perm^d(root) where the script puts it at rank 0, else another token (a chain drafts its rank-0 tokens).
    And the host report of DFlash's own decode steps. Under the teacher the target is left as it is."""
    if os.environ.get(HOST_ENV):
        install_host_report(
            dflash_module.DFlashWorkerV2, os.environ[HOST_ENV], scheduler_cls=_scheduler_cls()
        )
    script = _script_from_env()
    if script is None:
        return
    import torch

    worker_cls, sampler_cls = dflash_module.DFlashWorkerV2, dflash_module._DflashDraftSampler
    original_init = worker_cls.__init__

    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        device = torch.device("cuda", torch.cuda.current_device())
        vocab = int(target_worker.model_runner.model_config.vocab_size)
        script.prepare(device)  # before the draft graphs' capture
        if _teacher is not None:  # the target stays as it is: attention live
            _teacher.prepare(device, vocab)
        original_init(self, server_args, gpu_id, nccl_port, target_worker)
        if _teacher is None:
            _make_bigram(self.target_worker.model_runner.model, vocab)

    def draft_chain(self, hidden_states, input_ids=None):
        if self.tp_size != 1 or self.org_vocab_start:
            raise ValueError("the DFLASH oracle scripts a tp-1 draft head")
        B, L = self.block_size, self.block_size - 1
        bs = hidden_states.shape[0] // B
        script.check(L, None)
        true = true_tokens(input_ids.view(bs, B)[:, 0].to(torch.int64), L, self.num_org)
        rank = script.ranks(true)
        self.out[: bs * L].view(bs, L).copy_(torch.where(rank == 0, true, (true + 1) % self.num_org))

    step = worker_cls.forward_batch_generation

    def forward_batch_generation(self, batch, *args, **kwargs):
        script.refresh(self.device)
        if _teacher is not None:
            _teacher.refresh()
        return step(self, batch, *args, **kwargs)

    def eager_head(self, *, hidden_states, lm_head, chunk_size=256):
        # a batch above the captured sizes drafts eagerly: the same script, its roots read from the block's buffer
        L = self.block_size - 1
        bs = hidden_states.shape[0] // L
        vocab = int(self.target_worker.model_runner.model_config.vocab_size)
        true = true_tokens(self._draft_block_ids_buf[:bs, 0].to(torch.int64), L, vocab)
        return torch.where(script.ranks(true) == 0, true, (true + 1) % vocab).view(-1)

    worker_cls.__init__ = __init__
    sampler_cls.__call__ = draft_chain
    worker_cls.forward_batch_generation = forward_batch_generation
    worker_cls._greedy_sample_from_vocab_parallel_head = eager_head


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` right after the module `name` executes."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec


def install_after_import() -> None:
    """In a server process (the engine site's sitecustomize): the oracle's patches, as their modules are imported."""
    if any(os.environ.get(v) for v in (ENV, PROFILE_ENV, HOST_ENV)):
        sys.meta_path.insert(0, _AfterImport("sglang.srt.speculative.dflash_worker_v2", install_dflash))
    if any(os.environ.get(v) for v in (ENV, PROFILE_ENV, SYNC_ENV, HOST_ENV, ARM_ENV)):
        sys.meta_path.insert(0, _AfterImport("kdtree.ddtree.worker", install))
