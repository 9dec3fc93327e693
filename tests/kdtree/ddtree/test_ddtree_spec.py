"""DDTREE's server-args check (kdtree.ddtree.server_args, as SGLang runs it) and spec class against SGLang 0.5.23's
real ServerArgs, registry and speculative hook (CPU). kdtree's plugin registers DDTREE when SGLang loads plugins; the
registry test runs that in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="sglang needs torch (the server extra: pip install -e '.[server,dev]')")
pytest.importorskip("sglang", reason="sglang==0.5.23 is not installed (the server extra)")

from sglang.srt.arg_groups.overrides import record_foreign_defaults  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from kdtree.ddtree.server_args import validate_server_args  # noqa: E402

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning"),
]

ROOT = Path(__file__).resolve().parents[3]
GOOD = dict(
    model_path="unused",
    speculative_algorithm="DDTREE",
    speculative_draft_model_path="unused-drafter",
    page_size=1,
    grammar_backend="none",
    speculative_num_draft_tokens=33,
    speculative_dflash_block_size=16,
)


def check(**changes):
    """validate_server_args as SGLang calls it: through the read view it hands a registered algorithm."""
    record_foreign_defaults(ServerArgs(**{**GOOD, **changes}), "test", validate_server_args)


def test_a_supported_launch_passes():
    check()
    check(speculative_num_draft_tokens=16)  # budget B-1: the chain's size
    check(speculative_num_draft_tokens=1024, speculative_dflash_block_size=2)
    check(page_size=None, grammar_backend=None)  # unresolved: nothing known to refuse
    check(disable_overlap_schedule=True)  # overlap scheduling on (SGLang's default) or off
    check(attention_backend="triton", decode_attention_backend="triton", speculative_eagle_topk=1)


@pytest.mark.parametrize(
    "changes, fix",
    [
        (dict(page_size=16), "pass --page-size 1 (got 16)"),
        (dict(page_size=0), "pass --page-size 1 (got 0)"),  # SGLang would divide by it
        (
            dict(attn_dp_size=2, tp_size=2),
            "DDTREE v1 does not run with DP attention (got attn_dp_size=2): drop --attn-dp-size, or with the deprecated "
            "--enable-dp-attention (which makes --dp-size N the attention-DP width) drop it and pass --dp-size 1",
        ),
        (
            dict(attention_backend="fa3"),
            "verify runs in SGLang's Triton attention backend: pass --attention-backend",
        ),
        (
            dict(attention_backend="triton", decode_attention_backend="flashinfer"),
            "--decode-attention-backend triton",
        ),
        (dict(prefill_attention_backend="fa3"), "pass --prefill-attention-backend triton (got 'fa3')"),
        (dict(speculative_eagle_topk=4), "drop --speculative-eagle-topk 4 (--speculative-num-draft-tokens"),
        (dict(speculative_num_steps=3), "drop --speculative-num-steps 3 (--speculative-num-draft-tokens"),
        (
            dict(speculative_eagle_topk=4, speculative_num_steps=3),
            "drop --speculative-eagle-topk 4 and --speculative-num-steps 3 (",
        ),
        (dict(pp_size=2), "pass --pp-size 1 (got 2)"),
        (dict(dp_size=2), "pass --dp-size 1 and serve more replicas as more servers (got dp_size=2)"),
        (dict(grammar_backend="xgrammar"), "pass --grammar-backend none (got 'xgrammar'"),
        (dict(speculative_draft_model_path=None), "pass --speculative-draft-model-path"),
        (
            dict(speculative_dflash_block_size=None),
            "needs --speculative-dflash-block-size B, the DFlash drafter's",
        ),
        (
            dict(speculative_num_draft_tokens=None),
            "needs --speculative-num-draft-tokens N (= tree budget + 1), e.g. 33",
        ),
        (dict(speculative_dflash_block_size=1, speculative_num_draft_tokens=4), "at least 2"),
        (
            dict(speculative_num_draft_tokens=8),
            "must be at least the block B=16: a budget below B-1 cannot reach",
        ),
        (
            dict(speculative_num_draft_tokens=1025),
            "must be at most 1024: SGLang's tree op cannot index a larger tree",
        ),
    ],
    ids=lambda v: "-".join(f"{k}={v}" for k, v in v.items()) if isinstance(v, dict) else "",
)
def test_each_unsupported_setting_is_refused_in_one_line_naming_the_fix(changes, fix):
    with pytest.raises(ValueError) as err:
        check(**changes)
    assert fix in str(err.value)
    assert "\n" not in str(err.value) and " | " not in str(err.value)  # one problem, and only that one


def test_another_backends_page_size_is_not_blamed_on_the_user():
    """SGLang sets page size 64 for FlashMLA before DDTREE's check runs: the fix is the backend, and once it is
    triton the page size is the user's again."""
    with pytest.raises(ValueError) as err:
        check(attention_backend="flashmla", page_size=64)
    message = str(err.value)
    assert "--attention-backend triton (got 'flashmla')" in message and "--page-size" not in message


def test_several_problems_come_in_one_line():
    with pytest.raises(ValueError) as err:
        check(page_size=64, pp_size=2, grammar_backend="xgrammar")
    message = str(err.value)
    assert (
        "\n" not in message and message.count(" | ") == 2 and "; " not in message
    )  # "; fix:" is the launcher's
    assert "--page-size 1" in message and "--pp-size 1" in message and "--grammar-backend none" in message


# Registers DDTREE through SGLang's public API, resolves it, runs the real speculative hook (which calls the
# validator) and the spec class's methods; prints the results as JSON on the last line.
PROBE = """
import json, sys, torch
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.arg_groups.speculative_hook import handle_speculative_decoding
from sglang.srt.runtime_context import get_context
from sglang.srt.plugins import load_plugins
from kdtree.ddtree.server_args import validate_server_args
from kdtree.ddtree.spec import NAME, DDTreeSpec

load_plugins()  # kdtree's entry point among them registers DDTREE
load_plugins()  # a second load (launch_server, then the Engine) registers nothing twice
algo = SpeculativeAlgorithm.from_string("ddtree")
good = json.loads(sys.argv[1])
from kdtree import install
from kdtree.ddtree.spec import register, CAPTURE_HOOK_TARGET
from sglang.srt.plugins.hook_registry import HookRegistry
out = {"type": type(algo).__name__, "plugin": install.installed_by(), "again": register()}
out["hook"] = len(HookRegistry._hooks.get(CAPTURE_HOOK_TARGET, []))  # a private field: the registry has no reader
enum_methods = [n for n, v in vars(SpeculativeAlgorithm).items() if callable(v) and n[0] != "_"
                and not isinstance(v, (classmethod, staticmethod))]
out["missing"] = sorted(set(enum_methods) - set(dir(algo)))
args = ServerArgs(**good)
handle_speculative_decoding(args)
try:
    handle_speculative_decoding(ServerArgs(**{**good, "page_size": 16}))
    out["refused"] = None
except ValueError as e:
    out["refused"] = str(e)
get_context().set_server_args(args)
out["draft_width"] = algo.get_num_tokens_per_req_for_target_verify(33, True)
out["verify_width"] = algo.get_num_tokens_per_req_for_target_verify(33, False)
out["max_draft_tokens"] = algo.resolve_max_speculative_num_draft_tokens(args)
for name in ("is_dflash_family", "supports_target_verify_for_draft", "is_dflash", "is_eagle", "is_ngram",
             "need_topk", "carries_draft_hidden_states", "supports_grammar_overlap", "is_speculative", "has_draft_kv"):
    out[name] = getattr(algo, name)()
out["platform_worker"] = algo.get_platform_worker_cls()
out["supports_overlap"] = algo.supports_overlap
out["worker"] = algo.create_worker(args).__name__

class Pool:  # stand-in: the two attributes FutureMap reads from SGLang's ReqToTokenPool
    size = 8
    req_to_token = torch.zeros(8, 64, dtype=torch.int32)

future_map = algo.create_future_map(torch.device("cpu"), Pool())
out["future_map"] = [type(future_map).__name__, future_map.spec_algo is algo]
print(json.dumps(out))
"""


def test_registered_through_sglangs_registry_the_spec_answers_as_the_design_says(tmp_path):
    drafter = tmp_path / "drafter"  # the hook reads the drafter's config.json (a DFlash drafter, config only)
    drafter.mkdir()
    (drafter / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DFlashDraftModel"],
                "model_type": "qwen3",
                "hidden_size": 1024,
                "num_hidden_layers": 1,
                "num_attention_heads": 8,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "intermediate_size": 2048,
                "vocab_size": 8192,
                "dflash_config": {"block_size": 16, "mask_token_id": 3, "target_layer_ids": [1, 6]},
            }
        )
    )
    good = {**GOOD, "speculative_draft_model_path": str(drafter)}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDTREE_")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    env.update(KDTREE_VERIFY="validate", KDTREE_STATE_DIR=str(tmp_path / "state"))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(good)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["plugin"] == "entry-point"  # kdtree's plugin did load
    assert out["again"] is False  # registered once per process
    assert out["hook"] == 1  # the capture hook, once: that gives DDTREE's captured verify its tree mask
    assert out["worker"] == "DDTreeWorker"
    assert out["type"] == "DDTreeSpec"
    assert out["missing"] == []  # every method SGLang's enum has, the three 0.5.23 gaps included
    assert out["refused"] == "DDTREE v1 commits a tree path slot by slot: pass --page-size 1 (got 16)"
    assert (out["draft_width"], out["verify_width"], out["max_draft_tokens"]) == (16, 33, 33)
    assert out["is_dflash_family"] and out["supports_target_verify_for_draft"]
    assert out["is_speculative"] and out["has_draft_kv"]
    for name in ("is_dflash", "is_eagle", "is_ngram", "need_topk", "carries_draft_hidden_states"):
        assert out[name] is False, name
    assert out["supports_grammar_overlap"] is False
    assert out["supports_overlap"] is True  # the worker runs under overlap scheduling (GOOD leaves it on)
    assert out["platform_worker"] is None
    assert out["future_map"] == ["FutureMap", True]
