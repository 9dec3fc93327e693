"""DDTREE's pieces for SGLang 0.5.23's speculative-algorithm registry: the spec class and `register()` (with the
server-args check of `kdtree.ddtree.server_args`), which kdtree's plugin calls in every SGLang process (inside the
entry-point function, as SGLang's plugins/__init__.py asks). Importing this module imports SGLang.
"""

from __future__ import annotations

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from kdtree.ddtree.server_args import validate_server_args

NAME = "DDTREE"


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
