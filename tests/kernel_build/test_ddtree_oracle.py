"""The DDTREE oracle of the GPU tests (kernel_build/bench/harness/ddtree_oracle.py), on the CPU: its scripted
candidates, through kdtree's own tree builder and acceptance walk with the bigram target's tokens, accept exactly
what `expected_accepted` predicts from the reference heap, and the continuation it predicts is the bigram's."""

from __future__ import annotations

import types

import ddtree_oracle as oracle
import pytest

torch = pytest.importorskip("torch", reason="the oracle's scripted head is torch (the server extra)")
pytest.importorskip("sglang", reason="kdtree.ddtree.worker imports SGLang's DFlash worker (the server extra)")


def test_the_continuation_is_the_permutation():
    assert oracle.continuation(5, 3, 8192) == [48, 349, 2456]
    assert len({oracle.perm(x, 8192) for x in range(8192)}) == 8192  # a permutation


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "ranks", [[0] * 7, [0, 0, 1, 0, 0, 2, 0], [1, 1, 1, 1, 1, 1, 1], [3, 0, 0, 0, 0, 0, 0]]
)
def test_scripted_candidates_accept_what_the_reference_predicts(monkeypatch, ranks):
    from kdtree.ddtree import worker
    from kdtree.ddtree.accept import AcceptBuffers, follow_tree
    from kdtree.ddtree.tree import build_tree

    monkeypatch.setenv(oracle.ENV, ",".join(map(str, ranks)))
    module = types.SimpleNamespace(
        TreeDraftSampler=type("S", (worker.TreeDraftSampler,), {}),
        DDTreeWorker=type("W", (), {"forward_batch_generation": None}),
    )
    oracle.install(module)
    sampler = object.__new__(module.TreeDraftSampler)
    sampler.L, sampler.K, budget, vocab = 7, 16, 16, 8192
    sampler.lm_head = types.SimpleNamespace(org_vocab_size=vocab)
    sampler.oracle_lp = torch.tensor(oracle.scripted_lp(16), dtype=torch.float32)
    root = torch.tensor([5, 8000, 77])
    lp, ids = sampler.candidates(None, root)
    tree = build_tree(lp, ids, root, budget)
    target = (oracle.A * tree.candidates + oracle.C) % vocab  # the bigram target's greedy token at every node
    out = follow_tree(tree.parents, tree.candidates, target, 7, AcceptBuffers(3, budget + 1, 7))
    a = oracle.expected_accepted(ranks, 16, budget)
    assert out.accepted.tolist() == [a] * 3
    for b, r in enumerate(root.tolist()):
        assert out.out_tokens[b, : a + 1].tolist() == oracle.continuation(r, a + 1, vocab)


# -- the rank profiles of the oracle benchmark (kernel_build/bench/benchmarks/bench_oracle.py) ------------------------


def _profile_file(tmp_path, text: str) -> str:
    path = tmp_path / "profile"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text", ["", "0.5,x", "0.3,0.5", "0.7,0.4", "0,0.1", "1.5", ",".join(["0.01"] * 17)])
def test_a_profile_that_is_not_probabilities_in_rank_order_is_refused_naming_the_file(tmp_path, text):
    path = _profile_file(tmp_path, text)
    with pytest.raises(ValueError, match="profile"):
        oracle.read_profile(path)


def test_the_profiles_expected_accept_lengths_are_those_the_benchmark_documents():
    paper, weak = oracle.PROFILES["paper"], oracle.PROFILES["pessimistic"]
    assert oracle.expected_chain_accepted(paper, 15) == pytest.approx(5.86, abs=0.01)
    assert oracle.expected_tree_accepted(paper, 256, 256, 15) == pytest.approx(9.12, abs=0.01)
    assert oracle.expected_chain_accepted(weak, 15) == pytest.approx(1.5, abs=0.01)
    # a certain drafter: the chain and any tree of at least L nodes accept every depth
    assert oracle.expected_chain_accepted((1.0,), 7) == 7
    assert oracle.expected_tree_accepted((1.0,), 16, 16, 7) == pytest.approx(7)
    # the best tree of L or more nodes holds the chain, so it never expects less
    for profile in (paper, weak):
        for budget in (15, 16, 32, 64):
            assert oracle.expected_tree_accepted(
                profile, budget, budget, 15
            ) >= oracle.expected_chain_accepted(profile, 15)


def test_a_profile_draws_each_rank_as_often_as_it_says_and_the_rest_off_the_candidates(tmp_path):
    script = oracle.Script(profile_path=_profile_file(tmp_path, "0.6,0.15,0.05"))
    ranks = script.ranks(
        torch.arange(200_000).view(20000, 10)
    ).flatten()  # consecutive tokens: the hash mixes them
    n = ranks.numel()
    for r, p in enumerate((0.6, 0.15, 0.05)):
        assert (ranks == r).sum().item() / n == pytest.approx(p, abs=0.01)
    assert (ranks == oracle.Script.MAX_RANKS).sum().item() / n == pytest.approx(0.2, abs=0.01)
    assert ((ranks >= 3) & (ranks < oracle.Script.MAX_RANKS)).sum().item() == 0


def test_a_changed_profile_file_is_read_again_between_steps(tmp_path):
    import os

    path = _profile_file(tmp_path, "0.6,0.15,0.05")
    script = oracle.Script(profile_path=path)
    assert script.refresh("cpu") is True
    assert script.refresh("cpu") is False  # unchanged: no copy
    cdf = script._cdf
    (tmp_path / "profile").write_text("1.0")
    os.utime(path, ns=(1, 1))  # a new mtime even on a coarse clock
    assert script.refresh("cpu") is True
    assert script._cdf is cdf  # the same tensor (captured graphs read its address), new values
    assert script.ranks(torch.arange(5000).view(1000, 5)).eq(0).all()


def test_a_tokens_draw_is_the_same_whoever_drafts_it_and_independent_of_its_neighbours(tmp_path):
    """Drawn by the token: DFLASH's chain and DDTREE's tree meet the same rank at the same token of a continuation
    (common random numbers), and a token's draw says nothing of the next one's (the hash, not the continuation)."""
    script = oracle.Script(profile_path=_profile_file(tmp_path, ",".join(map(str, oracle.PROFILES["paper"]))))
    tokens = oracle.true_tokens(torch.arange(4000), 15, 8192)
    first, again = script.ranks(tokens), script.ranks(tokens.clone())
    assert torch.equal(first, again) and torch.equal(script.ranks(tokens[:7, 3:9]), first[:7, 3:9])
    u = oracle.uniform_of(torch.arange(100_000))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.005
    assert (
        abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.01
    )  # consecutive tokens uncorrelated
    assert (
        oracle.uniform_of(torch.tensor([2**31 - 1])).item() < 1
    )  # no int64 overflow at the largest vocabulary


def test_the_chain_and_the_tree_are_compared_on_the_same_draws(monkeypatch, tmp_path):
    """The oracle's DFLASH head (install_dflash) and DDTREE's candidates (install) at the same roots: the chain
    drafts the true token exactly where the tree's rank-0 candidate is it, so where the paper profile's tree of 16
    holds the chain, the tree accepts at least what the chain does, request by request."""
    from kdtree.ddtree import worker
    from kdtree.ddtree.accept import AcceptBuffers, follow_tree
    from kdtree.ddtree.tree import build_tree

    profile = oracle.PROFILES["paper"]
    monkeypatch.setenv(oracle.PROFILE_ENV, _profile_file(tmp_path, ",".join(map(str, profile))))
    L, K, budget, vocab, bs = 15, 16, 16, 8192, 500
    tree_module = types.SimpleNamespace(
        TreeDraftSampler=type("S", (worker.TreeDraftSampler,), {}), DDTreeWorker=type("W", (), {"forward_batch_generation": None})
    )  # fmt: skip
    chain_module = types.SimpleNamespace(
        DFlashWorkerV2=type("D", (), {"__init__": None, "forward_batch_generation": None}),
        _DflashDraftSampler=type("C", (), {}),
    )
    oracle.install(tree_module)
    oracle.install_dflash(chain_module)
    sampler = object.__new__(tree_module.TreeDraftSampler)
    sampler.L, sampler.K, sampler.lm_head = L, K, types.SimpleNamespace(org_vocab_size=vocab)
    sampler.oracle_lp = torch.tensor(oracle.profile_lp(profile, K), dtype=torch.float32)
    root = torch.randint(0, vocab, (bs,), generator=torch.Generator().manual_seed(3))
    lp, ids = sampler.candidates(None, root)
    head = chain_module._DflashDraftSampler()
    head.block_size, head.tp_size, head.org_vocab_start, head.num_org = L + 1, 1, 0, vocab
    head.out = torch.empty(bs * L, dtype=torch.int64)
    block = torch.zeros(bs, L + 1, dtype=torch.int64)
    block[:, 0] = root
    head(torch.empty(bs * (L + 1), 1), block.flatten())
    chain = head.out.view(bs, L)
    true = oracle.true_tokens(root, L, vocab)
    assert torch.equal(chain == true, ids[:, :, 0] == true)  # the same draw at every token
    chain_accepted = (chain == true).int().cumprod(1).sum(1)
    tree = build_tree(lp, ids, root, budget)
    target = (oracle.A * tree.candidates + oracle.C) % vocab
    out = follow_tree(tree.parents, tree.candidates, target, L, AcceptBuffers(bs, budget + 1, L))
    assert (out.accepted >= chain_accepted).all() and (out.accepted > chain_accepted).sum() > bs // 20


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ddtree_under_a_profile_accepts_on_average_what_the_tree_expects(monkeypatch, tmp_path):
    """Many requests, one step each: the mean accepted length of the scripted tree walked with the bigram target's
    tokens is the expectation over the tree's nodes (statistical: 4 standard errors)."""
    from kdtree.ddtree import worker
    from kdtree.ddtree.accept import AcceptBuffers, follow_tree
    from kdtree.ddtree.tree import build_tree

    profile = oracle.PROFILES["paper"]
    monkeypatch.setenv(oracle.PROFILE_ENV, _profile_file(tmp_path, ",".join(map(str, profile))))
    module = types.SimpleNamespace(
        TreeDraftSampler=type("S", (worker.TreeDraftSampler,), {}),
        DDTreeWorker=type("W", (), {"forward_batch_generation": None}),
    )
    oracle.install(module)
    L, K, budget, vocab, bs = 7, 16, 16, 8192, 4000
    sampler = object.__new__(module.TreeDraftSampler)
    sampler.L, sampler.K = L, K
    sampler.lm_head = types.SimpleNamespace(org_vocab_size=vocab)
    sampler.oracle_lp = torch.tensor(oracle.profile_lp(profile, K), dtype=torch.float32)
    torch.manual_seed(1)
    root = torch.randint(0, vocab, (bs,))
    lp, ids = sampler.candidates(None, root)
    tree = build_tree(lp, ids, root, budget)
    target = (oracle.A * tree.candidates + oracle.C) % vocab
    out = follow_tree(tree.parents, tree.candidates, target, L, AcceptBuffers(bs, budget + 1, L))
    acc = out.accepted.double()
    assert acc.mean().item() == pytest.approx(
        oracle.expected_tree_accepted(profile, K, budget, L), abs=4 * acc.std().item() / bs**0.5
    )
    for b in range(5):  # and what a step emits is the target's own continuation
        a = out.accepted[b].item()
        assert out.out_tokens[b, : a + 1].tolist() == oracle.continuation(root[b].item(), a + 1, vocab)


def test_the_dflash_chain_under_a_profile_accepts_on_average_its_rank_0_run(monkeypatch, tmp_path):
    """The scripted DFLASH draft head: the chain holds the true token where the draw put it at rank 0, so the
    accepted length (the run of true tokens from depth 1) averages sum_d p0^d; fixed ranks give that run exactly."""
    profile = oracle.PROFILES["pessimistic"]
    monkeypatch.setenv(oracle.PROFILE_ENV, _profile_file(tmp_path, ",".join(map(str, profile))))
    module = types.SimpleNamespace(
        DFlashWorkerV2=type("W", (), {"__init__": lambda self: None, "forward_batch_generation": None}),
        _DflashDraftSampler=type("D", (), {}),
    )
    oracle.install_dflash(module)
    B, bs, vocab = 8, 4000, 8192
    head = module._DflashDraftSampler()
    head.block_size, head.tp_size, head.org_vocab_start, head.num_org = B, 1, 0, vocab
    head.out = torch.empty(bs * (B - 1), dtype=torch.int64)
    torch.manual_seed(2)
    ids = torch.randint(0, vocab, (bs, B))
    head(torch.empty(bs * B, 4), ids.flatten())
    chain = head.out.view(bs, B - 1)
    truth = torch.tensor([oracle.continuation(r, B - 1, vocab) for r in ids[:, 0].tolist()])
    run = (chain == truth).int().cumprod(1).sum(1).double()
    assert run.mean().item() == pytest.approx(
        oracle.expected_chain_accepted(profile, B - 1), abs=4 * run.std().item() / bs**0.5
    )


class _Mode:
    """A stand-in for SGLang's ForwardMode: a prefill (extend) or a decode step."""

    def __init__(self, extend):
        self.extend = extend

    def is_extend(self):
        return self.extend

    def is_decode(self):
        return not self.extend

    def is_idle(self):
        return False


class Clock:
    """A stand-in for CUDA's timing events (torch.cuda.Event(enable_timing=True)): record() reads a counter the test
    advances in ms, elapsed_time gives the difference, and, as CUDA's, raises unless both events have completed,
    which here means: recorded no later than an event that was synchronized."""

    now = 0.0
    done = 0.0

    def record(self):
        self.t = Clock.now

    def synchronize(self):
        Clock.done = max(Clock.done, self.t)

    def elapsed_time(self, later):
        if max(self.t, later.t) > Clock.done:
            raise RuntimeError("an event not yet complete")
        return later.t - self.t


def batch(extend=False):
    """A stand-in ScheduleBatch, as the host report reads it."""
    return types.SimpleNamespace(forward_mode=_Mode(extend), is_extend_in_batch=False)


def test_the_host_report_times_decode_steps_only_then_profiles_and_writes_once(tmp_path):
    """DDTREE_HOST_REPORT: prefill and idle batches pass through untimed (and break the interval), the plain window
    is timed and its report written two steps after it, the profiled window lands in cProfile's tables, written
    when that window ends."""
    import json

    calls = []

    def step(self, b):
        calls.append(b.forward_mode.extend)
        return len(calls)

    worker_cls = type("W", (), {"forward_batch_generation": step, "speculative_num_draft_tokens": 33})
    oracle.install_host_report(worker_cls, str(tmp_path), skip=2, plain=4, profiled=3, clock=Clock)
    w = worker_cls()
    assert w.forward_batch_generation(batch(extend=True)) == 1  # a prefill: passed through
    for extend in [False] * 3 + [True] + [False] * 3:  # skip 2, plain 4 with a prefill
        w.forward_batch_generation(batch(extend))
    w.forward_batch_generation(batch())  # the profiled window's first step
    assert list(tmp_path.iterdir()) == []  # the plain window's report comes a step later
    w.forward_batch_generation(batch())
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]  # the profiled window has not ended
    w.forward_batch_generation(batch())  # its last step: the tables
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".txt"]
    w.forward_batch_generation(batch())  # past the windows: nothing more is recorded
    assert calls == [True] + [False] * 3 + [True] + [False] * 7
    (report,) = tmp_path.glob("*-W.json")
    got = json.loads(report.read_text())
    assert got["worker"] == "W" and got["verify_tokens"] == 33 and got["steps_timed"] == 4
    # the plain window's first step follows a skipped one; the two steps after the prefill have no interval (the
    # second one's would hold the wait for the prefill's result)
    assert len(got["host_ms"]["each"]) == 4 and len(got["interval_ms"]["each"]) == 2
    assert "step" in report.with_suffix(".txt").read_text()  # the profiled function's row


def test_the_host_report_times_the_schedulers_wait_for_each_decode_steps_results_in_its_window(tmp_path):
    """Given SGLang's Scheduler class (here a stand-in with process_batch_result's signature), the report also
    keeps how long the loop waited for each decode step's copy_done while the plain window was open, waiting on it
    before the original does; prefills and results without a copy event pass through untimed."""
    import json
    import time

    class Done:  # a copy event that completes 5 ms after the wait begins
        waited = 0

        def synchronize(self):
            if not Done.waited:
                time.sleep(0.005)
            Done.waited += 1

    processed = []
    scheduler_cls = type("S", (), {"process_batch_result": lambda self, b, r: processed.append(r)})
    worker_cls = type(
        "W", (), {"forward_batch_generation": lambda self, b: None, "speculative_num_draft_tokens": 16}
    )
    oracle.install_host_report(
        worker_cls, str(tmp_path), skip=1, plain=3, profiled=1, scheduler_cls=scheduler_cls, clock=Clock
    )
    w, sched = worker_cls(), scheduler_cls()
    sched.process_batch_result(batch(), types.SimpleNamespace(copy_done=Done()))  # before the window: untimed
    assert Done.waited == 0
    for _ in range(4):  # step 0 skipped, steps 1-3 the plain window
        w.forward_batch_generation(batch())
        sched.process_batch_result(batch(), types.SimpleNamespace(copy_done=Done()))
        sched.process_batch_result(batch(extend=True), types.SimpleNamespace(copy_done=Done()))
        sched.process_batch_result(batch(), types.SimpleNamespace(copy_done=None))
    w.forward_batch_generation(batch())  # the profiled step
    w.forward_batch_generation(batch())  # two steps after the plain window: the report is written
    got = json.loads(next(tmp_path.glob("*-W.json")).read_text())
    waits = got["scheduler_wait_ms"]["each"]
    assert len(waits) == 3 and waits[0] >= 5 and max(waits[1:]) < 5
    assert len(processed) == 13  # every call reached the original


def test_the_host_report_times_each_phase_of_a_decode_step_on_the_gpus_clock(tmp_path):
    """In the plain window only, events (here a stand-in clock for CUDA's timing events) mark the step's start and
    end and each call of the draft forward, the target's verify and the drafter's KV append; the report keeps each
    phase's ms in every timed step, with their mean and median, and the time between consecutive steps, never across
    a prefill."""
    import json

    def advance(ms):
        Clock.now += ms

    class Runner:
        calls = 0

        def forward(self, fb):  # the draft forward takes 1, 2, 3, ... ms in turn, prefills included
            Runner.calls += 1
            advance(float(Runner.calls))

    class Target:
        def forward_batch_generation(self, **kw):
            advance(7.0)

    def step(self, b):
        advance(0.5)  # before the draft
        self.draft_model_runner.forward(None)
        advance(0.25)
        self.target_worker.forward_batch_generation(is_verify=True)
        advance(0.125)
        self._append_target_hidden_to_draft_kv_by_loc()
        advance(1.0)  # after the append

    worker_cls = type(
        "W",
        (),
        {
            "forward_batch_generation": step,
            "_append_target_hidden_to_draft_kv_by_loc": lambda self: advance(0.0625),
            "speculative_num_draft_tokens": 16,
        },
    )
    oracle.install_host_report(worker_cls, str(tmp_path), skip=1, plain=4, profiled=1, clock=Clock)
    w = worker_cls()
    w.draft_model_runner, w.target_worker = Runner(), Target()
    # skipped, 2 timed, a prefill, 2 timed, profiled, then the step that writes the report
    for extend in (False, False, False, True, False, False, False, False):
        w.forward_batch_generation(batch(extend))
        advance(3.0)  # the GPU between steps (and across the prefill: 3 + its own 0 here + 3)
    got = json.loads(next(tmp_path.glob("*-W.json")).read_text())["gpu_phase_ms"]
    assert got["draft"] == {
        "mean": 4.0,
        "median": 4.0,
        "each": [2.0, 3.0, 5.0, 6.0],
    }  # the 4 timed steps' only
    assert {k: v["each"] for k, v in got.items() if k != "draft"} == {
        "start": [0.5] * 4,
        "draft end": [0.25] * 4,
        "verify": [7.0] * 4,
        "verify end": [0.125] * 4,
        "append": [0.0625] * 4,
        "append end": [1.0] * 4,
        "between_steps": [
            3.0,
            3.0,
        ],  # the two pairs of consecutive steps; the pair across the prefill is left out
    }


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_split_heads_chain_is_the_scripted_one(monkeypatch, tmp_path):
    """Under auto (split head) a chain step's head runs the real chain head on the logits, then takes the script's
    chain, the tokens DFLASH's scripted head drafts, and the E_chain of the script's candidates (what the whole head
    takes from them)."""
    from kdtree.ddtree import worker

    profile = oracle.PROFILES["paper"]
    monkeypatch.setenv(oracle.PROFILE_ENV, _profile_file(tmp_path, ",".join(map(str, profile))))
    L, K, vocab, bs = 15, 16, 8192, 40
    module = types.SimpleNamespace(
        TreeDraftSampler=type("S", (worker.TreeDraftSampler,), {}), DDTreeWorker=type("W", (), {"forward_batch_generation": None})
    )  # fmt: skip
    oracle.install(module)
    sampler = object.__new__(module.TreeDraftSampler)
    sampler.L, sampler.K, sampler.lm_head = L, K, types.SimpleNamespace(org_vocab_size=vocab)
    sampler.oracle_lp = torch.tensor(oracle.profile_lp(profile, K), dtype=torch.float32)
    sampler.oracle_chain_expected = torch.zeros(())
    lp0 = sampler.oracle_lp[:1].expand(1, L)
    sampler.oracle_chain_expected.fill_(float(torch.exp(torch.cumsum(lp0, 1)).sum()))
    root = torch.randint(0, vocab, (bs,), generator=torch.Generator().manual_seed(5))
    o = worker.TreeOutputs(bs, 17, L, K, "cpu")
    sampler.chain(torch.randn(bs * L, vocab), root, o)
    lp, ids = sampler.candidates(None, root)
    want = worker.TreeOutputs(bs, 17, L, K, "cpu")
    want.take_chain(lp, ids, bs)
    true = oracle.true_tokens(root, L, vocab)
    assert torch.equal(o.chain, want.chain) and (o.chain == true).any() and (o.chain != true).any()
    assert torch.allclose(o.chain_expected, want.chain_expected)


# ---- the teacher: the live-attention oracle ------------------------------------------------------------------


def _teacher(monkeypatch, tmp_path, table, vocab):
    path = tmp_path / "teacher.json"
    path.write_text(__import__("json").dumps(table))
    teacher = oracle.Teacher(str(path))
    teacher.prepare(torch.device("cpu"), vocab)
    monkeypatch.setattr(oracle, "_teacher", teacher)
    return teacher, path


def test_the_teacher_follows_its_table_and_drafts_a_rejected_token_where_it_knows_none(monkeypatch, tmp_path):
    vocab = 16
    table = oracle.teacher_table([[3, 9, 4, 12, 9, 4], [7, 9, 4]], vocab)  # 3 -> 9 -> 4 -> 12 -> 9; 7 -> 9
    teacher, path = _teacher(monkeypatch, tmp_path, table, vocab)
    got = oracle.true_tokens(torch.tensor([3, 7, 5]), 5, vocab)
    assert got.tolist() == [
        [9, 4, 12, 9, 4],
        [9, 4, 12, 9, 4],
        [6, 7, 9, 4, 12],
    ]  # 5 unknown: 6, unknown: 7, ...
    table[12] = 1  # a new reference: the file changes, the next step reads it
    path.write_text(__import__("json").dumps(table) + " ")
    assert teacher.refresh() and not teacher.refresh()
    assert oracle.true_tokens(torch.tensor([4]), 3, vocab).tolist() == [
        [12, 1, 2]
    ]  # 4 -> 12 -> 1 (new), unknown
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"teacher.json: 2 entries, the vocabulary has 16"):
        teacher.refresh()


@pytest.mark.parametrize("teacher", [False, True])
def test_the_dflash_heads_captured_and_eager_draft_the_same_scripted_chain(monkeypatch, tmp_path, teacher):
    """The DFLASH oracle's draft head inside the captured graph and its eager head (a batch above the captured sizes)
    draft the same tokens: the true continuation (the bigram's, or the teacher's table) where the script puts it at
    rank 0, another token elsewhere; the eager head reads the roots from the worker's block buffer."""
    B, bs, vocab = 8, 6, 64
    monkeypatch.setenv(oracle.ENV, "0,0,1,0,0,0,0")
    if teacher:
        rng = torch.Generator().manual_seed(3)
        _teacher(monkeypatch, tmp_path, torch.randint(-1, vocab, (vocab,), generator=rng).tolist(), vocab)
    else:
        monkeypatch.setattr(oracle, "_teacher", None)
    module = types.SimpleNamespace(
        DFlashWorkerV2=type("W", (), {"__init__": lambda self: None, "forward_batch_generation": None}),
        _DflashDraftSampler=type("D", (), {}),
    )
    oracle.install_dflash(module)
    head = module._DflashDraftSampler()
    head.block_size, head.tp_size, head.org_vocab_start, head.num_org = B, 1, 0, vocab
    head.out = torch.empty(bs * (B - 1), dtype=torch.int64)
    ids = torch.randint(0, vocab, (bs, B))
    head(torch.empty(bs * B, 4), ids.flatten())
    worker = object.__new__(module.DFlashWorkerV2)
    worker.block_size, worker._draft_block_ids_buf = B, ids
    worker.target_worker = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=vocab))
    )
    eager = worker._greedy_sample_from_vocab_parallel_head(
        hidden_states=torch.empty(bs * (B - 1), 4), lm_head=None
    )
    assert torch.equal(eager, head.out)
    truth = oracle.true_tokens(ids[:, 0], B - 1, vocab)
    chain = head.out.view(bs, B - 1)
    assert torch.equal(chain[:, :2], truth[:, :2]) and not torch.equal(chain[:, 2], truth[:, 2])
