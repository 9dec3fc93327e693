"""What the real-server GPU tests (tests/gpu/test_engine_gpu.py) rest on, checked on the CPU: the tiny model folder
and its tokenizer as SGLang 0.5.23 itself reads them, the torch-native stand-ins for the compiled functions the real
server calls on the GPU machine (against float64 and SGLang's own RMSNorm), the placeholders for the packages the GPU
machine lacks, and the sidecar's startup markers against an excerpt of a real server's log."""

from __future__ import annotations

import concurrent.futures
import math
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STANDINS = REPO / "standins"

torch = pytest.importorskip("torch", reason="torch is not installed (the server extra)")

import tiny_model  # noqa: E402
import torch_standins  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model.write_model(tmp_path_factory.mktemp("tiny") / "model", layers=8, nextn=True)


# ---- the model folder, read by SGLang -------------------------------------------------------------------------


@pytest.mark.sglang
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_sglang_reads_the_tiny_model_as_deepseek_v3_mla_with_the_scale_the_gpu_tests_expect(model):
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang_fixture import expected_scaling

    cfg = ModelConfig(str(model))
    assert (
        cfg.hf_config.architectures == ["DeepseekV3ForCausalLM"] and cfg.attention_arch == AttentionArch.MLA
    )
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads) == (512, 64, 8)
    assert cfg.num_hidden_layers == 8 and cfg.hf_config.num_nextn_predict_layers == 1
    assert cfg.context_len == tiny_model.MAX_POSITIONS
    # DeepSeek-V3's softmax scale with yarn: 192**-0.5 * mscale**2, not 576**-0.5
    assert math.isclose(cfg.scaling, expected_scaling(model), rel_tol=1e-12)
    assert math.isclose(cfg.scaling, 192**-0.5 * (0.1 * math.log(16) + 1) ** 2, rel_tol=1e-12)


def test_the_tokenizer_takes_text_and_gives_back_the_same_words(model):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(model)
    prompt = tiny_model.prompt_of(300, seed=7)
    ids = tok(prompt)["input_ids"]
    assert len(ids) == 301 and ids[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.decode(ids, skip_special_tokens=True) == prompt
    assert max(ids) < tiny_model.config()["vocab_size"]
    assert tiny_model.prompt_of(300, seed=7) == prompt != tiny_model.prompt_of(300, seed=8)


def test_a_depth_without_mtp_layers_is_refused_by_nextn_and_every_target_layer_is_dense():
    c = tiny_model.config(layers=61, nextn=False)
    assert c["num_hidden_layers"] == c["first_k_dense_replace"] == 61 and c["num_nextn_predict_layers"] == 0


# ---- the stand-ins for compiled functions ---------------------------------------------------------------------


def _rms64(x, w, eps):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_rmsnorm_stand_in_is_rmsnorm(dtype):
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 1024, generator=g) * 3).to(dtype)
    w = torch.rand(1024, generator=g).to(dtype)
    got = torch_standins.rmsnorm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    want = _rms64(x, w, 1e-6)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert ((got.double() - want).norm() / want.norm()).item() < tol
    out = torch.empty_like(x)
    assert torch_standins.rmsnorm(x, w, 1e-6, out=out) is out and torch.equal(out, got)


def test_fused_add_rmsnorm_stand_in_adds_into_the_residual_and_normalises_the_sum_in_place():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(17, 512, generator=g).to(torch.bfloat16)
    residual = torch.randn(17, 512, generator=g).to(torch.bfloat16)
    w = torch.rand(512, generator=g).to(torch.bfloat16)
    total = x.double() + residual.double()
    x_in, r_in = x.clone(), residual.clone()
    assert torch_standins.fused_add_rmsnorm(x_in, r_in, w, 1e-6) is None  # in place, as sgl_kernel's
    assert torch.equal(r_in, (x.float() + residual.float()).to(torch.bfloat16))
    want = _rms64(total, w, 1e-6)
    assert ((x_in.double() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.sglang
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_the_stand_ins_agree_with_sglangs_own_rmsnorm_forward_native():
    from sglang.srt.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(256, eps=1e-6).to(torch.bfloat16)
    norm.weight.data.copy_(torch.rand(256, generator=g))
    x = torch.randn(9, 256, generator=g).to(torch.bfloat16)
    residual = torch.randn(9, 256, generator=g).to(torch.bfloat16)
    assert torch.allclose(
        torch_standins.rmsnorm(x, norm.weight.data, 1e-6), norm.forward_native(x), atol=1e-2
    )
    want_x, want_r = norm.forward_native(x.clone(), residual.clone())
    x_in, r_in = x.clone(), residual.clone()
    torch_standins.fused_add_rmsnorm(x_in, r_in, norm.weight.data, 1e-6)
    assert torch.allclose(x_in, want_x, atol=1e-2) and torch.equal(r_in, want_r)


def test_only_the_functions_the_server_calls_are_stood_in_for():
    assert set(torch_standins.KNOWN) == {
        "sgl_kernel.rmsnorm",
        "sgl_kernel.fused_add_rmsnorm",
        "sgl_kernel.moe_align_block_size",
        "sgl_kernel.moe_sum_reduce",
        "sgl_kernel.utils.is_arch_support_pdl",
        "flashinfer.sampling.top_p_renorm_probs",
        "flashinfer.sampling.top_k_renorm_probs",
    }
    assert torch_standins.PATCHED == {
        "sglang.kernels.ops.speculative.sampling": {
            "tree_speculative_sampling_target_only": torch_standins.tree_speculative_sampling_target_only
        }
    }
    assert torch_standins.KNOWN["sgl_kernel.utils.is_arch_support_pdl"]() is False
    with pytest.raises(NotImplementedError, match="ignore_invalid_expert"):
        torch_standins.moe_align_block_size(*([None] * 7), False, True)


def test_tree_sampling_standin_walks_a_chain_as_the_kernel_does():
    """SGLang's TreeSpeculativeSamplingTargetOnly (kernels/jit/include/sgl_kernel/speculative/sampling.cuh) on DFLASH's
    chain buffers: a draft token is accepted where the target puts all its mass on it, the first one it does not is
    replaced by a sample of relu(target - rejected), and after a full chain the bonus token comes from the target."""
    bs, n, d = 3, 4, 6
    candidates = torch.tensor([[0, 2, 3, 1], [0, 5, 5, 5], [0, 1, 2, 3]])
    index = torch.arange(bs * n).view(bs, n)
    next_token = torch.tensor([1, 2, 3, -1]).expand(bs, n).clone()
    sibling = torch.full((bs, n), -1)
    target = torch.zeros(bs * n, d)
    # row 0 takes drafts 2, 3 and wants 4 for 1; row 1 wants 1 for 5; row 2 takes 1, 2, 3 and adds 5
    for r, tok in enumerate([2, 3, 4, 0, 1, 1, 1, 1, 1, 2, 3, 5]):
        target[r, tok] = 1.0
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept_index = torch.full((bs, n), -7, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    draft = torch.zeros_like(target)
    torch_standins.tree_speculative_sampling_target_only(
        predicts, accept_index, accept_num, candidates, index, next_token, sibling,
        torch.rand(bs, n), torch.rand(bs), target, draft,
    )  # fmt: skip
    assert accept_num.tolist() == [2, 0, 3]
    assert accept_index[0, :3].tolist() == [0, 1, 2] and accept_index[1, 0] == 4
    assert accept_index[2].tolist() == [8, 9, 10, 11]
    assert predicts[:3].tolist() == [2, 3, 4] and predicts[4] == 1 and predicts[8:].tolist() == [1, 2, 3, 5]
    assert draft[2, 1] == 0 and draft[4, 5] == 0  # rejected where the target had no mass: nothing to subtract


# ---- the placeholders for packages the GPU machine lacks ------------------------------------------------------


def _stubs():
    """standins/sglang_stubs.py as a module object, without installing its import hooks in this process."""
    source = (
        (STANDINS / "sglang_stubs.py")
        .read_text()
        .replace("sys.meta_path.append(", "(")
        .replace("sys.meta_path.insert(0, ", "(")
    )
    module = types.ModuleType("sglang_stubs_copy")
    exec(compile(source, str(STANDINS / "sglang_stubs.py"), "exec"), module.__dict__)
    return module


def test_xgrammar_placeholders_keep_pydantic_schemas_buildable_and_refuse_to_be_used():
    from typing import Union

    from pydantic import BaseModel, ValidationError

    stubs = _stubs()
    xgrammar = types.ModuleType("xgrammar")
    stubs.PLACEHOLDERS["xgrammar"](xgrammar)
    structural = types.ModuleType("xgrammar.structural_tag")
    stubs.PLACEHOLDERS["xgrammar.structural_tag"](structural)

    class Request(BaseModel):  # the shape of SGLang's CompletionRequest.response_format
        response_format: Union[dict, xgrammar.StructuralTag] | None = None  # noqa: UP007

    assert "response_format" in Request.model_json_schema()["properties"]
    assert Request(response_format={"type": "text"}).response_format == {"type": "text"}
    assert structural.TagFormat is structural.TagFormat  # one class per name
    with pytest.raises(ValidationError, match="placeholder"):
        xgrammar.StructuralTag(format={})


def test_setproctitle_placeholder_does_nothing_and_vllm_is_left_to_raise_importerror():
    stubs = _stubs()
    module = types.ModuleType("setproctitle")
    stubs.PLACEHOLDERS["setproctitle"](module)
    assert module.setproctitle("sglang::scheduler") is None
    assert "vllm" not in stubs.STUBBED and "vllm" not in stubs.PLACEHOLDERS  # SGLang try-imports it


# ---- the sidecar's startup markers ----------------------------------------------------------------------------


def test_the_sidecars_markers_follow_a_real_sglang_start_in_order():
    """tests/data/sglang-0.5.23-startup.log holds the marker lines of a real SGLang 0.5.23 start on the H200 (NGRAM,
    tp 1), written by tests/gpu/test_engine_gpu.py."""
    from sidecar.server_log import LOG_MARKERS, latest_marker

    excerpt = (REPO / "tests" / "data" / "sglang-0.5.23-startup.log").read_text()
    lines = excerpt.splitlines()
    names = [latest_marker(line).name for line in lines if latest_marker(line)]
    assert names[0] == "loading_weights" and names[-1] == "fired_up"
    first = [names.index(name) for name, _ in LOG_MARKERS]
    assert first == sorted(first), names  # every marker occurs, in start order
    assert (
        latest_marker("\n".join(lines[: names.index("capturing_cuda_graphs") + 1])).name
        == "capturing_cuda_graphs"
    )


# ---- what the end-to-end benchmark reads off the real server --------------------------------------------------


@pytest.mark.sglang
def test_the_stream_reader_takes_sglangs_own_chunks_and_times_decode_from_the_first_chunk(monkeypatch):
    """The chunks are SGLang 0.5.23's own response models, serialised as its streaming completion serialises them."""
    from real_server import read_stream
    from sglang.srt.entrypoints.openai.protocol import (
        CompletionResponseStreamChoice,
        CompletionStreamResponse,
        SglExt,
        SpecTokensDetails,
    )

    def chunk(index, ids):
        c = CompletionResponseStreamChoice(index=index, text=" ".join(f"w{i}" for i in ids), token_ids=ids)
        return f"data: {CompletionStreamResponse(id='r', model='m', choices=[c]).model_dump_json()}"

    closing = CompletionStreamResponse(
        id="r",
        model="m",
        choices=[],
        sglext=SglExt(spec_tokens_details=SpecTokensDetails(spec_accept_length=6.5)),
    )
    lines = [chunk(0, [7]), chunk(1, [9]), "", chunk(0, [8, 8, 8]), chunk(1, [5, 5]), chunk(0, [6]),
             f"data: {closing.model_dump_json()}", "data: [DONE]"]  # fmt: skip
    clock = iter(float(t) for t in range(100))  # one second per data line read
    monkeypatch.setattr("real_server.time.perf_counter", lambda: next(clock))
    (a, b), accept = read_stream(iter(lines), 2)
    assert a.token_ids == [7, 8, 8, 8, 6] and b.token_ids == [9, 5, 5] and accept == [6.5]
    assert (a.first_s, a.last_s, a.first_tokens) == (0.0, 4.0, 1)
    # decode: the tokens after the prefill's first one, over the time from that chunk to the last
    assert a.decode_tokens_per_s == pytest.approx(4 / 4.0) and b.decode_tokens_per_s == pytest.approx(2 / 2.0)


def test_the_profile_summary_counts_gpu_busy_time_once_where_kernels_overlap_and_groups_kernels_by_purpose():
    sys.path.insert(0, str(REPO / "kernel_build" / "bench" / "benchmarks"))
    import profile_engine

    kernel = lambda name, ts, dur: {"cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    trace = {"traceEvents": [
        kernel("_fwd_kernel", 0, 10), kernel("void kdtree::tree_verify_kernel<kdtree::Cfg<64>>", 5, 10),
        kernel("nvjet_sm90_tst_64x8", 30, 10), {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99},
    ]}  # fmt: skip
    s = profile_engine.summarize(trace, steps=2)
    assert s["kernels"] == 3 and s["wall_us_per_step"] == 20.0
    assert s["gpu_busy_us_per_step"] == 12.5  # [0, 15) and [30, 40): the overlap counted once
    # the named groups always, 0 where none ran; the rest by name
    assert s["groups_us_per_step"] == {"kdtree verify": 5.0, "triton extend (prefix + draft)": 5.0,
                                       "triton decode": 0.0, "gemm": 5.0}  # fmt: skip
    # the GPU idles 15 us before nvjet (over 20 us is a wait on the host only per gap, so none here); launches counted
    assert s["host_waits_us_per_step"] == {} and s["launches_per_step"] == 1.5
    late = profile_engine.summarize(
        {"traceEvents": trace["traceEvents"] + [kernel("index_kernel", 100, 5)]}, 1
    )
    assert late["host_waits_us_per_step"] == {
        "index_kernel": 60.0
    }  # charged to the launch that ended the gap
    assert late["launch_counts_per_step"]["index_kernel"] == 1
    assert profile_engine.summarize({"traceEvents": []}, 1) == {"error": "the trace has no kernel events"}


def test_the_profile_says_what_a_ddtree_step_adds_to_the_chains_kernel_by_kernel():
    sys.path.insert(0, str(REPO / "kernel_build" / "bench" / "benchmarks"))
    import profile_engine

    kernel = lambda name, ts, dur: {"cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    chain = [kernel("gemm", 0, 100), kernel("walk", 100, 10)]
    tree = [kernel("gemm", 0, 100), kernel("walk", 100, 30), kernel("index", 200, 5), kernel("index", 300, 5)]
    row = lambda algo, prompt, events: {  # noqa: E731
        "algorithm": algo, "prompt": prompt, "mode": "on", "summary": profile_engine.summarize({"traceEvents": events}, 1)
    }  # fmt: skip
    rows = [
        row("DFLASH-B16", 2048, chain),
        row("DDTREE-B16-T15", 2048, tree),
        row("DDTREE-B16-T15", 32768, tree),
    ]
    text = profile_engine.beyond(rows)
    assert (
        "DDTREE-B16-T15 beyond DFLASH-B16, prompt 2048, on: step wall +195 us, GPU busy +30 us, launches +2.0"
        in text
    )
    assert "32768" not in text  # no chain row at that prompt: nothing to compare with
    lines = [ln for ln in text.splitlines() if ln.startswith("| ") and "kernel" not in ln]
    assert lines[:2] == [
        "| walk | +20.0 | +0.0 |",
        "| index | +10.0 | +2.0 |",
    ]  # largest first; gemm is the same


@pytest.mark.parametrize(
    "arg, unknown",
    [
        (["--modes", "on,validate"], "validate"),
        (["--algorithms", "NGRAM-AUTO"], "NGRAM-AUTO"),
        (["--algorithms", "DFLASH-B16,DDTREE-B12"], "DDTREE-B12"),
    ],
)
def test_profile_engine_refuses_an_unknown_mode_or_server_before_anything_starts(arg, unknown):
    import subprocess

    script = REPO / "kernel_build/bench/benchmarks/profile_engine.py"
    p = subprocess.run([sys.executable, str(script), *arg], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown" in p.stderr and unknown in p.stderr, p.stderr
    # DDTREE keys, fixed or -AUTO, and one mode pass the check (here, without a GPU, the server is what is refused)
    ok = ["--algorithms", "DFLASH-B16,DDTREE-B16-T15,DDTREE-B16-AUTO", "--modes", "on"]
    p = subprocess.run([sys.executable, str(script), *ok], capture_output=True, text=True, timeout=120)
    assert "unknown" not in p.stderr, p.stderr


@pytest.mark.parametrize(
    "arg, named",
    [
        (["--oracle", "optimistic", "--algorithms", "DFLASH-B16"], "optimistic"),
        (["--oracle", "paper", "--algorithms", "DFLASH-B16,NGRAM"], "NGRAM"),
    ],
)
def test_profile_engine_refuses_an_oracle_it_cannot_run_before_anything_starts(arg, named):
    """--oracle scripts DFlash's drafter: a profile the oracle does not have, or an algorithm without that drafter,
    is refused naming it; a known profile with DFlash-drafted algorithms passes the check."""
    import subprocess

    script = REPO / "kernel_build/bench/benchmarks/profile_engine.py"
    p = subprocess.run([sys.executable, str(script), *arg], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--oracle" in p.stderr and named in p.stderr, p.stderr
    ok = ["--oracle", "pessimistic", "--algorithms", "DFLASH-B16,DDTREE-B16-T15", "--modes", "on"]
    p = subprocess.run([sys.executable, str(script), *ok], capture_output=True, text=True, timeout=120)
    assert "--oracle" not in p.stderr, p.stderr


def test_a_benchmarks_ddtree_key_runs_its_budget_fixed_or_auto():
    import real_server

    assert real_server.server_key("DDTREE-B16-T31-AUTO") == "DDTREE-B16-T31" in real_server.SPECULATIVE
    assert real_server.server_env("DDTREE-B16-T15") == {"KDTREE_DDTREE_BUDGET": "fixed"}
    assert real_server.server_env("DDTREE-B16-AUTO") == {"KDTREE_DDTREE_BUDGET": "auto"}
    assert real_server.server_env("DFLASH-B16") == {}
    # the tile-filling trees verify 2^k tokens
    for t in (15, 31):
        args = real_server.SPECULATIVE[f"DDTREE-B16-T{t}"]
        assert int(args[args.index("--speculative-num-draft-tokens") + 1]) == t + 1


@pytest.mark.sglang
def test_servers_started_together_get_rendezvous_ports_of_their_own_that_sglang_takes(tmp_path):
    """SGLang draws a server's rendezvous port at random unless --nccl-port names one; two servers starting together
    once drew the same (EADDRINUSE on the GPU machine). Every server of the harness names its own, and SGLang's own
    parser reads it."""
    import argparse

    import real_server
    from sglang.srt.server_args import ServerArgs

    from kdtree.config import Mode

    spec = real_server.ServerSpec("ngram-on", "NGRAM", Mode.ON)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # as the GPU suite's fleet makes them
        servers = list(
            pool.map(
                lambda i: real_server.RealServer(spec, tmp_path / f"s{i}", tmp_path / "model"), range(32)
            )
        )
    ports = [s.nccl_port for s in servers] + [s.port for s in servers]
    assert len(set(ports)) == len(ports)
    assert all(
        22000 <= s.nccl_port <= 29999 for s in servers
    )  # where SGLang draws it: no outgoing connection's
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(servers[0].args())
    assert args.nccl_port == servers[0].nccl_port and args.port == servers[0].port
