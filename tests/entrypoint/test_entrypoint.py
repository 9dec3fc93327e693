"""The server launcher's checks, on CPU: GPU and kernel-library probes are injected test doubles."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from entrypoint import launch
from entrypoint.launch import EXIT_CONFIG, Gpu, LaunchError, LauncherSettings, main
from kdtree.config import Mode
from kdtree.state.mode_file import write_desired_mode
from kdtree.state.process_record import read_process_record

REPO = Path(__file__).resolve().parents[2]
H200 = Gpu(0, "NVIDIA H200", (9, 0))
RTX_PRO = Gpu(0, "NVIDIA RTX PRO 6000 Blackwell", (12, 0))


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "models" / "DeepSeek-V2-Lite"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture(autouse=True)
def env(monkeypatch, tmp_path):
    for var in (
        "KDTREE_VERIFY",
        "KDTREE_ALLOW_OTHER_BACKEND",
        "KDTREE_KERNEL_LIB",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "KDTREE_SERVER_API_KEY",
    ):
        monkeypatch.delenv(var, raising=False)
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("KDTREE_STATE_DIR", str(state))
    monkeypatch.setenv("KDTREE_VERIFY", "validate")
    return state


def args(model, *extra):
    return [
        "--model-path",
        str(model),
        "--attention-backend",
        "triton",
        "--speculative-algorithm",
        "NGRAM",
        *extra,
    ]


def gpus(n, gpu=H200):
    return lambda: [Gpu(i, gpu.name, gpu.capability) for i in range(n)]


def run(argv, *, n_gpus=1, gpu=H200, archs=(90, 100, 120)):
    """main() with test doubles; returns (exit code, the server's (path, argv, env) or None)."""
    calls = []
    rc = launch.main(
        argv,
        environ={"PATH": "/usr/bin"},
        serve=lambda sup, argv, env: calls.append((argv[0], argv, env)) or 0,
        gpus=gpus(n_gpus, gpu),
        archs=lambda: list(archs),
    )
    return rc, (calls[0] if calls else None)


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one line, always
    assert err[0].startswith("kdtree launcher: error: ")
    return err[0]


def test_good_configuration_starts_sglang_with_the_mode_exported(model, capsys):
    rc, call = run(args(model, "--tp-size", "1"))
    assert rc == 0
    path, argv, env = call
    assert argv[1:3] == ["-m", "sglang.launch_server"] and argv[3:] == args(model, "--tp-size", "1")
    assert env["KDTREE_VERIFY"] == "validate" and env["PATH"] == "/usr/bin"
    summary = capsys.readouterr().err.strip().splitlines()
    assert len(summary) == 1  # the effective configuration, printed once
    assert "mode=validate (from KDTREE_VERIFY)" in summary[0] and "NVIDIA H200 sm_90" in summary[0]


def test_the_sidecar_mode_file_wins_over_the_environment(model, env, capsys):
    write_desired_mode(env, "on")
    rc, (_, _, child_env) = run(args(model))
    assert rc == 0 and child_env["KDTREE_VERIFY"] == "on"
    assert "(written by the sidecar)" in capsys.readouterr().err


def test_the_api_key_setting_becomes_sglangs_api_key_and_is_never_printed(model, monkeypatch, capsys):
    """One setting for the key: the launcher passes it to SGLang; the sidecar's probe reads the same variable."""
    key = "sk-0123456789abcdef"
    monkeypatch.setenv("KDTREE_SERVER_API_KEY", key)
    rc, (_, argv, env) = run(args(model))
    assert rc == 0 and argv[-2:] == ["--api-key", key]
    assert "KDTREE_SERVER_API_KEY" not in env  # SGLang has it as its argument
    out = capsys.readouterr()
    assert key not in out.err + out.out and "api key: from KDTREE_SERVER_API_KEY" in out.err


def test_an_api_key_in_the_server_arguments_is_refused_naming_the_setting(model, capsys):
    assert run(args(model, "--api-key", "sk-x"))[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert "--api-key is in the server's arguments" in line and "set KDTREE_SERVER_API_KEY instead" in line
    assert "sk-x" not in line


def test_invalid_kdtree_verify(model, monkeypatch, capsys):
    monkeypatch.setenv("KDTREE_VERIFY", "shadow")
    assert run(args(model)) == (EXIT_CONFIG, None)
    assert "KDTREE_VERIFY='shadow' is invalid: set it to one of: off, validate, on" in error_line(capsys)


def test_a_number_for_the_ddtree_budget_setting_points_at_the_tree_size_argument(model, monkeypatch, capsys):
    monkeypatch.setenv("KDTREE_DDTREE_BUDGET", "16")  # the natural misreading: the budget itself
    assert run(args(model)) == (EXIT_CONFIG, None)
    line = error_line(capsys)
    assert "KDTREE_DDTREE_BUDGET='16' is invalid" in line
    assert (
        "fix: set auto or fixed; the tree's size is the server argument --speculative-num-draft-tokens N"
        in line
    )


def test_invalid_mode_file(model, env, capsys):
    (env / "mode").write_text("maybe\n")
    assert run(args(model))[0] == EXIT_CONFIG
    assert "holds 'maybe': expected one of off, validate, on, standby; fix or delete the file" in error_line(
        capsys
    )


def test_invalid_launcher_setting(model, monkeypatch, capsys):
    monkeypatch.setenv("KDTREE_ALLOW_OTHER_BACKEND", "perhaps")
    assert run(args(model))[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert (
        "KDTREE_ALLOW_OTHER_BACKEND='perhaps' is invalid" in line and "fix: set it to true or false" in line
    )


def test_tp_size_above_visible_gpus(model, capsys):
    assert run(args(model, "--tp-size", "8"), n_gpus=2)[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert "; fix: " in line
    assert "--tp-size 8 needs 8 GPUs on this node, 2 visible" in line and "KDTREE_TP_SIZE" in line


def test_more_gpus_visible_than_tp_size_names_both_settings(model, capsys):
    assert run(args(model, "--tp-size", "1"), n_gpus=8)[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert "8 GPUs are visible and --tp-size 1 uses 1" in line
    assert "`count:`" in line and "--tp-size 8 (KDTREE_TP_SIZE;" in line
    # where the -f files set it, not the setting
    assert "the server command's --tp-size and KDTREE_EXPECTED_TP_SIZE in that file" in line
    # every compose file the message sends one to for `count:` has one
    reserve = line.split("`count:`", 1)[1].split("Kubernetes", 1)[0]
    named = re.findall(r"compose[\w./-]*\.yaml", reserve)
    assert named and all("count:" in (REPO / f).read_text() for f in named), named


def test_more_gpus_visible_in_a_group_suggests_the_groups_tp_size(model, capsys):
    """Over --nnodes 2, 8 visible GPUs a node make --tp-size 16, not the 8 already given."""
    argv = args(model, "--tp-size", "8", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "a:1")
    assert run(argv, n_gpus=8)[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert "8 GPUs are visible and --tp-size 8 over --nnodes 2 uses 4 on this node" in line
    assert "set --tp-size 16 (" in line


def test_tensor_parallel_alias_and_equals_form(model, capsys):
    assert run(args(model, "--tensor-parallel-size=4"), n_gpus=2)[0] == EXIT_CONFIG
    assert "--tp-size 4 needs 4 GPUs" in error_line(capsys)


@pytest.mark.parametrize("layout", [["--dp-size", "2"], ["--data-parallel-size=2"], ["--pp-size", "2"]])
def test_replicas_and_pipeline_stages_are_refused_while_kdtree_runs(model, capsys, layout):
    # Several schedulers would share a tp rank, and so one status record file.
    assert run(args(model, *layout), n_gpus=8)[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert "runs several schedulers per tp rank" in line and "--attn-dp-size" in line
    assert "KDTREE_VERIFY=off" in line


@pytest.mark.parametrize("layout", [["--pp-size", "2"], ["--dp-size", "2"]])
def test_ddtrees_layout_refusal_offers_no_layout_it_does_not_run(model, tmp_path, capsys, layout):
    """DDTREE runs no pipeline stages, no attention DP and no data-parallel replicas in any mode (its own check, in
    SGLang and in the launcher): neither KDTREE_VERIFY=off nor --attn-dp-size is offered as the fix."""
    draft = ["--speculative-draft-model-path", str(tmp_path)]
    (tmp_path / "config.json").write_text("{}")
    assert run([*spec(model, "DDTREE", *draft, *DDTREE_ARGS), *layout], n_gpus=8)[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert line.startswith("kdtree launcher: error: DDTREE's server arguments: ")
    assert ("pass --pp-size 1" if "--pp-size" in layout else "pass --dp-size 1") in line
    assert "KDTREE_VERIFY=off" not in line and "--attn-dp-size" not in line


def test_too_few_gpus_names_the_size_that_asks_for_them(model, monkeypatch, capsys):
    monkeypatch.setenv("KDTREE_VERIFY", "off")  # pipeline stages are refused while kdtree runs
    assert run(args(model, "--pp-size", "2"), n_gpus=1)[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert "--tp-size 1 x --pp-size 2 needs 2 GPUs on this node, 1 visible" in line
    assert "or lower --pp-size to match" in line  # not --tp-size, already 1


GROUP = [
    "--dist-init-addr",
    "kdtree-0.kdtree.default:20000",
]  # as LeaderWorkerSet's $(LWS_LEADER_ADDRESS):20000


@pytest.mark.parametrize("mode", ["validate", "off"])
@pytest.mark.parametrize("node", ["0", "1"])
def test_a_node_of_a_multi_node_group_starts_with_its_share_of_the_ranks(
    model, monkeypatch, capsys, node, mode
):
    # LeaderWorkerSet's server command: --nnodes $(LWS_GROUP_SIZE) --node-rank $(LWS_WORKER_INDEX) ...
    monkeypatch.setenv("KDTREE_VERIFY", mode)
    argv = args(model, "--tp-size", "16", "--nnodes", "2", "--node-rank", node, *GROUP)
    rc, call = run(argv, n_gpus=8)
    assert rc == 0 and call[1][-len(argv) :] == argv  # SGLang gets the arguments as they came
    first = int(node) * 8
    assert f"tp=16 pp=1 dp=1 nnodes=2 node_rank={node} ranks={first}..{first + 7} " in capsys.readouterr().err
    assert run(args(model, "--tp-size", "8", "--nnodes", "1"), n_gpus=8)[0] == 0


@pytest.mark.parametrize(
    "extra, n_gpus, problem, fix",
    [
        (["--tp-size", "12", "--nnodes", "8", *GROUP], 8, "--tp-size 12 is not divisible by --nnodes 8",
         "set --tp-size to a multiple of 8"),
        (["--tp-size", "16", "--nnodes", "2", "--node-rank", "2", *GROUP], 8, "--node-rank 2 is outside 0 .. 1",
         "$(LWS_WORKER_INDEX)"),
        (["--tp-size", "16", "--nnodes=2", "--node-rank", "-1", *GROUP], 8, "--node-rank -1 is outside", "index"),
        (["--tp-size", "16", "--nnodes", "2"], 8, "--nnodes 2 without --dist-init-addr",
         "--dist-init-addr $(LWS_LEADER_ADDRESS):20000"),
        (["--tp-size", "16", "--nnodes", "2", "--dist-init-addr", "leader"], 8, "is not HOST:PORT", "20000"),
        (["--tp-size", "16", "--nnodes", "2", *GROUP], 4, "--tp-size 16 over --nnodes 2 needs 8 GPUs on this node, "
         "4 visible", "reserve that many GPUs"),
        (["--tp-size", "16", "--nnodes", "2", *GROUP], 16, "16 GPUs are visible and --tp-size 16 over --nnodes 2 uses "
         "8 on this node", "reserve 8"),
        (["--tp-size", "8", "--node-rank", "1"], 8, "--node-rank 1 with --nnodes 1", "drop --node-rank"),
        (["--tp-size", "16", "--nnodes", "2", "--pp-size", "2", *GROUP], 8, "kdtree spreads tensor parallelism only",
         "--pp-size 1 --dp-size 1"),
    ],
)  # fmt: skip
def test_multi_node_arguments_are_refused_naming_the_problem_and_the_fix(
    model, capsys, extra, n_gpus, problem, fix
):
    assert run(args(model, *extra), n_gpus=n_gpus)[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert problem in line and fix in line.split("; fix: ", 1)[1], line


@pytest.mark.parametrize("in_place", [False, True])
def test_a_restart_request_ends_the_container_or_restarts_in_place(model, env, monkeypatch, capsys, in_place):
    """KDTREE_RESTART_IN_PLACE (a group under LeaderWorkerSet): the server that stopped for the sidecar's restart
    request starts again in this process, as a new start in the mode file's mode; without it the launcher exits."""
    if in_place:
        monkeypatch.setenv("KDTREE_RESTART_IN_PLACE", "1")
    starts = []

    def serve(sup, argv, environ):
        starts.append((sup.record.starts, environ["KDTREE_VERIFY"]))
        if len(starts) == 1:
            write_desired_mode(env, Mode.OFF)  # the sidecar writes the mode file, then asks for the restart
            sup.record.restart_request = "r1"  # what the watcher records when it acts on the request
            return sup.finish(143)
        return sup.finish(0)

    rc = launch.main(args(model), environ={"PATH": "/usr/bin"}, serve=serve, gpus=gpus(1), archs=lambda: [90])
    if in_place:
        assert rc == 0 and starts == [(1, "validate"), (2, "off")]
        assert "restarting the server in place" in capsys.readouterr().err
    else:
        assert rc == 143 and starts == [(1, "validate")]
    assert read_process_record(env).starts == len(starts)


def test_attention_dp_keeps_one_scheduler_per_tp_rank(model):
    for layout in (["--attn-dp-size", "2"], ["--dp-size", "2", "--enable-dp-attention"]):
        rc, call = run(args(model, "--tp-size", "2", *layout), n_gpus=2)
        assert rc == 0 and call is not None, layout


def test_replicas_count_towards_the_gpus_needed(model, monkeypatch, capsys):
    monkeypatch.setenv("KDTREE_VERIFY", "off")  # replicas are allowed when kdtree is off
    assert run(args(model, "--tp-size", "4", "--dp-size", "2"), n_gpus=4)[0] == EXIT_CONFIG
    assert "--tp-size 4 x --dp-size 2 needs 8 GPUs on this node, 4 visible" in error_line(capsys)
    rc, call = run(args(model, "--tp-size", "4", "--dp-size", "2"), n_gpus=8)
    assert rc == 0 and call is not None


def test_unreadable_tp_size(model, capsys):
    assert run(args(model, "--tp-size", "eight"))[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert "unreadable sglang.launch_server arguments: argument --tp-size" in line
    assert (
        "fix: correct it where the server's arguments are set (compose.yaml: KDTREE_SPECULATIVE_ARGS" in line
    )


def test_no_gpu_visible(model, capsys):
    assert run(args(model), n_gpus=0)[0] == EXIT_CONFIG
    assert "no CUDA GPU is visible" in error_line(capsys)


def test_gpu_architecture_missing_from_the_library(model, capsys):
    assert run(args(model), gpu=RTX_PRO, archs=(90, 100))[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert (
        "GPU 0 (NVIDIA RTX PRO 6000 Blackwell) is sm_120; the kdtree library has code for sm_90, sm_100 only"
        in line
    )
    assert 'KDTREE_CUDA_ARCHS="90;100;120"' in line


def test_newer_minor_version_runs_older_sass(model):
    assert run(args(model), gpu=Gpu(0, "sm_121 part", (12, 1)), archs=(90, 120))[0] == 0


def test_missing_library_in_validate_mode(model, capsys):
    assert run(args(model), archs=())[0] == EXIT_CONFIG
    assert "KDTREE_VERIFY=validate but the kdtree kernel library is missing" in error_line(capsys)


def test_off_mode_needs_no_kernel_code_for_the_gpu(model, monkeypatch):
    monkeypatch.setenv("KDTREE_VERIFY", "off")
    assert run(args(model), gpu=RTX_PRO, archs=(90,))[0] == 0


def test_missing_model_path(tmp_path, capsys):
    assert run(args(tmp_path / "models" / "absent"))[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert f"--model-path {tmp_path}/models/absent does not exist; fix: check the path" in line
    assert "container" not in line  # the launcher may run on a host too


def test_unreadable_model_path(model, monkeypatch, capsys):
    real = launch.os.access
    monkeypatch.setattr(
        launch.os, "access", lambda path, mode: real(path, mode) and "models" not in str(path)
    )
    assert run(args(model))[0] == EXIT_CONFIG
    assert "is not readable by uid" in error_line(capsys)


def test_hub_model_id_is_left_to_sglang(model):
    argv = ["--model-path", "deepseek-ai/DeepSeek-V2-Lite", *args(model)[2:]]
    assert run(argv)[0] == 0


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_hub_model_id_offline_is_refused_naming_the_download(model, monkeypatch, capsys, var):
    """The stack sets HF_HUB_OFFLINE=1: SGLang would fail minutes later trying to download."""
    monkeypatch.setenv(var, "1")
    argv = ["--model-path", "deepseek-ai/DeepSeek-V2-Lite", *args(model)[2:]]
    assert run(argv)[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert (
        "--model-path deepseek-ai/DeepSeek-V2-Lite is no local folder" in line
        and f"{var}=1 and it is not in" in line
    )
    assert "fix: download it where there is network (hf download deepseek-ai/DeepSeek-V2-Lite " in line
    assert "KDTREE_MODEL names the model's folder" in line and "/models/DeepSeek-V2-Lite" in line
    draft = spec(model, "EAGLE3", "--speculative-draft-model-path", "org/draft")
    assert run(draft)[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert "--speculative-draft-model-path org/draft is no local folder" in line
    # the drafter is no KDTREE_MODEL: following that fix would serve the drafter as the model
    assert "/models/draft" in line and "KDTREE_MODEL=" not in line and "KDTREE_MODEL names" not in line
    monkeypatch.setenv(var, "0")
    assert run(argv)[0] == 0
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the first one set decides, as huggingface_hub reads them
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert run(argv)[0] == 0


def test_hub_model_id_offline_in_the_local_cache_is_left_to_sglang(model, monkeypatch, tmp_path):
    """Offline, SGLang loads a repo id from the Hugging Face cache: one whose config.json is there passes."""
    constants = pytest.importorskip("huggingface_hub.constants", reason="huggingface_hub (the server extra)")
    cache = tmp_path / "hub"
    repo = cache / "models--deepseek-ai--DeepSeek-V2-Lite"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["--model-path", "deepseek-ai/DeepSeek-V2-Lite", *args(model)[2:]]
    assert run(argv)[0] == 0
    assert run(["--model-path", "deepseek-ai/Other", *args(model)[2:]])[0] == EXIT_CONFIG


def test_a_missing_state_dir_is_refused_and_never_created(model, monkeypatch, tmp_path, capsys):
    """Outside the image nothing has made /var/run/kdtree: the launcher names KDTREE_STATE_DIR, creates nothing
    (the sidecar would never read it), and records nothing (there is nowhere to)."""
    absent = tmp_path / "absent"
    monkeypatch.setenv("KDTREE_STATE_DIR", str(absent))
    assert run(args(model))[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert f"KDTREE_STATE_DIR={absent} does not exist; fix: set KDTREE_STATE_DIR to a folder" in line
    assert not absent.exists()


def test_the_state_dir_check_names_the_default_and_the_uid(tmp_path, monkeypatch):
    monkeypatch.delenv("KDTREE_STATE_DIR")
    with pytest.raises(LaunchError, match=r"KDTREE_STATE_DIR is not set and its default \S+ does not exist"):
        launch.check_state_dir(str(tmp_path / "absent"), named=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(LaunchError, match="is not a directory"):
        launch.check_state_dir(str(tmp_path / "file"), named=False)
    monkeypatch.setattr(launch.os, "access", lambda path, mode: False)
    with pytest.raises(LaunchError, match=r"is not writable by uid \d+; fix: make it writable by uid"):
        launch.check_state_dir(str(tmp_path), named=True)
    assert LauncherSettings.model_fields["state_dir"].default == "/var/run/kdtree"  # what the image creates


def test_model_path_missing_entirely(capsys):
    assert run(["--attention-backend", "triton", "--speculative-algorithm", "NGRAM"])[0] == EXIT_CONFIG
    assert "--model-path is missing" in error_line(capsys)


def test_attention_backend_must_be_triton(model, capsys):
    argv = [
        "--model-path",
        str(model),
        "--attention-backend",
        "flashinfer",
        "--speculative-algorithm",
        "NGRAM",
    ]
    assert run(argv)[0] == EXIT_CONFIG
    assert "--attention-backend flashinfer: kdtree verifies only inside the triton backend" in error_line(
        capsys
    )


def test_decode_backend_override_must_be_triton_too(model, capsys):
    assert run(args(model, "--decode-attention-backend", "flashmla"))[0] == EXIT_CONFIG
    assert "--decode-attention-backend flashmla" in error_line(capsys)


def test_attention_backend_unset(model, capsys):
    argv = ["--model-path", str(model), "--speculative-algorithm", "NGRAM"]
    assert run(argv)[0] == EXIT_CONFIG
    assert "--attention-backend is not set" in error_line(capsys)


def test_other_backend_allowed_explicitly(model, monkeypatch):
    monkeypatch.setenv("KDTREE_ALLOW_OTHER_BACKEND", "1")
    argv = [
        "--model-path",
        str(model),
        "--attention-backend",
        "flashinfer",
        "--speculative-algorithm",
        "NGRAM",
    ]
    assert run(argv)[0] == 0


def test_speculative_algorithm_required(model, capsys):
    assert run(["--model-path", str(model), "--attention-backend", "triton"])[0] == EXIT_CONFIG
    assert "--speculative-algorithm is not set" in error_line(capsys)


# What a DDTREE launch passes beside its drafter (docs/configuration.md): N = 32 (a tree of 31), block 8.
DDTREE_ARGS = ["--speculative-num-draft-tokens", "32", "--speculative-dflash-block-size", "8", "--page-size", "1",
               "--grammar-backend", "none"]  # fmt: skip


def spec(model, *algorithm_args):
    return [
        "--model-path",
        str(model),
        "--attention-backend",
        "triton",
        "--speculative-algorithm",
        *algorithm_args,
    ]


def test_eagle3_needs_a_draft_model(model, capsys):
    assert run(spec(model, "EAGLE3"))[0] == EXIT_CONFIG
    assert "--speculative-algorithm EAGLE3 needs a draft model" in error_line(capsys)


@pytest.mark.sglang
def test_speculative_algorithms_are_sglangs_names_and_ddtree():
    spec_info = pytest.importorskip(
        "sglang.srt.speculative.spec_info", reason="sglang==0.5.23 (the server extra)"
    )
    from sglang.srt.speculative.spec_registry import _RESERVED_ALIASES

    algos = spec_info.SpeculativeAlgorithm
    sglangs = {a.name for a in algos if a is not algos.NONE} | set(_RESERVED_ALIASES)
    assert set(launch.SPECULATIVE_ALGORITHMS) == sglangs | {"DDTREE"}


class _EntryPoint:  # what importlib.metadata.entry_points lists: only the name is read
    def __init__(self, name: str):
        self.name = name


def test_an_unknown_algorithm_is_refused_unless_another_plugin_may_register_it(model, monkeypatch, capsys):
    installed = [_EntryPoint("kdtree")]
    monkeypatch.setattr(
        launch, "entry_points", lambda group: installed if group == "sglang.srt.plugins" else []
    )
    assert run(spec(model, "DDTRE"))[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert "--speculative-algorithm DDTRE is no algorithm SGLang or kdtree knows" in line
    assert "pass one of EAGLE, EAGLE3, NEXTN, NGRAM, DFLASH, DDTREE" in line
    assert run(spec(model, "ngram"))[0] == 0  # SGLang takes any case
    installed.append(_EntryPoint("medusa"))  # another plugin may register it: SGLang judges
    assert run(spec(model, "MEDUSA"))[0] == 0
    monkeypatch.setenv("SGLANG_PLUGINS", "kdtree")  # ... unless SGLang would not load that plugin
    assert run(spec(model, "MEDUSA"))[0] == EXIT_CONFIG


@pytest.mark.parametrize(
    "config, algorithm_args, warned",
    [
        ({"dflash_config": {"block_size": 8}}, ["DDTREE", *DDTREE_ARGS[:3], "16", *DDTREE_ARGS[4:]],
         "the block 16 is above the 8 the drafter at {d} was trained for (its config.json's dflash_config.block_size)"
         ": its depths past 7 are untrained guesses, lossless but rarely accepted; for the drafter's own block pass "
         "--speculative-dflash-block-size 8 or less"),
        ({"dflash_config": {"block_size": 16}}, ["DDTREE", *DDTREE_ARGS], None),
        ({"dflash_config": {"block_size": 8}}, ["DDTREE", *DDTREE_ARGS], None),
        ({"block_size": 8}, ["DFLASH", "--speculative-num-draft-tokens", "16"],  # DFLASH: B = N; a top-level key
         "(its config.json's block_size): its depths past 7 are untrained guesses, lossless but rarely accepted; for "
         "the drafter's own block pass --speculative-num-draft-tokens and --speculative-dflash-block-size 8 or less"),
        ({}, ["DDTREE", *DDTREE_ARGS], None),  # not known: nothing to hold the block to
    ],
)  # fmt: skip
def test_a_block_above_the_one_the_drafter_was_trained_for_is_warned_of(
    model, tmp_path, capsys, config, algorithm_args, warned
):
    """SGLang runs it (lossless, its deeper depths untrained) and only logs a mismatch: the launcher says it once."""
    import json

    draft = tmp_path / "drafter"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(config))
    rc, call = run([*spec(model, *algorithm_args), "--speculative-draft-model-path", str(draft)])
    assert rc == 0 and call is not None
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("kdtree launcher: warning: ")]
    assert warnings == ([] if warned is None else [warnings[0]])
    if warned is not None:
        assert warned.format(d=draft) in warnings[0]


@pytest.mark.parametrize(
    "drafter, warned",
    [
        ("target", True),  # the target's own folder
        ({"architectures": ["DeepseekV3ForCausalLM"]}, True),  # a copy of the target's config
        (
            {"architectures": ["MuseGlimmerAssistantModel"]},
            False,
        ),  # a DFlash drafter SGLang knows, no block in it
        ({"architectures": ["DeepseekV3ForCausalLM"], "dflash_config": {"block_size": 8}}, False),
    ],
)
def test_the_target_given_as_the_drafter_is_warned_of(model, tmp_path, capsys, drafter, warned):
    """SGLang takes any folder as the drafter and fails only once it has loaded it: the launcher names the mistake."""
    import json

    (model / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    draft = model if drafter == "target" else tmp_path / "drafter"
    if drafter != "target":
        draft.mkdir()
        (draft / "config.json").write_text(json.dumps(drafter))
    rc, _ = run([*spec(model, "DDTREE", *DDTREE_ARGS), "--speculative-draft-model-path", str(draft)])
    assert rc == 0
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("kdtree launcher: warning: ")]
    expected = f"the drafter at {draft} looks like the target model (its config.json names the target's architectures"
    assert [expected in w for w in warnings] == ([True] if warned else [])


def test_ddtree_needs_a_draft_model_and_kdtrees_plugin(model, tmp_path, monkeypatch, capsys):
    assert run(spec(model, "DDTREE"))[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert "--speculative-algorithm DDTREE needs a draft model" in line
    assert "a DFlash drafter's folder" in line and "NGRAM" not in line
    monkeypatch.setenv(
        "SGLANG_PLUGINS", "other"
    )  # SGLang's plugin whitelist without kdtree: DDTREE is unknown there
    draft = ["--speculative-draft-model-path", str(tmp_path)]
    assert run(spec(model, "DDTREE", *draft))[0] == EXIT_CONFIG
    line = error_line(capsys)
    assert "SGLANG_PLUGINS='other' leaves it out" in line and "add kdtree to SGLANG_PLUGINS" in line
    (tmp_path / "config.json").write_text("{}")
    # as SGLang reads it: names stripped; empty loads every plugin
    for plugins in ("other, kdtree", "", " , "):
        monkeypatch.setenv("SGLANG_PLUGINS", plugins)
        assert run(spec(model, "DDTREE", *draft, *DDTREE_ARGS))[0] == 0, plugins


@pytest.mark.parametrize(
    "backend",
    [
        [],
        ["--attention-backend", "flashmla"],
        ["--attention-backend", "triton", "--decode-attention-backend", "fa3"],
        ["--attention-backend", "triton", "--prefill-attention-backend", "flashinfer"],
    ],
    ids=["unset", "flashmla", "decode-fa3", "prefill-flashinfer"],
)
def test_ddtree_runs_in_tritons_backend_whatever_allow_other_backend_says(
    model, tmp_path, monkeypatch, capsys, backend
):
    """DDTREE's verify reads its tree mask in Triton's layout in every mode: KDTREE_ALLOW_OTHER_BACKEND (serve
    without kdtree) cannot apply to kdtree's own algorithm."""
    monkeypatch.setenv("KDTREE_ALLOW_OTHER_BACKEND", "1")
    (tmp_path / "config.json").write_text("{}")
    argv = ["--model-path", str(model), *backend, "--speculative-algorithm", "DDTREE"]
    assert run([*argv, "--speculative-draft-model-path", str(tmp_path)])[0] == EXIT_CONFIG
    line = error_line(capsys)
    flag = "--attention-backend" if len(backend) < 4 else backend[2]
    assert f"fix: pass {flag} triton" in line and "in every mode" in line


def test_draft_path_must_exist(model, tmp_path, capsys):
    assert (
        run(spec(model, "EAGLE3", "--speculative-draft-model-path", str(tmp_path / "nope")))[0] == EXIT_CONFIG
    )
    assert f"--speculative-draft-model-path {tmp_path}/nope does not exist" in error_line(capsys)


def test_nextn_needs_mtp_layers_in_the_checkpoint(model, capsys):
    assert run(spec(model, "NEXTN"))[0] == EXIT_CONFIG  # DeepSeek-V2-Lite-like config: no MTP layers
    line = error_line(capsys)
    assert "has none (config.json num_nextn_predict_layers)" in line and "NGRAM" in line


def test_eagle_uses_bundled_mtp_layers_or_a_draft(model):
    (model / "config.json").write_text('{"num_nextn_predict_layers": 1}')
    assert run(spec(model, "EAGLE"))[0] == 0
    assert run(spec(model, "NEXTN"))[0] == 0
    (model / "config.json").write_text("{}")
    assert run(spec(model, "EAGLE", "--speculative-draft-model-path", str(model)))[0] == 0


def test_model_folder_without_config_json(model, capsys):
    (model / "config.json").unlink()
    assert run(args(model))[0] == EXIT_CONFIG
    assert "has no config.json" in error_line(capsys)


def test_cuobjdump_fallback_parses_elf_listing(monkeypatch, tmp_path):
    lib = tmp_path / "libkdtree_verify.so"
    lib.write_bytes(b"\x7fELF")
    monkeypatch.setenv("KDTREE_KERNEL_LIB", str(lib))
    monkeypatch.setattr(launch.shutil, "which", lambda name: "/usr/bin/cuobjdump")
    listing = (
        "ELF file    1: libkdtree_verify.1.sm_90.cubin\nELF file    2: libkdtree_verify.2.sm_120.cubin\n"
    )
    monkeypatch.setattr(
        launch.subprocess, "run", lambda *a, **k: type("R", (), {"stdout": listing, "returncode": 0})()
    )
    assert launch._cuobjdump_archs() == [90, 120]


@pytest.mark.parametrize("argv", [["--help"], ["-h"]])
def test_help_prints_usage_and_touches_nothing(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_STATE_DIR", str(tmp_path / "help-state"))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m entrypoint.launch") and "exits 2" in out
    assert not (tmp_path / "help-state").exists()  # no state file, no log: it started nothing


def test_no_torch_is_one_line(model, capsys, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_torch(name, *a, **kw):
        if name == "torch":
            raise ImportError("No module named 'torch'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    from entrypoint.launch import visible_gpus

    with pytest.raises(LaunchError, match="torch does not import here.*run the launcher in the server image"):
        visible_gpus()


# The launcher as a process, its checks' GPU probes doubled and SGLang replaced by the command after the model path
# (a sleeper): what runs in a LeaderWorkerSet server container, minus the GPU.
LAUNCHER_WITH_A_SLEEPER = """
import sys
from entrypoint import launch
from entrypoint.launch import Gpu
from entrypoint.supervise import Supervisor
model, command = sys.argv[1], sys.argv[2:]
serve = lambda sup, argv, env: Supervisor.run(sup, command, env)
argv = ["--model-path", model, "--attention-backend", "triton", "--speculative-algorithm", "NGRAM"]
sys.exit(launch.main(argv, serve=serve, gpus=lambda: [Gpu(0, "NVIDIA H200", (9, 0))], archs=lambda: [90]))
"""


def test_the_sidecars_restart_is_carried_out_in_place_by_the_launcher_process(model, env, tmp_path):
    """KDTREE_RESTART_IN_PLACE with the sidecar's real process control: the restart completes (a new start in the
    mode file's mode) while the launcher, the container's process, keeps running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from sidecar.server_control.process import ServerProcess

    repo = REPO
    environ = {
        **os.environ,
        "PYTHONPATH": str(repo),
        "KDTREE_RESTART_IN_PLACE": "1",
        "KDTREE_STATE_DIR": str(env),
    }
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER_WITH_A_SLEEPER, str(model), *sleeper], env=environ, cwd=tmp_path
    )
    try:
        control = ServerProcess(env, restart_wait_s=20, poll_s=0.05)

        def until_serving(start: int) -> None:
            deadline = time.monotonic() + 20
            while True:
                rec = read_process_record(env) if (env / "server-process.json").exists() else None
                if rec is not None and rec.starts == start and rec.server_pid is not None:
                    return
                assert time.monotonic() < deadline and proc.poll() is None, f"start {start} did not serve"
                time.sleep(0.05)

        until_serving(1)
        write_desired_mode(env, Mode.OFF)
        control.restart(2)  # returns once the new start is recorded
        until_serving(2)
        rec = read_process_record(env)
        assert rec.pid == proc.pid and proc.poll() is None  # the same process: the container did not end
        first, second = (env / "server.log").read_text().split("server start #2")
        assert "mode=validate (from KDTREE_VERIFY)" in first and "restart request" in first
        assert "mode=off (from" in second
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM


@pytest.mark.parametrize(
    "changes, refused",
    [
        (["--page-size", "16"], "pass --page-size 1 (got 16)"),
        (["--speculative-num-draft-tokens", "0"], "must be at least the block B=8: a budget below B-1"),
        (["--page-size", "0"], "pass --page-size 1 (got 0)"),  # SGLang would divide by it
        (["--speculative-num-draft-tokens", "100000"], "(got N=100000)"),
        (["--speculative-dflash-block-size", "1"], "must be at least 2"),
        (
            ["--attn-dp-size", "2"],
            "drop it and pass --dp-size 1",
        ),
        # the deprecated flag: SGLang reads --dp-size 2 as the attention-DP width, and the refusal says so
        (
            ["--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"],
            "makes --dp-size N the attention-DP width) drop it and pass --dp-size 1",
        ),
        (
            ["--speculative-eagle-topk", "4"],
            "drop --speculative-eagle-topk 4 (--speculative-num-draft-tokens",
        ),
        (["--grammar-backend", "xgrammar"], "pass --grammar-backend none"),
    ],
)
def test_ddtrees_own_check_refuses_before_any_server_starts(model, tmp_path, capsys, changes, refused):
    """The check SGLang runs on its resolved arguments (kdtree.ddtree.server_args), run by the launcher on the command
    as given: one line and exit 2 instead of a server start that ends in a traceback."""
    (tmp_path / "config.json").write_text("{}")
    argv = [*spec(model, "DDTREE", "--speculative-draft-model-path", str(tmp_path), *DDTREE_ARGS), *changes]
    assert run(argv) == (EXIT_CONFIG, None)
    line = error_line(capsys)
    assert line.startswith("kdtree launcher: error: DDTREE's server arguments: ") and refused in line
    # the fix says where the arguments are set, the Kimi DDTree files' own command included
    assert "KDTREE_SGLANG_EXTRA_ARGS" in line and "compose/kimi-ddtree.yaml" in line


def test_ddtrees_replicas_are_refused_in_off_too(model, tmp_path, monkeypatch, capsys):
    """Off lets other algorithms run data-parallel replicas (no rank records to keep apart); DDTREE's have not run,
    so its own check refuses them whatever the mode, before any server starts."""
    monkeypatch.setenv("KDTREE_VERIFY", "off")
    (tmp_path / "config.json").write_text("{}")
    argv = [
        *spec(model, "DDTREE", "--speculative-draft-model-path", str(tmp_path), *DDTREE_ARGS),
        "--dp-size",
        "2",
    ]
    assert run(argv, n_gpus=2) == (EXIT_CONFIG, None)
    assert "pass --dp-size 1 and serve more replicas as more servers (got dp_size=2)" in error_line(capsys)


def test_ddtrees_check_sees_what_sglang_resolves_before_it(model, tmp_path, capsys):
    """An unset --grammar-backend is xgrammar to SGLang (refused); the deprecated --enable-dp-attention makes --dp-size
    the attention-DP width (refused above 1, nothing at 1)."""
    (tmp_path / "config.json").write_text("{}")
    base = spec(
        model, "DDTREE", "--speculative-draft-model-path", str(tmp_path), *DDTREE_ARGS[:6]
    )  # no grammar flag
    assert run(base) == (EXIT_CONFIG, None)
    assert "pass --grammar-backend none (got 'xgrammar'" in error_line(capsys)
    good = [*base, "--grammar-backend", "none"]
    assert run([*good, "--enable-dp-attention"])[0] == 0
    assert "speculative=DDTREE draft=" in capsys.readouterr().err
    assert run([*good, "--enable-dp-attention", "--dp-size", "2"], n_gpus=2) == (EXIT_CONFIG, None)
    assert (
        "(got attn_dp_size=2): drop --attn-dp-size, or with the deprecated --enable-dp-attention"
        in error_line(capsys)
    )


def test_ddtrees_summary_names_its_tree(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KDTREE_DDTREE_BUDGET", "fixed")
    (tmp_path / "config.json").write_text("{}")
    assert run(spec(model, "DDTREE", "--speculative-draft-model-path", str(tmp_path), *DDTREE_ARGS))[0] == 0
    (summary,) = capsys.readouterr().err.strip().splitlines()
    assert f"speculative=DDTREE draft={tmp_path} N=32 B=8 budget=fixed (KDTREE_DDTREE_BUDGET)" in summary
