"""An oracle set-up for DDTREE in the real server (GPU tests only): a target whose greedy continuation is known and a
drafter whose top-K is scripted, so that accepted lengths and tokens can be predicted exactly.

- The target becomes a bigram map: every attention and MLP output projection is zeroed (o_proj, down_proj, the
  experts' w2), so each position's last hidden state is its token's embedding; the final norm's weight is set to
  ones and lm_head's row perm(x) to HEAD_SCALE * embed(x), so the greedy next token after x is perm(x) =
  (A x + C) mod V. The greedy continuation of a prompt ending in x is perm(x), perm(perm(x)), ... The scale makes
  perm(x)'s logit hundreds above any other (dummy weights are ~1e-3), so a sampled request (temperature 1, any
  top-p or top-k) draws that continuation too.
- The drafter's candidates (`TreeDraftSampler.candidates`) are scripted: at depth d the true token perm^d(root) sits
  at rank RANKS[d-1], the other K-1 ranks carry other tokens, and the log-probs are the same at every step
  (log-softmax of -STEEP * rank). The tree is then the same at every step, and how deep the true path reaches into
  it is what `expected_accepted` computes with the reference heap (kdtree.ddtree.reference).

It says what it measures: the system (the tree, the verify, the walk, the commit's bookkeeping and the scheduler's
handling of accepted tokens), not a drafter. With the attention's output zeroed, the verify's attention does not
reach the outputs, so the KV cache's contents are not what this checks.

Enabled in a server process by DDTREE_ORACLE_RANKS (comma-separated ranks, one a drafted depth): the engine site's
sitecustomize calls `install_after_import()`, which patches kdtree.ddtree.worker as it is imported.

Apart from the oracle, DDTREE_SYNC_REPORT=<file> (any DDTREE server) runs every decode step of DDTreeWorker under
torch.cuda.set_sync_debug_mode("warn") and keeps in that file (JSON) the steps seen and each host synchronisation
torch reported, with the line of kdtree's or SGLang's code that asked for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

A, C = 7, 13  # perm(x) = (A x + C) mod V: a permutation when A is prime to V (V = 8192 in the tests' model)
STEEP = 1.0
HEAD_SCALE = 1000.0
ENV = "DDTREE_ORACLE_RANKS"
SYNC_ENV = "DDTREE_SYNC_REPORT"


def perm(x: int, vocab: int) -> int:
    return (A * x + C) % vocab


def continuation(last_token: int, n: int, vocab: int) -> list[int]:
    out, x = [], last_token
    for _ in range(n):
        x = perm(x, vocab)
        out.append(x)
    return out


def scripted_lp(K: int) -> list[float]:
    import math

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
    report = {"decode_steps": 0, "syncs": []}
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
                    if "synchroniz" in str(w.message):
                        report["syncs"].append(
                            {"message": str(w.message)[:300], "at": f"{w.filename}:{w.lineno}"}
                        )
                with open(path, "w") as f:
                    json.dump(report, f)

    worker_cls.forward_batch_generation = forward_batch_generation


def install(worker_module) -> None:
    import torch

    if os.environ.get(SYNC_ENV):
        install_sync_report(worker_module, os.environ[SYNC_ENV])
    if not os.environ.get(ENV):
        return
    ranks = [int(r) for r in os.environ[ENV].split(",")]
    sampler_cls, worker_cls = worker_module.TreeDraftSampler, worker_module.DDTreeWorker

    def candidates(self, hs, root):
        bs, L, K = root.shape[0], self.L, self.K
        if len(ranks) != L or max(ranks) >= K:
            raise ValueError(f"{ENV}={ranks}: one rank below K={K} for each of the L={L} drafted depths")
        vocab = int(self.lm_head.org_vocab_size)
        ks = torch.arange(K, device=root.device)
        lp = self.oracle_lp.expand(bs, L, K).contiguous()
        ids = torch.empty(bs, L, K, dtype=torch.int64, device=root.device)
        tok = root
        for d in range(L):
            tok = (A * tok + C) % vocab
            row = (tok[:, None] + 1 + ks) % vocab  # K tokens other than the true one
            row[:, ranks[d]] = tok
            ids[:, d].copy_(row)
        return lp, ids

    sampler_init = sampler_cls.__init__

    def sampler_init_with_lp(self, *args, **kwargs):
        sampler_init(self, *args, **kwargs)
        # made before any capture: a host-to-device copy cannot run inside one
        self.oracle_lp = torch.tensor(
            scripted_lp(self.K), dtype=torch.float32, device=self.captured.parents.device
        )

    original_init = worker_cls.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        model = self.target_worker.model_runner.model
        _make_bigram(model, int(self.target_worker.model_runner.model_config.vocab_size))

    sampler_cls.__init__ = sampler_init_with_lp
    sampler_cls.candidates = candidates
    worker_cls.__init__ = __init__


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `install` on kdtree.ddtree.worker right after the module executes."""

    def find_spec(self, name, path, target=None):
        if name != "kdtree.ddtree.worker":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            install(module)

        spec.loader.exec_module = exec_module
        return spec


def install_after_import() -> None:
    if os.environ.get(ENV) or os.environ.get(SYNC_ENV):
        sys.meta_path.insert(0, _AfterImport())
