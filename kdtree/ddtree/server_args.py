"""DDTREE's check of SGLang's server arguments: what SGLang runs (registered by `kdtree.ddtree.spec`) once it has
resolved them, and what kdtree's launcher runs first on the arguments it is given (no SGLang import here: the launcher
starts without torch).

Settings (no new flags): `--speculative-num-draft-tokens` N = budget + 1 (the verify width: the root and `budget`
tree nodes), `--speculative-dflash-block-size` B = the DFlash drafter's block (one draft pass proposes depths
1..B-1).
"""

from __future__ import annotations

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
    elif cfg.page_size is not None and cfg.page_size != 1:  # 0 or less: SGLang divides by it
        problems.append(
            f"DDTREE v1 commits a tree path slot by slot: pass --page-size 1 (got {cfg.page_size})"
        )
    if cfg.enable_dp_attention or cfg.attn_dp_size > 1:
        # SGLang turns the deprecated --enable-dp-attention --dp-size N into attn_dp_size N: name both sources
        problems.append(
            f"DDTREE v1 does not run with DP attention (got attn_dp_size={cfg.attn_dp_size}): drop --attn-dp-size, "
            "or with the deprecated --enable-dp-attention (which makes --dp-size N the attention-DP width) drop it "
            "and pass --dp-size 1"
        )
    # Replicas (SGLang's DP controller: one scheduler each) have not run DDTREE; with the deprecated
    # --enable-dp-attention, --dp-size is the attention-DP width, refused above.
    if not cfg.enable_dp_attention and cfg.dp_size > 1:
        problems.append(
            "DDTREE v1 has not run with data-parallel replicas: pass --dp-size 1 and serve more replicas as more "
            f"servers (got dp_size={cfg.dp_size})"
        )
    eagle = {
        f"--speculative-eagle-topk {cfg.speculative_eagle_topk}": cfg.speculative_eagle_topk not in (None, 1),
        f"--speculative-num-steps {cfg.speculative_num_steps}": cfg.speculative_num_steps is not None,
    }
    if given := [flag for flag, set_ in eagle.items() if set_]:
        problems.append(
            f"DDTREE's tree is set by its budget, not by EAGLE's top-k and steps: drop {' and '.join(given)} "
            "(--speculative-num-draft-tokens N sets the budget N - 1, and each depth's top-K is K = the budget)"
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
    if n is None:
        problems.append(
            "DDTREE needs --speculative-num-draft-tokens N (= tree budget + 1), e.g. 33 for a budget of 32"
        )
    if block is None:
        problems.append(
            "DDTREE needs --speculative-dflash-block-size B, the DFlash drafter's block (its config.json's "
            "dflash_config.block_size)"
        )
    if block is not None and block < 2:
        problems.append(
            f"--speculative-dflash-block-size must be at least 2, the root and one drafted depth (got {block})"
        )
    elif n is not None and block is not None and n < block:
        problems.append(
            f"--speculative-num-draft-tokens N (= budget + 1) must be at least the block B={block}: a budget below "
            f"B-1 cannot reach the drafter's last depth, so pass {block} or more (got N={n})"
        )
    if n is not None and n > MAX_VERIFY_TOKENS:
        problems.append(
            f"--speculative-num-draft-tokens N (= budget + 1) must be at most {MAX_VERIFY_TOKENS}: SGLang's tree op "
            f"cannot index a larger tree, so pass {MAX_VERIFY_TOKENS} or less (got N={n})"
        )
    if problems:
        raise ValueError(" | ".join(problems))  # "; " is what the launcher puts before its fix
