"""Several tensor-parallel ranks as separate processes, started the way SGLang starts its schedulers.

Each child is spawned (SGLang's start method) and runs the real prologue of SGLang 0.5.23's
run_scheduler_process on the CPU: load_plugins() (which installs kdtree's override through its entry
point), then publish(role="scheduler") with its rank. Attention itself needs a GPU and is not run here; what
is checked is the evidence path every rank takes: each writes its own record, and the sidecar's rank check
lists every rank and flags one that was killed (stale) or never reported (missing).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
import time

import pytest

from kdtree.config import Mode
from kdtree.state.mode_file import read_desired_mode
from kdtree.state.rank_records import read_records

pytestmark = pytest.mark.sglang
TP = 3

TINY_MLA = {  # a DeepSeek-V2-shaped config (MLA: kv_lora_rank 512 + rope 64) for ServerArgs; no weights
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "torch_dtype": "bfloat16",
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def scheduler_prologue(model_dir: str, tp_rank: int, tp_size: int, stop_file: str) -> None:
    """What sglang.srt.managers.scheduler.run_scheduler_process does before it builds the model."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    args = ServerArgs(model_path=model_dir, tp_size=tp_size, device="cpu", skip_tokenizer_init=True)
    world_rank = spawn_world_rank(args, tp_rank=tp_rank, pp_rank=0)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, dp_rank=None, gpu_id=tp_rank))
    # Wait for a stop file (not an Event: a rank killed while waiting on one would wedge its set()).
    deadline = time.monotonic() + 300
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        time.sleep(0.2)


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture
def ranks(tmp_path, monkeypatch):
    """TP scheduler processes in validate (spawned, each through scheduler_prologue), writing their records to
    tmp_path/state with a 0.3 s heartbeat: yields (state dir, processes); stops them at the end."""
    model = tmp_path / "tiny-mla"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_MLA))
    state = tmp_path / "state"
    monkeypatch.setenv("KDTREE_VERIFY", "validate")
    monkeypatch.setenv("KDTREE_STATE_DIR", str(state))
    monkeypatch.setenv("KDTREE_HEARTBEAT_S", "0.3")
    ctx = mp.get_context("spawn")
    stop = tmp_path / "stop"
    procs = [
        ctx.Process(target=scheduler_prologue, args=(str(model), r, TP, str(stop)), daemon=True)
        for r in range(TP)
    ]
    for p in procs:
        p.start()
    try:
        yield state, procs
    finally:
        stop.touch()
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()


def test_every_rank_reports_and_the_sidecar_flags_dead_and_missing_ranks(ranks):
    pytest.importorskip("sidecar.rank_evidence")
    from sidecar.rank_evidence import check_ranks, read_rank_views
    from sidecar.settings import SidecarSettings

    state, procs = ranks
    views = wait_for(
        lambda: len(read_records(state)) == TP and read_records(state), 240, f"{TP} rank records"
    )
    assert [v.record.tp_rank for v in views] == list(range(TP))
    assert {v.record.tp_size for v in views} == {TP}
    assert {v.record.pid for v in views} == {p.pid for p in procs}  # one record per scheduler process
    assert all(v.record.mode == "validate" and v.record.installed and not v.stale for v in views)

    def settings(tp):
        return SidecarSettings(
            state_dir=str(state), expected_tp_size=tp, heartbeat_stale_s=5.0, allow_open_admin=True
        )

    def check(tp):
        s = settings(tp)
        return check_ranks(s, read_rank_views(s), Mode.VALIDATE)

    assert check(TP).ok
    missing = check(TP + 1)
    assert not missing.ok and missing.problems == [f"rank {TP}: no record in {state}"]

    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join(10)
    dead = check(TP)
    assert not dead.ok
    assert dead.problems == [f"rank 1: record is stale (pid {procs[1].pid} is gone)"]


@pytest.mark.anyio
async def test_real_ranks_follow_a_live_flip_and_one_that_never_confirms_is_rolled_back(tmp_path, ranks):
    """Three ranks with kdtree installed by SGLang's own plugin loader, behind the real sidecar (the HTTP server
    is standins/standin_engine.py, a stand-in, writing no records): a live flip validate -> standby is confirmed
    by every rank through its own heartbeat; then, with rank 1 stopped (SIGSTOP), standby -> validate times out
    naming rank 1 and is rolled back live. No server restart is involved (the sidecar has no server control)."""
    from sidecar_harness import AUTH, make_settings, sidecar
    from standin_engine import StandinProcess, free_port

    state, procs = ranks
    (tmp_path / "http").mkdir()
    http = StandinProcess(free_port(), str(tmp_path / "http"), []).start()
    http.wait_port()
    settings = make_settings(
        state,
        http.port,
        expected_tp_size=TP,
        heartbeat_stale_s=60,
        live_flip_timeout_s=3,
        bake_probes=2,
        server_control="docker",  # with no container named: the sidecar has no server control at all
    )

    async def settle(c):
        while (st := (await c.get("/status")).json())["active_transition"] is not None:
            await asyncio.sleep(0.1)
        return st["transitions"][-1]

    try:
        wait_for(lambda: len(read_records(state)) == TP, 240, f"{TP} rank records")
        async with sidecar(settings, server=None) as c:
            r = await c.post("/mode", json={"mode": "standby", "reason": "live"}, headers=AUTH)
            assert r.status_code == 202 and r.json()["method"] == "live", r.json()
            flip = await settle(c)
            assert flip["outcome"] == "succeeded", flip
            print(f"live flip confirmed by every rank after {flip['confirmed_s']:.2f}s")
            assert flip["confirmed_s"] < 10  # the live-flip goal at the ranks' heartbeat
            assert {v.record.mode for v in read_records(state)} == {"standby"}

            os.kill(procs[1].pid, signal.SIGSTOP)  # alive, its record fresh enough, but it never switches
            try:
                r = await c.post("/mode", json={"mode": "validate"}, headers=AUTH)
                assert r.status_code == 202 and r.json()["method"] == "live"
                back = await settle(c)
            finally:
                os.kill(procs[1].pid, signal.SIGCONT)
        assert back["outcome"] == "rolled_back", back
        assert f"2/{TP} ranks confirmed mode validate" in back["failure"]
        assert "rank 1: still reports standby" in back["failure"]
        assert read_desired_mode(state) == Mode.STANDBY
        wait_for(
            lambda: {v.record.mode for v in read_records(state)} == {"standby"}, 10, "every rank in standby"
        )
    finally:
        http.stop()
