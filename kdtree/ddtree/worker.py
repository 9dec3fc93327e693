"""DDTreeWorker: SGLang 0.5.23's DFlashWorkerV2 with a draft tree instead of a draft chain.

One decode step, per request (bs requests at once, fixed shapes, no host synchronisation):
1. the DFlash drafter runs its block of B = [bonus, mask x (B-1)] as before (draft CUDA graph of width B);
   inside that graph, `TreeDraftSampler` takes the top-K log-probs of each drafted depth from the target's
   lm_head (SGLang's `candidate_topk`, tensor-parallel aware); a graph of its own then builds the best-first tree
   of `budget` nodes from them (`kdtree.ddtree.fused.build_draft_tree`: one Triton kernel, or build_tree's torch
   ops for large budgets), which a step of auto's chain arm does not replay;
2. the target verifies the tree's N = budget + 1 tokens in one TARGET_VERIFY pass, positions prefix + depth,
   the ancestor mask written into the attention backend's verify-mask buffer (so kdtree serves it in `on`; both by
   `kdtree.ddtree.fused.write_verify_layout`, one Triton kernel);
3. the target's token at every node (argmax, or one sample of SGLang's verify distribution per node) and
   `kdtree.ddtree.fused.accept_walk` (one Triton kernel) give the accepted path and the bonus, and commit: the
   window's slots permuted in req_to_token (accepted path first), the commit's lengths;
4. the drafter's KV materialised from the target's hidden states of the path's nodes, as DFlash does for its chain.
The step keeps its launches few (under overlap scheduling the host's time hides behind the GPU's step while it is
shorter; at 61 layers and 32k the GPU sets the period: kernel_build/NOTES.md).

Everything else (pools, prefill, graphs, the drafter) is DFlashWorkerV2's. Importing this module imports SGLang.
"""

from __future__ import annotations

import logging
import time

import torch
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.kernels.ops.speculative.lilicorr import lilicorr_topk_lse
from sglang.srt.layers.dp_attention import get_dp_tp_group
from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
)
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.models.dflash import candidate_topk
from sglang.srt.runtime_context import get_disagg, get_exec, get_parallel, get_schedule, get_spec
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import (
    _get_or_create_chain_verify_buffers,
    apply_dflash_verify_logits_adjustments,
    build_speculative_verify_target_probs,
    is_dense_head_weight,
)
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2, _resolve_dflash_embedding_module
from sglang.srt.speculative.draft_worker_common import (
    build_block_pos_offsets,
    make_draft_block_spec_info,
)
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite
from sglang.srt.speculative.spec_utils import draft_tp_context

from kdtree.config import Mode
from kdtree.ddtree.accept import AcceptBuffers, WindowCommit
from kdtree.ddtree.budget import CHAIN, BudgetPolicy, arm_name, cut_budgets, measure_cut_cost
from kdtree.ddtree.fused import accept_walk, build_draft_tree, chain_head, write_verify_layout
from kdtree.ddtree.tree import TreeBuffers, chain_expected

log = logging.getLogger("kdtree.ddtree")


class TreeOutputs:
    """What the draft head writes (inside the draft graph): each of the L drafted depths' top-K tokens with their
    log-probs, the root, and the chain: the top-1 token of each depth (what a chain step verifies) and E_chain, the
    drafter's expected run of them (the sum over depths of the product of their probabilities). And what the tree's
    build writes from them: the tree of each request as the verify reads it, rows of N = budget + 1 nodes (see
    TreeBuffers)."""

    def __init__(self, rows: int, N: int, L: int, K: int, device):
        i64 = dict(dtype=torch.int64, device=device)
        self.rows = rows
        self.lp = torch.zeros(rows, L, K, dtype=torch.float32, device=device)
        self.ids = torch.zeros(rows, L, K, **i64)
        self.root = torch.zeros(rows, **i64)
        self.chain = torch.zeros(rows, L, **i64)
        # chain_head's (the split head only)
        self.chain_lp = torch.zeros(rows, L, dtype=torch.float32, device=device)
        self.chain_expected = torch.zeros(rows, dtype=torch.float32, device=device)
        self.input_ids = torch.zeros(rows, N, **i64)
        self.candidates = torch.zeros(rows, N, **i64)
        self.parents = torch.zeros(rows, N, **i64)
        self.depths = torch.zeros(rows, N, **i64)
        self.scores = torch.zeros(rows, N, dtype=torch.float32, device=device)
        self.mask = torch.zeros(rows, N, N, dtype=torch.bool, device=device)
        self.positions = torch.zeros(rows, N, **i64)  # the verify's (the worker writes them: prefix + depth)

    def take_topk(self, lp: torch.Tensor, ids: torch.Tensor, bs: int) -> None:
        """Each depth's top-K (sorted descending) into the first bs rows."""
        self.lp[:bs].copy_(lp)
        self.ids[:bs].copy_(ids)

    def take_chain(self, lp: torch.Tensor, ids: torch.Tensor, bs: int) -> None:
        """The chain and E_chain from each depth's top-K (sorted descending): its first candidates (chain_lp is left
        alone: nothing reads it here, and the whole head runs every step)."""
        self.chain[:bs].copy_(ids[:, :, 0])
        chain_expected(lp[:, :, 0], out=self.chain_expected[:bs])


class TreeDraftSampler:
    """The draft head of DDTree, run at the tail of the draft forward (inside its CUDA graph when there is
    one): per drafted depth the top-K tokens of the target head with their log-probs. Then `build`, the tree, in a
    CUDA graph of its own a captured size: a step that runs the chain (auto's chain arm) skips it (the fused tree
    kernel alone is ~200 us at budget 32 on an H200, ~1.5% of a 61-layer step at 32k).

    With `split_head` (auto's chain arm, a dense lm_head on one rank) the draft graph's head keeps the logits in a
    buffer of its own and takes only the chain from them (`kdtree.ddtree.fused.chain_head`: two launches where DFlash's
    argmax head takes one), and the tree's graph takes the top-K from that buffer: a chain step then costs what DFlash's
    does (the whole head in the draft graph took 72 us more a step on the H200, about 17 launches).

    Graph replays pad the batch to a captured size, so the tree is built into per-size `TreeBuffers` made
    before capture, and its outputs are copied into `max_bs`-row buffers that the worker reads."""

    def __init__(self, *, lm_head, block_size: int, budget: int, sizes: list[int], device, split_head=False):
        self.lm_head = lm_head
        self.B, self.L, self.budget = block_size, block_size - 1, budget
        vocab = int(getattr(lm_head, "org_vocab_size", 0) or lm_head.weight.shape[0])
        self.K = min(budget, vocab)  # Lemma 1: more candidates a depth cannot enter a tree of `budget` nodes
        self.trees = {bs: TreeBuffers(bs, self.L, self.K, budget, device) for bs in sorted(set(sizes))}
        # the graphs write the outputs of up to max(sizes) rows here (captured addresses: never replaced); an eager
        # batch above that gets outputs of its own
        self.captured = TreeOutputs(max(sizes), budget + 1, self.L, self.K, device)
        self.eager: TreeOutputs | None = None
        # split_head: the draft graph's logits of up to max(sizes) requests (what the tree's graph reads; zeros until
        # the first draft, as the tree's graphs are captured on them)
        self.logits = (
            torch.zeros(max(sizes) * self.L, vocab, dtype=lm_head.weight.dtype, device=device)
            if split_head
            else None
        )
        # the tree's graph a captured size (capture_builds)
        self._builds: dict[int, torch.cuda.CUDAGraph] = {}

    def outputs(self, bs: int) -> TreeOutputs:
        """Where the tree of a batch of bs requests is (the captured rows, or an eager batch's own)."""
        if bs <= self.captured.rows:
            return self.captured
        if self.eager is None or self.eager.rows < bs:
            self.eager = TreeOutputs(bs, self.budget + 1, self.L, self.K, self.captured.input_ids.device)
        return self.eager

    @property
    def out(self) -> torch.Tensor:
        """Where DFlashWorkerV2's chain step reads its drafted tokens after a draft graph replay ([rows * L]), as from
        its own sampler: auto's chain arm runs that step as is."""
        return self.captured.chain.view(-1)

    def candidates(self, hs: torch.Tensor, root: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per drafted depth the top-K tokens of the target head and their log-probs, each depth sorted
        descending: (lp float32 [bs, L, K], ids int64 [bs, L, K]) from the drafter's hidden states [bs * L, H]."""
        bs = root.shape[0]
        if hs.dtype != self.lm_head.weight.dtype:
            hs = hs.to(self.lm_head.weight.dtype)
        ids, vals, lse = candidate_topk(hs, self.lm_head, self.K, with_partition=True)
        return self._sorted(vals, lse, ids, bs)

    def candidates_from_logits(
        self, logits: torch.Tensor, root: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`candidates` from the head's logits [bs * L, V] (split_head: one rank, a dense head), as candidate_topk
        takes them on one rank."""
        vals, ids, lse = lilicorr_topk_lse(logits, self.K)
        return self._sorted(vals, lse, ids.long(), root.shape[0])

    def _sorted(self, vals, lse, ids, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        lp = (vals.float() - lse[:, None]).view(bs, self.L, self.K)
        lp, order = torch.sort(lp, dim=-1, descending=True, stable=True)
        return lp, torch.gather(ids.view(bs, self.L, self.K), 2, order)

    def chain(self, logits: torch.Tensor, root: torch.Tensor, o: TreeOutputs) -> None:
        """split_head: the chain, its log-probs and E_chain of the batch's requests from the head's logits."""
        bs = root.shape[0]
        chain_head(logits, o.chain[:bs], o.chain_lp[:bs], o.chain_expected[:bs])

    def __call__(self, hidden_states: torch.Tensor, input_ids: torch.Tensor) -> None:
        """The head, as the draft graph captures it: hidden_states [bs * B, H] of the draft block, input_ids [bs * B]
        its tokens (the root first). With split_head the logits and the chain; else the whole head (`head`)."""
        if self.logits is None:
            return self.head(hidden_states, input_ids)
        hs, root = self._block(hidden_states, input_ids)
        bs = root.shape[0]
        o = self.outputs(bs)
        o.root[:bs].copy_(root)
        logits = self.logits[: bs * self.L]
        weight = self.lm_head.weight
        torch.matmul(hs.to(weight.dtype), weight[: logits.shape[1]].T, out=logits)
        self.chain(logits, root, o)

    def head(self, hidden_states: torch.Tensor, input_ids: torch.Tensor) -> None:
        """The whole head: each depth's top-K, the root, the chain and E_chain (the tree's build reads the first
        two). The draft graph's head without split_head, and an eager step's."""
        hs, root = self._block(hidden_states, input_ids)
        bs = root.shape[0]
        lp, ids = self.candidates(hs, root)
        o = self.outputs(bs)
        o.take_topk(lp, ids, bs)
        o.root[:bs].copy_(root)
        o.take_chain(lp, ids, bs)

    def _block(
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafted depths' hidden states [bs * L, H] and the roots [bs] of a draft block."""
        bs = hidden_states.shape[0] // self.B
        hs = hidden_states.view(bs, self.B, -1)[:, 1:, :].reshape(bs * self.L, -1)
        return hs, input_ids.view(bs, self.B)[:, 0].to(torch.int64)

    def build(self, bs: int, graphed: bool) -> TreeOutputs:
        """The tree of each of the batch's bs requests from the head's top-K, where `outputs(bs)` has it. After a
        draft graph replay (`graphed`: the head wrote the rows of the replay's padded size), the replay of the tree's
        graph of the smallest captured size that holds bs (rows past bs are the padding's, never read); else eagerly
        at bs, after `head`."""
        # self._builds is in ascending order: capture_builds adds the sizes sorted
        size = next((s for s in self._builds if s >= bs), None) if graphed else None
        if size is None:
            self._build(bs, topk=graphed and self.logits is not None)
        else:
            self._builds[size].replay()
        return self.outputs(bs)

    def capture_builds(self) -> None:
        """The tree's graph for each size the draft graphs were captured at (one memory pool): it reads the head's
        captured rows, whose addresses never change. Each size runs once outside capture first (Triton compiles
        there)."""
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        topk = self.logits is not None
        for size in sorted(self.trees):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._build(size, topk)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self._build(size, topk)
            self._builds[size] = graph

    def _build(self, bs: int, topk: bool) -> None:
        """The tree from outputs(bs)'s top-K; topk: first that top-K from the split head's logits."""
        o = self.outputs(bs)
        if topk:
            o.take_topk(*self.candidates_from_logits(self.logits[: bs * self.L], o.root[:bs]), bs)
        if bs not in self.trees:  # an eager batch of a size no graph was captured for (never under capture)
            self.trees[bs] = TreeBuffers(bs, self.L, self.K, self.budget, o.lp.device)
        t = build_draft_tree(o.lp[:bs], o.ids[:bs], o.root[:bs], self.budget, out=self.trees[bs])
        for mine, theirs in (
            (o.input_ids, t.input_ids),
            (o.candidates, t.candidates),
            (o.parents, t.parents),
            (o.depths, t.depths),
            (o.scores, t.scores),
            (o.mask, t.mask),
        ):
            mine[:bs].copy_(theirs)


class DDTreeWorker(DFlashWorkerV2):
    """DFlashWorkerV2 with a budgeted draft tree; see the module. Overlap scheduling on or off (as DFlash), page
    size 1, no DP attention, no compact draft window."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        spec = get_spec()
        self.verify_width = int(
            spec.speculative_num_draft_tokens
        )  # N: the KV reserve, mask and target graphs
        self.budget = self.verify_width - 1
        # DFlashWorkerV2 sized its block from N; the drafter runs blocks of B.
        self.block_size = int(spec.speculative_dflash_block_size)
        self.draft_model.set_block_size(self.block_size)
        self._block_pos_offsets = build_block_pos_offsets(length=self.block_size, device=self.device)
        self._draft_block_spec_info = make_draft_block_spec_info(
            draft_token_num=self.block_size, device=self.device
        )
        self.speculative_num_draft_tokens = self.verify_width
        self._tree_sampler: TreeDraftSampler | None = None
        # two sets of the walk's outputs a batch size, used in turn: under overlap scheduling the scheduler still
        # reads a step's tokens and bonus (its result and next draft input) while the next step runs, as DFlash's
        # two accept/bonus slots allow
        self._accept: dict[tuple[int, int], AcceptBuffers] = {}
        self._accept_slot = 0
        self._cut = BudgetCut.make(self)  # KDTREE_DDTREE_BUDGET=auto, else None
        # auto's chain arm: the target's verify captured at width B (init_cuda_graphs)
        self._chain_runner: ChainVerifyRunner | None = None

    # -- the draft head ----------------------------------------------------------------------------------------

    def _lm_head(self):
        return unwrap_lora_layer(self._target_worker.model_runner.model.lm_head)

    def _make_tree_sampler(self, sizes: list[int], split_head: bool = False) -> TreeDraftSampler:
        return TreeDraftSampler(
            lm_head=self._lm_head(),
            block_size=self.block_size,
            budget=self.budget,
            sizes=sizes,
            device=self.device,
            split_head=split_head,
        )

    def _maybe_build_draft_sampler(self):
        # DFlashWorkerV2.init_cuda_graphs calls this before capturing the draft graphs.
        self._tree_sampler = self._make_tree_sampler(
            list(get_exec().graph.cuda_graph_config.decode.bs), split_head=self._split_head()
        )
        if self._tree_sampler.logits is not None:
            log.info(
                "DDTREE auto: a chain step's draft head takes the chain alone; the logits it keeps for the tree's "
                "graph take %.2f GB of GPU memory (beside the KV cache)",
                self._tree_sampler.logits.nbytes / 2**30,
            )
        return self._tree_sampler

    def _split_head(self) -> bool:
        """Whether the draft graph's head takes only the chain (`TreeDraftSampler`'s split_head): where auto may run
        chain steps, and the logits are one matmul of a dense head on one rank (else the whole head, as before)."""
        if self._cut is None or not self._cut.chain_allowed:
            return False
        if ChainVerifyRunner.unavailable(self.target_worker.model_runner) is not None:
            return False  # no chain steps to draft for (capture_beside logs why)
        lm_head = self._lm_head()
        dense = is_dense_head_weight(
            getattr(lm_head, "weight", None)
        ) and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
        if not dense or get_parallel().tp_size != 1:
            log.info("DDTREE auto: the draft graph keeps the whole head (a quantised or sharded lm_head)")
            return False
        return True

    def init_cuda_graphs(self):
        super().init_cuda_graphs()
        if self._tree_sampler is None:  # graphs off: the same head, run eagerly after each draft forward
            self._tree_sampler = self._make_tree_sampler([1])
            return
        with torch.inference_mode():
            self._tree_sampler.capture_builds()
        if self._cut is not None and self._cut.chain_allowed:
            self._chain_runner = ChainVerifyRunner.capture_beside(
                self.target_worker.model_runner, self.block_size
            )
            if self._chain_runner is not None:
                # DFlash's sampled chain acceptance keeps buffers a batch size that grow with a synchronising write:
                # sized now for every batch the chain runs (its prewarm, which sized them, is not DDTREE's)
                _get_or_create_chain_verify_buffers(  # keyed on the device's index: a tensor's resolved device
                    bs=self._chain_runner.max_bs,
                    draft_token_num=self.block_size,
                    device=self._tree_sampler.captured.parents.device,
                )
            self._cut.offer_chain(self._chain_runner)

    def prewarm_sampling(self):
        # DFlash's rehearsal sizes its chain verify; the tree's sampled verify goes through SGLang's
        # build_speculative_verify_target_probs at N rows a request, measured by the generic rehearsal.
        return self.model_runner.prewarm_sampling()

    # -- one decode step ---------------------------------------------------------------------------------------

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle():
            # prefill (prompt hidden states into the draft KV) and idle batches: DFlash's own
            if self._cut is not None:
                self._cut.policy.interrupt()
            return super().forward_batch_generation(batch, on_publish, grammar_barrier, pp_proxy_tensors)
        draft_input = batch.spec_info
        if not isinstance(draft_input, DFlashDraftInputV2):
            raise RuntimeError("DDTREE expected DFlashDraftInputV2 state on the running batch")
        bs, B, N, L = len(batch.seq_lens), self.block_size, self.verify_width, self.block_size - 1
        host_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else draft_input.nxt_kv_lens_cpu
        # the prefixes' host sum, or under overlap with a backend that needs no host lengths (Triton), the
        # scheduler's reserved bound: an eager batch's mask buffer is sized from it, and the cut's cost from it
        host_sum = int(batch.seq_lens_sum if batch.seq_lens_sum is not None else draft_input.nxt_kv_lens_sum)
        if self._chain_runner is not None and self._chain_runner.stale():
            self._chain_runner = None
            self._cut.offer_chain(None)
        live = self._cut.choose(bs, host_sum) if self._cut is not None else None
        if live is not None and self._cut.last_b == CHAIN:
            return self._chain_step(batch, on_publish, grammar_barrier, pp_proxy_tensors)
        batch.seq_lens.record_stream(torch.cuda.current_stream())
        device = self.device
        prefix = batch.seq_lens
        req_to_token = self.model_runner.req_to_token_pool.req_to_token

        # the window: N reserved slots after the prefix (the scheduler reserved 2N)
        window = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=req_to_token,
            start_offset=prefix,
            end_offset=prefix + N,
            batch_size=bs,
            draft_token_num=N,
            device=device,
        )
        translator = self.target_worker.model_runner.kv_index_translator
        verify_plan = translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix,
            seq_lens_cpu=host_lens,
            write_virtual=window,
            read_extent=N,
        )

        # 1. the draft block and its tree
        self._ensure_draft_block_buffers(bs)
        block_ids = self._draft_block_ids_buf[:bs]
        block_ids.fill_(int(self._mask_token_id))
        block_ids[:, 0].copy_(draft_input.bonus_tokens)
        positions_2d = self._draft_block_positions_buf[:bs]
        torch.add(prefix.unsqueeze(1), self._block_pos_offsets, out=positions_2d)
        embed = unwrap_lora_layer(
            _resolve_dflash_embedding_module(self.draft_model, self.target_worker.model_runner.model)
        )
        if self._full_embed_gpu is not None:
            noise = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
        else:
            noise = embed(block_ids)
        if self._noise_embed_scale != 1.0:
            noise = noise * self._noise_embed_scale
        draft_lens_cpu = self._draft_seq_lens_cpu_buf[:bs]
        draft_lens_cpu.copy_(host_lens)
        draft_lens_cpu.add_(B)
        draft_plan = translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix,
            seq_lens_cpu=host_lens,
            write_virtual=window.view(bs, N)[:, :B].reshape(-1),
            read_extent=B,
        )
        draft_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix,
            out_cache_loc=None,
            seq_lens_sum=int(draft_lens_cpu.sum()),
            seq_lens_cpu=draft_lens_cpu,
            positions=positions_2d.reshape(-1),
            input_embeds=noise.view(-1, noise.shape[-1]),
            spec_algorithm=self.model_runner.spec_algorithm,
            spec_info=self._draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            num_token_non_padded=(
                torch.full((), bs * B, dtype=torch.int32, device=device)
                if enable_num_token_non_padded()
                else None
            ),
            global_num_token_non_padded_cpu=bs * B,
            can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
        )
        draft_plan.bind(draft_batch, self.draft_model_runner.kv_index_translator)
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            draft_out = self.draft_model_runner.forward(draft_batch)
            graphed = draft_out.can_run_graph and self._draft_sampler is not None
            if not graphed:
                hidden = draft_out.logits_output.hidden_states
                if hidden is None:
                    raise RuntimeError("DDTREE: the draft model returned no hidden states")
                self._tree_sampler.head(hidden[: bs * B], block_ids.flatten())
            tree = self._tree_sampler.build(bs, graphed)
        tree_ids, cands = tree.input_ids[:bs], tree.candidates[:bs]
        parents, depths = tree.parents[:bs], tree.depths[:bs]

        # 2. the verify of the tree's N tokens, mask into the backend's verify-mask buffer
        custom_mask = self._verify_mask_buffer(bs, host_sum)
        positions = write_verify_layout(tree.mask[:bs], depths, prefix, custom_mask, tree.positions[:bs])
        verify_input = DFlashVerifyInput(
            draft_token=tree_ids.reshape(-1),
            positions=positions.reshape(-1),
            draft_token_num=N,
            custom_mask=custom_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=verify_plan,
        )
        batch.out_cache_loc = window
        saved_lens_cpu, saved_lens_sum = batch.seq_lens_cpu, batch.seq_lens_sum
        if saved_lens_cpu is not None:
            batch.seq_lens_cpu = saved_lens_cpu + N
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        elif draft_input.nxt_kv_lens_cpu is not None:
            # overlap with Triton: the scheduler's reserved bound, as DFlash gives its verify (without host lengths
            # an eager verify sizes its indices for the longest context)
            batch.seq_lens_cpu = draft_input.nxt_kv_lens_cpu
            batch.seq_lens_sum = int(draft_input.nxt_kv_lens_sum)
        verify_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker)
        batch.seq_lens_cpu, batch.seq_lens_sum = saved_lens_cpu, saved_lens_sum
        target_out = self.target_worker.forward_batch_generation(
            batch=None, forward_batch=verify_batch, is_verify=True, skip_attn_backend_init=True
        )
        logits_output = target_out.logits_output
        sampling_info = batch.sampling_info
        lp = self._target_logits_processor
        if lp is not None and lp.is_deferred_shard(logits_output.next_token_logits):
            logits_output.next_token_logits = lp.finish_deferred_gather(logits_output.next_token_logits)
        logits = logits_output.next_token_logits
        if sampling_info is not None:
            apply_dflash_verify_logits_adjustments(
                next_token_logits=logits, sampling_info=sampling_info, draft_token_num=N
            )

        # 3. the target's token at every node, the walk
        target = target_tokens(logits, sampling_info, bs, N, draft_input)
        greedy = sampling_info is None or sampling_info.is_all_greedy
        # every rank walks the same tree with rank 0's tokens (a sample draws from each rank's own RNG)
        self._tp_sync.sync(
            SpecTpSyncSite.DFLASH_ACCEPT_GREEDY if greedy else SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, target
        )
        key, self._accept_slot = (bs, self._accept_slot), 1 - self._accept_slot
        acc = self._accept.get(key)
        if acc is None:
            budgets = self._cut.policy.budgets if self._cut is not None else ()
            acc = self._accept[key] = AcceptBuffers(bs, N, L, device, budgets)
        # the walk and the commit in one launch: the path's slots to the window's front in req_to_token, the
        # commit's lengths, and where the drafter's KV of the path goes
        commit = WindowCommit(
            prefix, batch.req_pool_indices, req_to_token, self._draft_write_ids(verify_plan)
        )
        accept_walk(
            parents, cands, target, L, acc, live, tree.scores[:bs] if live is not None else None, commit
        )
        if live is not None:
            self._cut.record(acc, bs, tree.chain_expected)
        if batch.return_logprob:  # the emitted tokens' logprobs, from the rows of the path's nodes
            compute_spec_logprobs(batch, logits_output, target.reshape(-1), accept_index=acc.rows)
        commit_lens, new_seq_lens = acc.commit_lens, acc.new_seq_lens
        if on_publish is not None:
            on_publish(new_seq_lens)

        # 4. the drafter's KV from the path's hidden states
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE: the target verify returned no hidden states")
        hidden = hidden[: bs * N].view(bs, N, -1)
        path_hidden = torch.gather(hidden, 1, acc.path[:, :, None].expand(bs, B, hidden.shape[-1]))
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=path_hidden.reshape(bs * B, -1),
            cache_loc=acc.path_loc.reshape(-1),
            cache_loc_2d=acc.path_loc,
            positions=acc.draft_positions.reshape(-1),
            commit_lens=commit_lens,
        )
        logits_output.hidden_states = None
        # The scheduler's next writes to shared buffers (freeing a finished request's slots and row, a new request's
        # prefill into req_to_token) wait for the event the last shared-reading phase publishes; a captured verify
        # publishes one inside its graph, before this step's commit rewrote req_to_token. Publish one after it.
        done = torch.cuda.Event()
        done.record()
        self.target_worker.model_runner.shared_read_done_event = done

        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=acc.out_tokens.reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=self._make_next_draft_input_decode(
                bonus_tokens=acc.bonus, new_seq_lens=new_seq_lens
            ),
            speculative_num_draft_tokens=N,
            speculative_output_stride=B,
            new_seq_lens=new_seq_lens,
            routed_experts_output=target_out.routed_experts_output,
            indexer_topk_output=target_out.indexer_topk_output,
        )

    def _chain_step(self, batch, on_publish, grammar_barrier, pp_proxy_tensors):
        """auto's chain arm: DFlashWorkerV2's own decode step (the draft graph's tree sampler exports its top-1 chain
        as DFlash's sampler would, `TreeDraftSampler.out`), its verify replayed from the chain's runner, so the step
        costs what a DFLASH step costs. kdtree's live rows hold B (the cut's choose wrote them)."""
        runner = self.target_worker.model_runner
        tree_runner, runner.decode_cuda_graph_runner = runner.decode_cuda_graph_runner, self._chain_runner
        try:
            result = super().forward_batch_generation(batch, on_publish, grammar_barrier, pp_proxy_tensors)
        finally:
            runner.decode_cuda_graph_runner = tree_runner
        bs = len(batch.seq_lens)
        self._cut.chain_replays += bool(result.can_run_cuda_graph)
        self._cut.record_chain(result.accept_lens, bs, self._tree_sampler.outputs(bs).chain_expected)
        return result

    def _verify_mask_buffer(self, bs: int, host_sum: int) -> torch.Tensor:
        """Where the verify's ancestor masks go (SGLang's FULL layout: `kdtree.ddtree.tree.verify_layout`): the
        backend's verify-mask buffer when the batch fits it, as EAGLE does, so a graph replay's copy is a copy onto
        itself; an eager batch above the captured sizes gets a buffer of its own (host lengths known there)."""
        N = self.verify_width
        vm = self.target_worker.model_runner.attn_backend.verify_mask
        if vm is not None and vm.fits(bs):
            return vm.buffer
        return torch.zeros(N * host_sum + N * N * bs, dtype=torch.uint8, device=self.device)


def target_tokens(logits: torch.Tensor, sampling_info, bs: int, N: int, draft_input=None) -> torch.Tensor:
    """[bs, N]: the target's token at every node: its argmax, or one sample per node of SGLang's verify
    distribution (temperature, top-k, top-p as each request asks; build_speculative_verify_target_probs, with the
    scheduler's host-side top-k bounds so that it reads nothing back from the device)."""
    if sampling_info is None or sampling_info.is_all_greedy:
        return torch.argmax(logits, dim=-1).view(bs, N)
    probs = build_speculative_verify_target_probs(
        next_token_logits=logits,
        sampling_info=sampling_info,
        draft_token_num=N,
        bs=bs,
        max_top_k=getattr(draft_input, "max_top_k", None),
        uniform_top_k_value=getattr(draft_input, "uniform_top_k_value", None),
    ).view(bs * N, -1)
    # a categorical sample without a host round trip: the argmax of p / Exp(1)
    noise = torch.empty_like(probs).exponential_()
    return torch.argmax(probs / noise, dim=-1).view(bs, N)


class BudgetCut:
    """KDTREE_DDTREE_BUDGET=auto in a DDTreeWorker: each step, `kdtree.ddtree.budget.BudgetPolicy`'s b written as b + 1
    live tokens a request into kdtree's live-rows buffer (read by the verify's kernel in on, and by the walk), and the
    walk's statistics brought to the host through two pinned slots, read when their copy is done (never waited on).

    Under tensor parallelism every rank must verify and walk the same cut: rank 0's is broadcast in the stream."""

    def __init__(
        self, policy: BudgetPolicy, live: torch.Tensor, override, tp_group, device, chain_tokens: int
    ):
        self.policy, self.live, self.override, self.tp_group = policy, live, override, tp_group
        self.chain_tokens = chain_tokens  # B
        self.chain_max_bs = 0  # the chain's largest captured batch (none yet: offer_chain)
        C = len(policy.budgets)
        f32 = dict(dtype=torch.float32, device=device)
        # a step's statistics, one column an arm (the budgets', then the chain's): accepted, expected
        self.summed = torch.zeros(2, C + 1, **f32)
        self.tree_summed = torch.zeros(2, C, **f32)
        self.chain_sum = torch.zeros((), **f32)
        # (host copy, its event, (chosen b, bs) while a copy is in flight)
        self.slots = [
            [torch.zeros(2, C + 1, dtype=torch.float32, pin_memory=True), torch.cuda.Event(), None]
            for _ in (0, 1)
        ]
        self.turn = 0
        self.last_b: int | None = None
        self.steps = self.request_steps = 0
        self.live_tokens = 0  # tokens a request verified, summed over steps and requests
        self.chain_replays = 0  # chain steps whose target verify replayed the chain's graph

    @classmethod
    def make(cls, worker) -> BudgetCut | None:
        """None unless the setting is auto, the cap has a smaller budget to cut to, and kdtree's kernel is here (then:
        timed now, at start)."""
        from kdtree.install import current_override

        budgets = cut_budgets(worker.budget)
        if len(budgets) < 2:  # the cap alone: nothing to choose
            return None
        override = current_override()
        # off: nothing of kdtree's runs, and a rank started in off never switches live (kdtree.state.mode_file)
        if override is None or override.settings.ddtree_budget != "auto" or override.mode.mode is Mode.OFF:
            return None
        live = override.ddtree_live_rows(worker.device)
        if live is None:
            log.warning(
                "DDTREE: KDTREE_DDTREE_BUDGET=auto needs kdtree's kernel, unavailable here: the whole tree"
            )
            return None
        runner = worker.target_worker.model_runner
        cfg = runner.model_config
        group = get_dp_tp_group()  # the attention's tensor-parallel group (DDTREE refuses DP attention)
        heads = cfg.num_attention_heads // group.world_size
        layers = int(getattr(cfg, "num_attention_layers", None) or cfg.num_hidden_layers)
        cost = measure_cut_cost(
            heads, worker.budget, budgets, layers, worker.device, chain_tokens=worker.block_size
        )
        log.info(
            "DDTREE auto budget: budgets %s and the chain, verify attention at 8k tokens of prefix (ms): %s",
            budgets,
            {arm_name(b): round(cost.seconds(b, 8192) * 1e3, 3) for b in (*budgets, CHAIN)},
        )
        # under the overlap scheduler the host's interval after choosing a step times the step before it
        lag = 0 if get_schedule().disable_overlap_schedule else 1
        policy = BudgetPolicy(budgets, cost, lag=lag)
        cut = cls(policy, live, override, group, worker.device, worker.block_size)
        override.reporters["ddtree_budget"] = cut.snapshot
        return cut

    @property
    def chain_allowed(self) -> bool:
        """The chain arm changes what a step runs, so every rank must take it together; each rank's host chooses on its
        own (the cut's broadcast makes the values agree, not the control flow), so under tensor parallelism the
        policy keeps to the trees."""
        return self.tp_group is None or self.tp_group.world_size == 1

    def offer_chain(self, runner: ChainVerifyRunner | None) -> None:
        """The chain's verify graphs are captured (batches up to runner.max_bs): the policy may choose CHAIN there;
        None: no longer (its graphs are gone)."""
        self.chain_max_bs = 0 if runner is None else runner.max_bs
        self.policy.chain = runner is not None

    def choose(self, bs: int, sum_prefix: int) -> torch.Tensor | None:
        """This step's live tokens a request (the buffer, its first bs entries written), or None: a batch above the
        buffer is verified whole. `last_b` says what was chosen: a budget, or CHAIN (live: B)."""
        self._collect()
        if bs > self.live.numel():
            return None
        b = self.policy.choose(
            time.perf_counter(), bs, sum_prefix, self.override.serving(), chain_ok=bs <= self.chain_max_bs
        )
        tokens = self.chain_tokens if b == CHAIN else b + 1
        self.live[:bs].fill_(tokens)
        if self.tp_group is not None and self.tp_group.world_size > 1:
            self.tp_group.broadcast(self.live[:bs], src=0)
        self.last_b, self.steps, self.request_steps = b, self.steps + 1, self.request_steps + bs
        self.live_tokens += bs * tokens
        return self.live

    def record(self, acc: AcceptBuffers, bs: int, chain_expected: torch.Tensor) -> None:
        """After a tree step's walk: its statistics (and E_chain, which the draft graph computes every step) into a
        free slot's pinned copy (none free: this step is not learnt)."""
        C = len(self.policy.budgets)
        torch.sum(acc.stats[:bs], 0, out=self.tree_summed)
        self.summed[:, :C].copy_(self.tree_summed)
        self.summed[0, C].fill_(float("nan"))  # what the chain would have accepted: not measured
        self._send(bs, chain_expected)

    def record_chain(self, accept_lens: torch.Tensor, bs: int, chain_expected: torch.Tensor) -> None:
        """After a chain step: drafted tokens accepted (accept_lens: a + 1 a request) and E_chain; no tree's."""
        C = len(self.policy.budgets)
        self.summed[:, :C].fill_(float("nan"))
        torch.sum(accept_lens[:bs], 0, dtype=torch.float32, out=self.chain_sum)
        self.summed[0, C].copy_(self.chain_sum).sub_(bs)
        self._send(bs, chain_expected)

    def _send(self, bs: int, chain_expected: torch.Tensor) -> None:
        """E_chain (every step's: the draft graph computes it) into the chain's column, then the step's statistics into
        a free slot's pinned copy."""
        C = len(self.policy.budgets)
        torch.sum(chain_expected[:bs], 0, out=self.chain_sum)
        self.summed[1, C].copy_(self.chain_sum)
        self._collect()
        slot = self.slots[self.turn]
        if slot[2] is not None:  # its copy is still in flight
            return
        slot[0].copy_(self.summed, non_blocking=True)
        slot[1].record()
        slot[2] = (self.last_b, bs)
        self.turn = 1 - self.turn

    def _collect(self) -> None:
        n = len(self.policy.arms)
        for slot in self.slots:
            if slot[2] is not None and slot[1].query():
                accepted, expected = slot[0].tolist()
                self.policy.observe(slot[2][0], slot[2][1], accepted[:n], expected[:n])
                slot[2] = None

    def snapshot(self) -> dict:
        return {
            "steps": self.steps,
            "request_steps": self.request_steps,
            "live_tokens": self.live_tokens,
            "chain_replays": self.chain_replays,
            **self.policy.snapshot(),
        }


class ChainVerifyRunner(DecodeCudaGraphRunner):
    """The target's verify captured at the chain's width B, for auto's chain arm, beside the tree's runner (width N).

    It needs an attention backend of its own: a runner's construction remakes its backend's graph buffers
    (`init_cuda_graph_state`: the kv indices, the verify mask), which would leave the tree's graphs reading freed
    memory. kdtree's hook patches the backend's class, so this one's verify is kdtree's too; the capture keeps
    DFlash's causal verify (`kdtree.ddtree.spec.spec_info_with_tree_mask` skips a runner of this class)."""

    kdtree_chain = True

    @classmethod
    def capture_beside(cls, model_runner, block_size: int) -> ChainVerifyRunner | None:
        """The runner, or None (logged) where the tree's verify is not captured or the chain's cannot be: then auto
        chooses among the tree's budgets only."""
        why = cls.unavailable(model_runner)
        if why is not None:
            log.info("DDTREE auto: no chain arm (%s): trees only", why)
            return None
        tree_runner = model_runner.decode_cuda_graph_runner
        free_before = torch.cuda.mem_get_info()[0]
        try:
            backend = type(model_runner.attn_backend)(model_runner)
            runner = cls(model_runner, attn_backend=backend, speculative_num_draft_tokens=block_size)
        except Exception as e:  # noqa: BLE001 - any failure leaves the tree's arms, which are whole without it
            log.warning("DDTREE auto: the chain's verify graphs could not be captured (%s): trees only", e)
            return None
        runner.paired_with = tree_runner
        log.info(
            "DDTREE auto: the chain's verify captured at %d tokens, batch sizes %s, %.2f GB of GPU memory",
            block_size,
            runner.capture_bs,
            (free_before - torch.cuda.mem_get_info()[0]) / 2**30,
        )
        return runner

    @staticmethod
    def unavailable(model_runner) -> str | None:
        """Why the chain's verify cannot be captured beside the tree's (None: it can be tried)."""
        tree_runner = model_runner.decode_cuda_graph_runner
        if tree_runner is None or not getattr(tree_runner, "capture_bs", None):
            return "the target's verify is not captured"
        # a runner's construction also remakes LoRA's graph batch info and PD multiplexing's attention state, which
        # the tree's graphs were captured against
        if model_runner.lora_manager is not None or get_disagg().enable_pdmux:
            return "LoRA or PD multiplexing"
        return None

    def stale(self) -> bool:
        """The tree's graphs were captured again since (a weight update's or a role switch's recapture): this runner's
        were not, and may read what the recapture replaced. The worker then withdraws the chain arm (logged)."""
        if self.model_runner.decode_cuda_graph_runner is self.paired_with:
            return False
        log.warning("DDTREE auto: the target's verify graphs were captured again; the chain arm is withdrawn")
        return True
