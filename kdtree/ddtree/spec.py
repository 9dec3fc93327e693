"""DDTREE's pieces for SGLang 0.5.23's speculative-algorithm registry: the server-args check, the spec class, and
`register()`, which kdtree's plugin calls in every SGLang process (inside the entry-point function, as SGLang's
plugins/__init__.py asks).

Settings (no new flags): `--speculative-num-draft-tokens` N = budget + 1 (the verify width: the root and `budget`
tree nodes), `--speculative-dflash-block-size` B = the DFlash drafter's block (one draft pass proposes depths
1..B-1). Importing this module imports SGLang.
"""

from __future__ import annotations

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

NAME = "DDTREE"
MAX_VERIFY_TOKENS = 1024  # N's limit in reconstruct_indices_from_tree_mask (SGLang's NGRAM tree op, reused)


def validate_server_args(cfg) -> None:
    """Refuse, in one line naming each fix, what DDTREE v1 does not support or a budget/block that cannot work.

    `cfg` is what SGLang hands a registered algorithm's validator: a read view of the server args, resolved up to
    the speculative step (page size, DP, grammar backend and CUDA-graph settings are resolved by then;
    arg_groups/pipeline.py). Writes nothing."""
    problems = []
    if cfg.speculative_draft_model_path is None:
        problems.append("DDTREE drafts with a DFlash drafter: pass --speculative-draft-model-path")
    # The target's verify reads the tree mask in Triton's layout, through kdtree's kernel or Triton's own; another
    # backend would verify the tree without it. None: not resolved yet, nothing known to refuse.
    backends = [
        f"{flag} triton (got {value!r})"
        for flag, value in (
            ("--attention-backend", cfg.attention_backend),
            ("--prefill-attention-backend", cfg.prefill_attention_backend),
            ("--decode-attention-backend", cfg.decode_attention_backend),
        )
        if value not in (None, "triton")
    ]
    if backends:
        problems.append(
            f"DDTREE's verify runs in SGLang's Triton attention backend: pass {', '.join(backends)}"
        )
    # another backend may have set the page size (FlashMLA: 64): the backend's fix comes first
    elif cfg.page_size is not None and cfg.page_size > 1:
        problems.append(
            f"DDTREE v1 commits a tree path slot by slot: pass --page-size 1 (got {cfg.page_size})"
        )
    if cfg.enable_dp_attention or cfg.attn_dp_size > 1:
        problems.append(
            "DDTREE v1 does not run with DP attention: drop --enable-dp-attention and --attn-dp-size "
            f"(got attn_dp_size={cfg.attn_dp_size})"
        )
    if cfg.speculative_eagle_topk not in (None, 1) or cfg.speculative_num_steps is not None:
        problems.append(
            "DDTREE's tree is set by its budget, not by EAGLE's top-k and steps: drop --speculative-eagle-topk and "
            "--speculative-num-steps (--speculative-num-draft-tokens N sets the budget N - 1, and each depth's top-K "
            f"is K = the budget) (got topk={cfg.speculative_eagle_topk}, steps={cfg.speculative_num_steps})"
        )
    if cfg.pp_size != 1:
        problems.append(
            f"DDTREE v1 does not run with pipeline parallelism: pass --pp-size 1 (got {cfg.pp_size})"
        )
    if getattr(cfg, "speculative_draft_window_size", None) is not None:
        problems.append("DDTREE v1 keeps the drafter's whole cache: drop --speculative-draft-window-size")
    if cfg.grammar_backend not in (None, "none"):
        problems.append(
            f"DDTREE v1 has no grammar-constrained decoding: pass --grammar-backend none "
            f"(got {cfg.grammar_backend!r}, which is also SGLang's choice when the flag is unset)"
        )
    n, block = cfg.speculative_num_draft_tokens, cfg.speculative_dflash_block_size
    if n is None or block is None:
        problems.append(
            "DDTREE needs --speculative-num-draft-tokens N (= tree budget + 1) and --speculative-dflash-block-size B"
            f" (the drafter's block) (got N={n}, B={block})"
        )
    elif block < 2:
        problems.append(
            f"--speculative-dflash-block-size must be at least 2, the root and one drafted depth (got {block})"
        )
    elif not block <= n <= MAX_VERIFY_TOKENS:
        problems.append(
            f"--speculative-num-draft-tokens (N = budget + 1) must lie in [B, {MAX_VERIFY_TOKENS}] for block B={block}: "
            f"a budget below B-1 cannot reach the drafter's last depth, above {MAX_VERIFY_TOKENS - 1} SGLang's tree op "
            f"cannot index it (got N={n})"
        )
    if problems:
        raise ValueError("; ".join(problems))


def _draft_block_size() -> int:
    """B from the published speculative config (set at launch; this runs in the server's processes)."""
    from sglang.srt.runtime_context import get_spec

    block = get_spec().speculative_dflash_block_size
    if block is None:
        raise ValueError(
            "DDTREE needs --speculative-dflash-block-size (validate_server_args refuses a launch without)"
        )
    return int(block)


class DDTreeSpec(CustomSpecAlgo):
    """DDTREE's answers to SGLang's algorithm predicates: DFlash-like drafting (target hidden-state capture, draft
    KV indexed by target slots, a draft forward as TARGET_VERIFY of width B), a verify of width N, no EAGLE relays.

    Also defines the methods SGLang 0.5.23 calls on every algorithm but CustomSpecAlgo lacks
    (carries_draft_hidden_states, create_future_map, need_topk, get_platform_worker_cls), with the enum's
    bodies for a non-EAGLE algorithm."""

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
        # the draft runner runs a block of B; the target verifies the tree's N tokens
        return _draft_block_size() if is_draft_worker else num_draft_tokens

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def get_platform_worker_cls(self):
        return None  # kdtree's own worker, never an out-of-tree platform's replacement

    def create_future_map(
        self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True, needs_confidence_relay: bool = False
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)


CAPTURE_HOOK_TARGET = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info"
)


def spec_info_with_tree_mask(original_fn, runner, *args, **kwargs):
    """AROUND hook on the decode graph runner's capture input: SGLang captures a DFlash-family target verify
    without a mask on Triton (its chain is causal), which would capture DDTREE's verify without its tree mask;
    for DDTREE's target runner the captured verify reads the runner's mask buffer, as NGRAM's does. The chain's runner
    (auto's chain arm, `kdtree.ddtree.worker.ChainVerifyRunner`) keeps DFlash's causal capture."""
    spec_info = original_fn(runner, *args, **kwargs)
    mr = runner.model_runner
    if (
        isinstance(mr.spec_algorithm, DDTreeSpec)
        and not mr.is_draft_worker
        and not getattr(runner, "kdtree_chain", False)
        and spec_info is not None
        and getattr(spec_info, "custom_mask", "absent") is None
    ):
        spec_info.custom_mask = runner.buffers.custom_mask
    return spec_info


def _worker_class(server_args):
    # imports SGLang's DFlash worker: only when a server builds one
    from kdtree.ddtree.worker import DDTreeWorker

    return DDTreeWorker


def register() -> bool:
    """Register DDTREE and its capture hook once per process. True if this call registered."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    try:
        SpeculativeAlgorithm.from_string(NAME)
        return False  # registered already (load_plugins ran before in this process)
    except ValueError:
        pass
    SpeculativeAlgorithm.register(
        NAME, supports_overlap=True, validate_server_args=validate_server_args, spec_class=DDTreeSpec
    )(_worker_class)
    HookRegistry.register(CAPTURE_HOOK_TARGET, spec_info_with_tree_mask, HookType.AROUND)
    return True
