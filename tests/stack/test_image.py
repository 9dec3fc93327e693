"""The images and the compose stack, against a real Docker engine (marker `docker`).

The images are built by `.ci/docker.sh build` (CI runs it before pytest); a missing image skips its tests
with that command as the reason. Nothing here builds an image.

The end-to-end test runs compose.yaml with docker-compose v1 on CPU. tests/stack/compose.ci.yaml replaces the
server's command with standins/standin_engine.py, a stand-in that is NOT SGLang (it keeps SGLang's startup
and HTTP contract and writes the per-rank records), run under the server entrypoint's supervisor; the GPU
reservation (compose.override.yaml) is left out, since this machine has no GPU runtime. The sidecar is the real one, with compose.yaml's default process control: no Docker socket and no
shared PID namespace; it reads the server's state file and log from the shared volume and restarts it with a
request in that volume, which the supervisor acts on before it exits, and the server's restart policy starts
it again. Both join the network namespace of compose.yaml's `netns`. (Docker control is tested against the
same dockerd in test_sidecar_docker.py, down to a mode flip through a real `docker restart`.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
from standin_engine import free_port

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
TAG = os.environ.get("KDTREE_IMAGE_TAG", "ci")
SERVER = f"kdtree-server:{TAG}"
SIDECAR = f"kdtree-sidecar:{TAG}"
TOKEN = "e2e-admin-token"
INSTALLED_LIB = "python -c \"import kdtree, pathlib; print(pathlib.Path(kdtree.__file__).parent / 'lib' / 'libkdtree_verify.so')\""


def require_image(name: str) -> None:
    if subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode != 0:
        pytest.skip(f"image {name} is missing: build it with .ci/docker.sh build")


def docker_run(image: str, *args: str, entrypoint: str | None = None, volumes=(), env=None, timeout=180):
    cmd = ["docker", "run", "--rm"]
    if entrypoint:
        cmd += ["--entrypoint", entrypoint]
    for v in volumes:
        cmd += ["-v", v]
    for k, v in (env or {}).items():
        cmd += ["-e", f"{k}={v}"]
    return subprocess.run([*cmd, image, *args], capture_output=True, text=True, timeout=timeout)


def python_in_image(image: str, code: str) -> str:
    """Run `python -c code` in the image; it must succeed. The last line it printed."""
    r = docker_run(image, "-c", code, entrypoint="python")
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def server_image():
    require_image(SERVER)
    return SERVER


@pytest.fixture(scope="module")
def sidecar_image():
    require_image(SIDECAR)
    return SIDECAR


@pytest.fixture
def models():
    """A model directory the container's uid 10001 can read (pytest's tmp_path is private to root)."""
    root = Path(tempfile.mkdtemp(prefix="kdtree-models-"))
    root.chmod(0o755)
    model = root / "DeepSeek-V2-Lite"
    model.mkdir(mode=0o755)
    (model / "config.json").write_text('{"architectures": ["DeepseekV2ForCausalLM"]}')
    (model / "config.json").chmod(0o644)
    yield root
    shutil.rmtree(root)


# ---- server image -----------------------------------------------------------------------------------


def test_server_image_has_sglang_0_5_23(server_image):
    assert python_in_image(server_image, "import sglang; print(sglang.__version__)") == "0.5.23"


def test_sglang_loader_discovers_and_runs_the_kdtree_plugin(server_image):
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins, load_plugins_by_group\n"
        "found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)\n"
        "print('KDTREE_DIST', found['kdtree'][1])\n"
        "load_plugins()\n"
    )
    r = docker_run(server_image, "-c", code, entrypoint="python")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "KDTREE_DIST kdtree" in r.stdout
    assert "Executed general plugin: kdtree" in r.stderr
    assert "Failed to execute general plugin: kdtree" not in r.stderr
    assert "TritonAttnBackend.forward_extend (from: plugin=kdtree" in r.stderr


def test_sitecustomize_is_on_the_path_and_imports_nothing_heavy(server_image):
    code = (
        "import sys, sitecustomize\n"
        "print(sitecustomize.__file__)\n"
        "print(sorted(m for m in ('torch', 'sglang', 'kdtree') if m in sys.modules))\n"
    )
    r = docker_run(server_image, "-c", code, entrypoint="python")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["/opt/kdtree/site/sitecustomize.py", "[]"]


def test_installed_library_carries_sm90_and_sm120_code(server_image):
    r = docker_run(server_image, "-c", f'cuobjdump --list-elf "$({INSTALLED_LIB})"', entrypoint="sh")
    assert r.returncode == 0, r.stderr
    for arch in ("sm_90", "sm_120"):
        assert f"tree_verify.{arch}.cubin" in r.stdout, r.stdout
    # What the launcher and the runtime read: the library's own list (kdtree.kernel.compiled_archs).
    archs = python_in_image(server_image, "from kdtree.kernel import compiled_archs; print(compiled_archs())")
    assert {"sm_90", "sm_120"} <= set(eval(archs))


TRITON_BUILD_PROBE = r"""
from triton.runtime.build import compile_module_from_src
src = '''
#include <Python.h>
static PyObject* answer(PyObject* self, PyObject* args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "kdtree_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_kdtree_probe(void) { return PyModule_Create(&mod); }
'''
print(compile_module_from_src(src, "kdtree_probe").answer())
"""


def test_triton_can_build_its_runtime_modules(server_image):
    """Triton compiles its CUDA driver module and every kernel's launcher with the host C compiler against
    Python.h at first use (SGLang's Triton attention backend; the benchmark's baseline and timer): the same build
    path, on a module that needs no GPU."""
    assert python_in_image(server_image, TRITON_BUILD_PROBE) == "42"


def test_bench_command_is_in_the_image_and_needs_a_gpu(server_image):
    """README's `docker run --gpus all --entrypoint python kdtree-server -m kdtree.bench`, here without a GPU:
    the CPU side (the module, its command line, the GPU check) as shipped."""
    r = docker_run(server_image, "-m", "kdtree.bench", entrypoint="python")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    assert r.stderr.splitlines() == ["kdtree.bench: no CUDA GPU is visible (run the image with --gpus all)"]
    r = docker_run(server_image, "-m", "kdtree.bench", "--help", entrypoint="python")
    assert r.returncode == 0, r.stderr
    assert "--quick" in r.stdout and "--full" in r.stdout and "--out DIR" in r.stdout
    # The shipped library carries the mma.sync measurement the benchmark's roofline uses.
    code = "from kdtree import kernel; print(callable(kernel.library().kdtree_mma_peak))"
    assert python_in_image(server_image, code) == "True"


def test_images_run_as_a_non_root_user(server_image, sidecar_image):
    """The server as uid 10001, the sidecar as uid 10002, both in group 10001, as the Kubernetes manifests'
    runAsUser, runAsGroup and fsGroup say; the state volume's mount point is the group's, writable, setgid."""
    code = "import os; s = os.stat('/var/run/kdtree'); print(os.getuid(), os.getgid(), s.st_gid, oct(s.st_mode & 0o7777))"
    for image, uid in ((server_image, 10001), (sidecar_image, 10002)):
        r = docker_run(image, "-c", code, entrypoint="python")
        assert r.stdout.strip() == f"{uid} 10001 10001 0o2775", (image, r.stdout, r.stderr)


def image_config(image: str) -> dict:
    r = subprocess.run(
        ["docker", "image", "inspect", "-f", "{{json .Config}}", image], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_images_carry_their_provenance(server_image, sidecar_image):
    """OCI labels: the title CI prunes by, the project's version, the commit built from (.ci/docker.sh passes
    git rev-parse HEAD), its source and the build time."""
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for image in (server_image, sidecar_image):
        labels = image_config(image)["Labels"]
        oci = {k.removeprefix("org.opencontainers.image."): v for k, v in labels.items()}
        assert oci["title"] == "kdtree" and oci["version"] == version and oci["licenses"] == "Apache-2.0"
        assert {"revision", "source", "created", "description"} <= set(oci), oci
        if oci["revision"] != "unknown":  # a commit of this repository
            assert re.fullmatch(r"[0-9a-f]{40}", oci["revision"]), oci
            known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", oci["revision"] + "^{commit}"])
            assert known.returncode == 0, f"{image}: revision {oci['revision']} is no commit here"


def test_server_image_states_the_cuda_it_needs(server_image):
    """The NVIDIA runtime refuses to start it on an older driver, with its own message: torch's CUDA version."""
    env = dict(e.split("=", 1) for e in image_config(server_image)["Env"])
    cuda = python_in_image(server_image, "import torch; print(torch.version.cuda)")
    assert env["NVIDIA_REQUIRE_CUDA"] == f"cuda>={cuda}"


GOOD = [
    "--model-path",
    "/models/DeepSeek-V2-Lite",
    "--attention-backend",
    "triton",
    "--speculative-algorithm",
    "NGRAM",
]


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        (
            {"KDTREE_VERIFY": "shadow"},
            GOOD,
            "KDTREE_VERIFY='shadow' is invalid: set it to one of: off, validate, on",
        ),
        (
            {},
            ["--model-path", "/models/absent", *GOOD[2:]],
            "--model-path /models/absent does not exist; fix: check the path",
        ),
        (
            {"HF_HUB_OFFLINE": "1"},  # as compose sets it; the image's own Hugging Face cache is empty
            ["--model-path", "deepseek-ai/DeepSeek-V2-Lite", *GOOD[2:]],
            "is no local folder, and as a Hugging Face repo id it cannot be downloaded: HF_HUB_OFFLINE=1",
        ),
        (
            {},
            [*GOOD[:3], "flashinfer", *GOOD[4:]],
            "--attention-backend flashinfer: kdtree verifies only inside the triton backend",
        ),
        ({}, GOOD[:4], "--speculative-algorithm is not set"),
        ({}, [*GOOD[:5], "NEXTN"], "has none (config.json num_nextn_predict_layers)"),
        ({}, GOOD, "no CUDA GPU is visible to this process"),  # the real torch probe, in the image
        ({"KDTREE_STATE_DIR": "/tmp/absent"}, GOOD, "KDTREE_STATE_DIR=/tmp/absent does not exist"),
    ],
    ids=[
        "bad-mode",
        "no-model",
        "hub-id-offline",
        "backend",
        "no-speculation",
        "no-mtp-layers",
        "no-gpu",
        "no-state-dir",
    ],
)
def test_entrypoint_rejects_a_bad_configuration(server_image, models, env, args, message):
    r = docker_run(server_image, *args, volumes=[f"{models}:/models:ro"], env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("kdtree launcher: error: ") and message in lines[-1], r.stderr


def test_entrypoint_names_a_model_the_server_user_cannot_read(server_image, models):
    (models / "DeepSeek-V2-Lite").chmod(0o700)  # owned by root: uid 10001 may not enter
    r = docker_run(server_image, *GOOD, volumes=[f"{models}:/models:ro"])
    assert r.returncode == 2
    assert "--model-path /models/DeepSeek-V2-Lite is not readable by uid 10001" in r.stderr


def test_sidecar_image_has_neither_torch_nor_sglang(sidecar_image):
    code = "import importlib.util as u; print([m for m in ('torch', 'sglang', 'fastapi', 'docker') if u.find_spec(m)])"
    r = docker_run(sidecar_image, "-c", code, entrypoint="python")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['fastapi', 'docker']"


def test_sidecar_image_has_kdtreectl_on_its_path(sidecar_image):
    """`docker compose exec sidecar kdtreectl ...`: the no-install way in (README). Its help never shows the
    token, which the stack puts into the sidecar's environment."""
    r = docker_run(
        sidecar_image, "--help", entrypoint="kdtreectl", env={"KDTREE_ADMIN_TOKEN": "in-env-secret"}
    )
    assert r.returncode == 0, r.stderr
    assert "Exit codes:" in r.stdout and "{status,wait,mode,rollout,check}" in r.stdout
    assert "in-env-secret" not in r.stdout


def test_kdtreectl_in_the_sidecar_image_reads_the_token_file_a_pod_mounts(sidecar_image, tmp_path):
    """`kubectl exec POD -c sidecar -- kdtreectl mode off`: in the real image, as its user, the token comes from
    KDTREE_ADMIN_TOKEN_FILE (a pod's Secret file) with no warning; an unreadable one warns and names it. Exit 7: no
    sidecar listens at --url here."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "token").write_text("pod-secret-token\n")
    (secret / "token").chmod(0o444)
    secret.chmod(0o755)
    argv = ("--url", "http://127.0.0.1:9", "mode", "off")
    read = docker_run(
        sidecar_image, *argv, entrypoint="kdtreectl", volumes=[f"{secret}:/secret:ro"],
        env={"KDTREE_ADMIN_TOKEN_FILE": "/secret/token"},
    )  # fmt: skip
    assert read.returncode == 7 and "warning" not in read.stderr, read.stderr
    missing = docker_run(
        sidecar_image, *argv, entrypoint="kdtreectl", env={"KDTREE_ADMIN_TOKEN_FILE": "/secret/token"}
    )
    assert (
        missing.returncode == 7
        and "warning: no admin token from the environment: KDTREE_ADMIN_TOKEN_FILE" in (missing.stderr)
    )


# ---- compose ----------------------------------------------------------------------------------------


# compose.yaml without a GPU file (compose.override.yaml holds the reservation), with the CPU override.
CPU_FILES = [REPO / "compose.yaml", REPO / "tests" / "stack" / "compose.ci.yaml"]


class Stack:
    """One compose project (unique name), driven with docker-compose v1 and the sidecar's HTTP API."""

    def __init__(self, tmp: Path, models: Path, files: list[Path] | None = None):
        self.project = f"kdtree-e2e-{uuid.uuid4().hex[:8]}"
        self.server = f"{self.project}-server"
        self.files = files or CPU_FILES
        self.env_file = tmp / "empty.env"  # a developer's .env must not leak into the test
        self.env_file.write_text("")
        sidecar_port, self.server_port = free_port(), free_port()
        self.env = {
            **os.environ,
            "KDTREE_ADMIN_TOKEN": TOKEN,
            "KDTREE_MODEL_DIR": str(models),
            "KDTREE_SERVER_CONTAINER": self.server,
            "KDTREE_SIDECAR_IMAGE": SIDECAR,
            "KDTREE_SERVER_IMAGE": SERVER,
            "KDTREE_PUBLISH_SERVER_PORT": str(self.server_port),
            "KDTREE_PUBLISH_SIDECAR_PORT": str(sidecar_port),
            "KDTREE_TP_SIZE": "2",
            "KDTREE_VERIFY": "validate",
        }
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{sidecar_port}", timeout=30)

    def compose(self, *args: str, extra_env=None, timeout=300) -> subprocess.CompletedProcess:
        cmd = [
            "docker-compose",
            "-p",
            self.project,
            "--project-directory",
            str(REPO),
            "--env-file",
            str(self.env_file),
        ]
        for f in self.files:
            cmd += ["-f", str(f)]
        r = subprocess.run(
            [*cmd, *args],
            env={**self.env, **(extra_env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert r.returncode == 0, f"docker-compose {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
        return r

    def kdtreectl(self, *args: str) -> subprocess.CompletedProcess:
        """`docker-compose exec sidecar kdtreectl ARGS`, as the README's no-install way in (any exit code)."""
        cmd = ["docker-compose", "-p", self.project, "--project-directory", str(REPO)]
        cmd += ["--env-file", str(self.env_file), *(a for f in self.files for a in ("-f", str(f)))]
        return subprocess.run(
            [*cmd, "exec", "-T", "sidecar", "kdtreectl", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def status(self) -> dict:
        r = self.http.get("/status")
        r.raise_for_status()
        return r.json()

    def wait(self, what: str, predicate, timeout: float = 120, seen=None) -> dict:
        """Poll /status until predicate(status) holds; `seen` collects every phase on the way."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                last = self.status()
            except httpx.HTTPError as e:
                last = {"error": str(e)}
            else:
                if seen is not None:
                    seen.append(last["phase"])
                if predicate(last):
                    return last
            time.sleep(0.3)
        logs = subprocess.run(["docker", "logs", "--tail", "40", self.server], capture_output=True, text=True)
        pytest.fail(
            f"timed out waiting for {what}; last /status: {last}\nserver log:\n{logs.stdout}{logs.stderr}"
        )

    def post_mode(self, mode: str, token: str | None = TOKEN, restart: bool = False) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return self.http.post(
            "/mode", json={"mode": mode, "reason": "e2e", "restart": restart}, headers=headers
        )

    def wait_transition(self, outcome_count: int, timeout: float = 150) -> dict:
        """Until the transition count reaches outcome_count and none is active; returns the latest."""
        s = self.wait(
            f"transition #{outcome_count} to finish",
            lambda s: s["active_transition"] is None and len(s["transitions"]) >= outcome_count,
            timeout,
        )
        return s["transitions"][-1]

    def container_started_at(self) -> str:
        return self.inspect("{{.State.StartedAt}}")

    def container(self, service: str) -> str:
        """The id of the (one) container of a compose service."""
        r = subprocess.run(
            ["docker", "ps", "-aq", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}",
             "--filter", f"label=com.docker.compose.service={service}"],
            capture_output=True, text=True,
        )  # fmt: skip
        (cid,) = r.stdout.split()
        return cid

    def exec(self, service: str, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["docker", "exec", self.container(service), *cmd], capture_output=True, text=True
        )

    def state_file(self, name: str) -> str:
        """A file of the state volume, read in the sidecar container (which may be stopped: then in the server)."""
        for service in ("sidecar", "server"):
            r = self.exec(service, "cat", f"/var/run/kdtree/{name}")
            if r.returncode == 0:
                return r.stdout
        raise AssertionError(f"cannot read {name}: {r.stderr}")

    def next_transition(self) -> int:
        """The count wait_transition waits for after one more flip."""
        return len(self.status()["transitions"]) + 1

    def inspect(self, template: str, container: str | None = None) -> str:
        return subprocess.run(
            ["docker", "inspect", "-f", template, container or self.server], capture_output=True, text=True
        ).stdout.strip()

    def down(self) -> None:
        """Remove the project: containers, network and its named volumes."""
        self.http.close()
        cmd = [
            "docker-compose",
            "-p",
            self.project,
            "--project-directory",
            str(REPO),
            "--env-file",
            str(self.env_file),
        ]
        cmd += [a for f in self.files for a in ("-f", str(f))]
        subprocess.run([*cmd, "down", "-v", "--remove-orphans", "-t", "2"], env=self.env, capture_output=True)


def require_compose() -> None:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose (v1) is not installed: apt-get install -y docker-compose")


# ---- the server's caches in the stack's volumes ---------------------------------------------------------

# Run twice, each time in a new container of the real server image on the stack's volumes, as the image's user:
# `build` compiles or writes each cache for real, `reuse` must find every artifact there with the compilers made
# to fail (so a hit is proven, not assumed). One JSON line out.
CACHE_PROBE = r'''
import hashlib, json, os, pathlib, sys

reuse = sys.argv[1] == "reuse"
# Every folder as the tool itself resolves it (from the image's ENV, or the tool's default where none is set).
home_cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
out = {"uid": os.getuid(), "gid": os.getgid(), "dirs": {}, "files": {}}

def record(what, path):
    path = pathlib.Path(path)
    out["files"][what] = [str(path), hashlib.sha256(path.read_bytes()).hexdigest()]

def refuse(*_, **__):
    raise AssertionError("cache miss: the compiler ran again")

# Triton, through its own cache manager (TRITON_CACHE_DIR): the launcher build SGLang's Triton backend does.
import triton
import triton.runtime.build as triton_build
if reuse:
    triton_build._build = refuse
src = """
#include <Python.h>
static PyObject* answer(PyObject* self, PyObject* args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "kdtree_cache_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_kdtree_cache_probe(void) { return PyModule_Create(&mod); }
"""
assert triton_build.compile_module_from_src(src, "kdtree_cache_probe").answer() == 42
(so,) = pathlib.Path(triton.knobs.cache.dir).glob("*/kdtree_cache_probe*.so")
record("triton", so)

# SGLang's JIT kernels (SGLANG_JIT_CACHE_DIR): the MLA KV-cache store for sm_90 (nvcc compiles without a GPU).
from sglang.kernels.jit.utils.arch import override_jit_cuda_arch
from sglang.kernels.jit.utils.compile import ninja as sglang_ninja
from sglang.kernels.jit.utils.compile.cache import cache_root
if reuse:
    sglang_ninja.build = refuse
with override_jit_cuda_arch(9, 0):
    from sglang.kernels.ops.kvcache.set_mla_kv_buffer import set_mla_kv_buffer_module
    set_mla_kv_buffer_module(1024, 128, True)
(so,) = cache_root().glob("sm90a/*set_mla_kv_buffer*/build-*/deps-*/*.so")
record("sglang_jit", so)

# transformers' dynamic modules (HF_MODULES_CACHE): where --trust-remote-code copies a model's code.
import transformers
from transformers.dynamic_module_utils import HF_MODULES_CACHE
config = transformers.AutoConfig.from_pretrained("/models/remote-code-probe", trust_remote_code=True)
assert type(config).__name__ == "ProbeConfig", type(config)
(py,) = pathlib.Path(HF_MODULES_CACHE).glob("transformers_modules/**/configuration_probe.py")
record("hf_modules", py)

# torch inductor (TORCHINDUCTOR_CACHE_DIR): a CPU graph compiled with the C++ compiler, then an FX graph cache hit.
import torch
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir
assert torch.compile(lambda x: x * 2 + 1)(torch.ones(8)).tolist() == [3.0] * 8
out["inductor"] = dict(counters["inductor"])
out["inductor_dir"] = inductor_cache_dir()
assert any(pathlib.Path(inductor_cache_dir()).glob("fxgraph/**/*")), "inductor cached nothing"

# Caches that only a GPU fills (FlashInfer's JIT folder, CUDA's compute cache) and the state volume: written and
# read back the way they are used, folders created on demand and files published by rename.
import flashinfer.jit.env as flashinfer_env
from kdtree.state.atomic import write_atomically
for what, folder in {
    "flashinfer": flashinfer_env.FLASHINFER_JIT_DIR,
    "cuda": pathlib.Path(os.environ.get("CUDA_CACHE_PATH") or pathlib.Path.home() / ".nv") / "ComputeCache",
    "state": pathlib.Path(os.environ["KDTREE_STATE_DIR"]),
}.items():
    path = pathlib.Path(folder) / "kdtree-cache-probe"
    if not reuse:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, what)
    assert path.read_text() == what, path
    record(what, path)

for d in [home_cache, *home_cache.iterdir(), pathlib.Path(os.environ["KDTREE_STATE_DIR"])]:
    st = d.stat()
    out["dirs"][str(d)] = [st.st_uid, st.st_gid]
print(json.dumps(out))
'''

REMOTE_CODE = """from transformers import PretrainedConfig


class ProbeConfig(PretrainedConfig):
    model_type = "kdtree_probe"
"""


def test_the_server_writes_every_cache_into_the_stacks_volumes_as_its_user(
    server_image, sidecar_image, tmp_path
):
    """compose.yaml's server service on fresh named volumes (a new project), the real server image as its own
    user: Triton's launcher build, an SGLang JIT kernel build (nvcc and the C++ compiler, for sm_90), transformers'
    remote-code module copy and a torch inductor compile each write their cache, and a second container finds
    every artifact with the compilers disabled. A mount point missing from the image would be created root-owned,
    and uid 10001 would get PermissionError: the bug this catches. As in the e2e stack, the copy of compose.yaml
    has no GPU reservation, and the server's memlock is lowered to what CI's engine allows; the sidecar runs (and
    netns with it) because the server joins netns's network."""
    require_compose()
    models = Path(tempfile.mkdtemp(prefix="kdtree-models-"))
    models.chmod(0o755)
    probe = models / "remote-code-probe"
    probe.mkdir(mode=0o755)
    (probe / "config.json").write_text(
        '{"model_type": "kdtree_probe", "auto_map": {"AutoConfig": "configuration_probe.ProbeConfig"}}'
    )
    (probe / "configuration_probe.py").write_text(REMOTE_CODE)
    for f in probe.iterdir():
        f.chmod(0o644)
    memlock = tmp_path / "memlock.yaml"
    memlock.write_text("services:\n  server:\n    ulimits:\n      memlock: 65536\n")
    s = Stack(tmp_path, models, files=[REPO / "compose.yaml", memlock])
    try:
        s.compose("up", "-d", "sidecar")
        runs = {}
        for phase in ("build", "reuse"):
            r = s.compose(
                "run",
                "--rm",
                "--no-deps",
                "--entrypoint",
                "python",
                "server",
                "-c",
                CACHE_PROBE,
                phase,
                timeout=600,
            )
            runs[phase] = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        s.down()
        shutil.rmtree(models)
    build, reuse = runs["build"], runs["reuse"]
    assert (build["uid"], build["gid"]) == (10001, 10001)
    for d, owner in build["dirs"].items():
        assert owner == [10001, 10001], f"{d} is owned by {owner}, not the server's user"
    assert set(build["files"]) == {"triton", "sglang_jit", "hf_modules", "flashinfer", "cuda", "state"}
    for what, (path, _) in build["files"].items():
        root = "/var/run/kdtree/" if what == "state" else "/home/kdtree/.cache/"
        assert path.startswith(root), (what, path)
    assert build["inductor_dir"].startswith("/home/kdtree/.cache/")
    assert reuse["files"] == build["files"]  # the same artifacts, read back from the volumes
    assert (
        build["inductor"].get("fxgraph_cache_miss") == 1 and reuse["inductor"].get("fxgraph_cache_hit") == 1
    )


@pytest.fixture(scope="module")
def stack(server_image, sidecar_image, tmp_path_factory):
    require_compose()
    tmp = tmp_path_factory.mktemp("compose")
    models = Path(tempfile.mkdtemp(prefix="kdtree-models-"))
    models.chmod(0o755)
    s = Stack(tmp, models)
    try:
        s.compose("up", "-d")
        yield s
    finally:
        s.down()
        shutil.rmtree(models)


# The e2e tests below share one stack and run in file order: each starts from where the previous ended.


def test_compose_sidecar_reports_loading_while_the_port_is_closed_then_ready(stack):
    seen: list[str] = []
    s = stack.wait("the server to become ready", lambda s: s["ready"], timeout=120, seen=seen)
    assert "loading" in seen, f"phases seen: {seen}"  # probe refused: the stand-in keeps its port closed
    assert s["phase"] == "ready" and s["mode"]["current"] == "validate"
    assert sorted(v["record"]["tp_rank"] for v in s["ranks"]) == [0, 1]
    assert {v["record"]["mode"] for v in s["ranks"]} == {"validate"}
    assert s["log"]["latest_marker"] is not None  # SGLang's startup markers, read from the state volume's log
    assert s["container"]["state"]["name"] == "server process" and s["container"]["state"]["running"]
    # The server container's own healthcheck goes through the sidecar's /ready.
    health = lambda: subprocess.run(  # noqa: E731
        ["docker", "inspect", "-f", "{{.State.Health.Status}}", stack.server], capture_output=True, text=True
    ).stdout.strip()
    deadline = time.monotonic() + 30
    while health() != "healthy" and time.monotonic() < deadline:
        time.sleep(1)
    assert health() == "healthy"
    # The no-install way in: kdtreectl inside the sidecar, with the stack's URL and token from its environment.
    r = stack.kdtreectl("status")
    assert r.returncode == 0 and "phase:     ready" in r.stdout, (r.stdout, r.stderr)
    r = stack.kdtreectl("mode", "validate", "--dry-run")  # POST /mode: authenticated by the container's token
    assert r.returncode == 0 and "validate -> validate" in r.stdout, (r.stdout, r.stderr)


def test_compose_sidecar_has_no_docker_socket_and_shares_only_the_network_and_the_state_volume(stack):
    netns, sidecar = stack.container("netns"), stack.container("sidecar")
    for cid in (stack.server, sidecar):
        assert stack.inspect("{{.HostConfig.NetworkMode}}", container=cid) == f"container:{netns}", cid
        assert stack.inspect("{{.HostConfig.PidMode}}", container=cid) == "", (
            cid
        )  # a PID namespace of its own
    mounts = stack.inspect("{{range .Mounts}}{{.Destination}} {{end}}", container=sidecar)
    assert "/var/run/docker.sock" not in mounts and "/var/run/kdtree" in mounts
    assert stack.exec("sidecar", "id", "-u").stdout.strip() == "10002"
    assert stack.exec("server", "id", "-u").stdout.strip() == "10001"
    # SGLang's output still reaches `docker logs` (the entrypoint tees it into the volume's log as well).
    logs = subprocess.run(["docker", "logs", stack.server], capture_output=True, text=True)
    assert "Load weight begin" in logs.stdout + logs.stderr


def test_compose_the_admin_token_is_out_of_the_servers_reach(stack):
    """Code in the server container (model code under --trust-remote-code) cannot see the sidecar's processes, so
    not their environment: the sidecar's pid does not exist there, no process there has the token, no file holds it."""
    host_pid = stack.inspect("{{.State.Pid}}", container=stack.container("sidecar"))
    assert stack.exec("sidecar", "sh", "-c", "tr '\\0' '\\n' < /proc/1/environ").stdout.count(TOKEN) == 1
    r = stack.exec("server", "cat", f"/proc/{host_pid}/environ")
    assert r.returncode != 0 and "No such file" in r.stderr, r
    environs = stack.exec(
        "server", "sh", "-c", "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'"
    ).stdout
    assert "KDTREE_STATE_DIR=/var/run/kdtree" in environs and TOKEN not in environs
    comms = stack.exec("server", "sh", "-c", "cat /proc/[0-9]*/comm").stdout.split()
    assert "uvicorn" not in comms and all("sidecar" not in c for c in comms), comms
    found = stack.exec("server", "grep", "-rlsF", TOKEN, "/var/run/kdtree", "/home", "/tmp", "/run", "/etc")
    assert found.stdout == "", found.stdout


def test_compose_restarting_the_sidecar_leaves_the_server_serving(stack):
    """netns holds the network: the sidecar container restarts alone, and the server keeps its process (same pid,
    no new start) and answers every request sent meanwhile."""
    host_pid, started = stack.inspect("{{.State.Pid}}"), stack.container_started_at()
    record = json.loads(stack.state_file("server-process.json"))
    sidecar = stack.container("sidecar")
    sidecar_started = stack.inspect("{{.State.StartedAt}}", container=sidecar)
    with Traffic(stack.server_port, ["The capital of France is", "def fib(n):"]) as traffic:
        time.sleep(0.5)
        subprocess.run(["docker", "restart", "-t", "10", sidecar], check=True, capture_output=True)
        stack.wait("the sidecar back, and ready", lambda s: s["ready"], timeout=60)
        sent_while = traffic.sent
    assert stack.inspect("{{.State.StartedAt}}", container=sidecar) != sidecar_started  # it did restart
    assert stack.inspect("{{.State.Pid}}") == host_pid and stack.container_started_at() == started
    after = json.loads(stack.state_file("server-process.json"))
    assert (after["pid"], after["starts"], after["started_at"]) == (
        record["pid"],
        record["starts"],
        record["started_at"],
    )
    assert after["exited_at"] is None
    # The launcher kept beating through the sidecar's restart: a newer heartbeat within three periods (the restart
    # itself can take less than one).
    from kdtree.state.process_record import HEARTBEAT_S

    deadline = time.monotonic() + 3 * HEARTBEAT_S
    while after["heartbeat_at"] <= record["heartbeat_at"] and time.monotonic() < deadline:
        time.sleep(0.2)
        after = json.loads(stack.state_file("server-process.json"))
    assert after["heartbeat_at"] > record["heartbeat_at"], (after, record)
    assert sent_while > 5 and traffic.bad == [], traffic.bad[:5]


def test_compose_sidecar_names_a_fifo_in_the_state_volume_and_never_waits_on_it(stack):
    """The real sidecar image: a FIFO named like a rank record (nobody writes it) is reported unreadable, while
    /live and /ready answer at once."""
    sidecar = stack.container("sidecar")
    fifo = "/var/run/kdtree/rank-7.json"
    run = ["docker", "exec", sidecar, "python", "-c"]
    subprocess.run([*run, f"import os; os.mkfifo({fifo!r})"], check=True, capture_output=True)
    try:
        start = time.monotonic()
        assert stack.http.get("/live").json() == {"live": True}
        ready = stack.http.get("/ready")
        assert time.monotonic() - start < 10 and ready.status_code == 200, ready.json()
        (seven,) = [v for v in stack.status()["ranks"] if v["record"]["tp_rank"] == 7]
        assert seven["stale"] and seven["stale_reason"].endswith("rank-7.json is a FIFO, not a regular file")
    finally:
        subprocess.run([*run, f"import os; os.unlink({fifo!r})"], capture_output=True)


def test_compose_killed_server_is_reported_crashed_with_its_log(stack):
    # `docker kill` SIGKILLs the server's entrypoint: no exit status is recorded, and the restart policy
    # leaves a container that was killed by hand down. What an OOM kill of the entrypoint looks like.
    subprocess.run(["docker", "kill", stack.server], check=True, capture_output=True)
    s = stack.wait("the crashed verdict", lambda s: s["phase"] == "crashed", timeout=30)
    assert not s["ready"]
    assert any("exit code 137" in r for r in s["reasons"]), s["reasons"]
    assert "recorded no exit status" in s["container"]["state"]["error"]
    assert s["log"]["latest_marker"] is not None, s["log"]  # how far the server got before it died
    r = stack.kdtreectl("status")
    assert r.returncode == 3 and "phase:     crashed" in r.stdout, (r.stdout, r.stderr)  # README: 3 crashed
    subprocess.run(["docker", "start", stack.server], check=True, capture_output=True)
    stack.wait("ready after the manual start", lambda s: s["ready"], timeout=90)


class Background:
    """A loop (`_run`, until `_stop` is set) in a daemon thread for the length of a `with` block."""

    def __init__(self):
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        raise NotImplementedError

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)


class Traffic(Background):
    """Completions sent without pause to the server's published port (what clients do during a flip), each
    checked against the answer the same prompt got before: the stand-in's completions are deterministic."""

    def __init__(self, port: int, prompts: list[str]):
        super().__init__()
        self.url, self.prompts = f"http://127.0.0.1:{port}/v1/completions", prompts
        self.expected = {p: self._complete(httpx.Client(timeout=30), p) for p in prompts}
        self.sent, self.bad = 0, []

    @staticmethod
    def _request(prompt: str) -> dict:
        return {"model": "stand-in/deepseek-v3", "prompt": prompt, "max_tokens": 16, "temperature": 0}

    def _complete(self, client: httpx.Client, prompt: str):
        r = client.post(self.url, json=self._request(prompt))
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    def _run(self):
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                prompt = self.prompts[self.sent % len(self.prompts)]
                self.sent += 1
                try:
                    text = self._complete(client, prompt)
                except (httpx.HTTPError, KeyError, ValueError) as e:
                    self.bad.append(f"{prompt!r}: {type(e).__name__}: {e}")
                    continue
                if text != self.expected[prompt]:
                    self.bad.append(f"{prompt!r}: {text!r} != {self.expected[prompt]!r}")


def test_compose_mode_on_is_live_while_requests_flow(stack):
    """validate -> on without a restart: every rank confirms within seconds, and the completions clients send
    meanwhile all succeed with the answer they had before."""
    assert stack.post_mode("on", token=None).status_code == 401
    assert stack.post_mode("on", token="wrong").status_code == 403
    before = stack.container_started_at()
    with Traffic(stack.server_port, ["The capital of France is", "def fib(n):", "Q: 2 + 2 = ?"]) as traffic:
        time.sleep(1)
        n = stack.next_transition()
        r = stack.post_mode("on")
        assert r.status_code == 202 and r.json()["method"] == "live", r.text
        t = stack.wait_transition(n)
        time.sleep(1)
    assert t["outcome"] == "succeeded" and t["method"] == "live", t
    print(
        f"live flip confirmed by every rank after {t['confirmed_s']:.2f}s, done after {t['duration_s']:.2f}s"
    )
    assert t["confirmed_s"] < 10, t  # the live-flip goal at the default heartbeat
    s = stack.status()
    assert s["ready"] and s["mode"]["current"] == "on" and s["mode"]["desired_file"] == "on"
    assert {v["record"]["mode"] for v in s["ranks"]} == {"on"}
    assert stack.container_started_at() == before  # no restart
    assert traffic.sent > 20 and traffic.bad == [], traffic.bad[:5]


class ReadyPolls(Background):
    """GET /ready every 0.1 s in a thread: (epoch time the answer came, status, reasons)."""

    def __init__(self, http_base: str):
        super().__init__()
        self.base, self.seen = http_base, []

    def _run(self):
        with httpx.Client(base_url=self.base, timeout=30) as client:
            while not self._stop.is_set():
                try:
                    r = client.get("/ready")
                    self.seen.append((time.time(), r.status_code, r.json().get("reasons", [])))
                except (httpx.HTTPError, ValueError):
                    self.seen.append((time.time(), None, []))
                self._stop.wait(0.1)


def test_compose_off_restarts_the_server_after_a_drain_and_back(stack):
    """The kill switch takes the restart path (nothing of kdtree's is installed in off), and so does leaving it.
    The drain comes first: /ready answers 503 ("draining") before the server gets its SIGTERM, which comes
    KDTREE_DRAIN_S (1.5 s here) after the drain began: the audit log's order and the server's own stop line."""
    before = stack.container_started_at()
    n = stack.next_transition()
    with ReadyPolls(str(stack.http.base_url)) as polls:
        r = stack.post_mode("off")
        assert r.status_code == 202 and r.json()["method"] == "restart", r.text
        t = stack.wait_transition(n)
    assert t["outcome"] == "succeeded" and t["method"] == "restart", t
    assert stack.container_started_at() != before
    s = stack.status()
    assert s["mode"]["current"] == "off" and {v["record"]["mode"] for v in s["ranks"]} == {"off"}
    audit = [json.loads(x) for x in stack.state_file("sidecar-audit.jsonl").splitlines()]
    steps = {e["event"]: e["ts"] for e in audit if e.get("transition") == t["id"]}
    assert list(steps)[:5] == ["accepted", "writing_mode", "draining", "restarting", "waiting_ready"], steps
    stops = re.findall(r"kdtree launcher: SIGTERM at \S+ \(t=([\d.]+)\)", stack.state_file("server.log"))
    sigterm = max(float(x) for x in stops)
    assert steps["draining"] + 1.5 <= steps["restarting"] <= sigterm, (steps, sigterm)
    drained = [at for at, code, why in polls.seen if code == 503 and any("draining" in w for w in why)]
    assert drained and steps["draining"] <= drained[0] < sigterm, (drained[:3], steps, sigterm)
    assert all(code == 503 for at, code, _ in polls.seen if steps["draining"] + 0.2 <= at <= sigterm)
    r = stack.post_mode("validate")
    assert r.status_code == 202 and r.json()["method"] == "restart", r.text
    assert stack.wait_transition(n + 1)["outcome"] == "succeeded"


def documented_commands(doc: str, heading: str) -> list[list[str]]:
    """The `docker compose` lines of the first code block after `heading` in `doc`, as arguments."""
    import shlex

    text = (REPO / doc).read_text()
    block = text.split(heading, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert lines and all(line[:2] == ["docker", "compose"] for line in lines), lines
    return [line[2:] for line in lines]


def test_compose_off_without_the_sidecar_by_the_documented_runbook(stack):
    """docs/operations.md's "Reaching `off` when the sidecar is down", run as written (compose v1 for `docker compose`):
    with the sidecar stopped, the mode file is written and the server restarts into off; the sidecar, started
    again, adopts it. Then back to validate for the tests after this one."""
    record = json.loads(stack.state_file("server-process.json"))
    stack.compose("stop", "sidecar")
    try:
        for args in documented_commands(
            "docs/operations.md", "\n## Reaching `off` when the sidecar is down\n"
        ):
            stack.compose(*args)
        deadline = time.monotonic() + 60
        while True:  # a new start of the server, whose ranks report off
            try:
                after = json.loads(stack.state_file("server-process.json"))
                modes = {json.loads(stack.state_file(f"rank-{i}.json"))["mode"] for i in (0, 1)}
            except AssertionError:  # the server container is between its two starts
                after, modes = record, set()
            if after["starts"] > record["starts"] and modes == {"off"}:
                break
            assert time.monotonic() < deadline, (after, modes)
            time.sleep(0.5)
    finally:
        stack.compose("start", "sidecar")
    s = stack.wait(
        "the sidecar back, reporting off", lambda s: s["ready"] and s["mode"]["current"] == "off", timeout=60
    )
    assert s["mode"]["desired_file"] == "off"
    assert "mode_file_adopted" in stack.state_file("sidecar-audit.jsonl")
    n = stack.next_transition()
    assert stack.post_mode("validate").status_code == 202
    assert stack.wait_transition(n)["outcome"] == "succeeded"


def started_at(status: dict) -> float | None:
    """The server start the sidecar's status speaks of."""
    return (status["container"]["state"] or {}).get("started_at")


def test_compose_failed_restart_rolls_back_to_validate(stack):
    # Recreate the server so that it crashes at start whenever it starts in mode `on`.
    before = started_at(stack.status())
    stack.compose(
        "up",
        "-d",
        "--no-deps",
        "server",
        extra_env={"KDTREE_CI_STANDIN_ARGS": "--fault crash-on-start --fault-in-mode on"},
    )
    stack.wait(  # the new server's start seen (the sidecar's view of the server is up to a second old)
        "the new server ready in validate",
        lambda s: s["ready"] and s["mode"]["current"] == "validate" and started_at(s) != before,
        timeout=90,
    )
    n = stack.next_transition()
    r = stack.post_mode("on", restart=True)  # where a live switch would do, the restart path on request
    assert r.status_code == 202 and r.json()["method"] == "restart", r.text
    t = stack.wait_transition(n)
    assert t["outcome"] == "rolled_back", t
    assert "crashed while starting in mode on" in t["failure"], t
    s = stack.wait("ready after the rollback", lambda s: s["ready"], timeout=60)
    assert s["mode"]["current"] == "validate" and s["mode"]["desired_file"] == "validate"
    assert {v["record"]["mode"] for v in s["ranks"]} == {"validate"}


def test_compose_crash_at_start_shows_the_traceback(stack):
    # Without a restart policy, so that the crashed server stays down and its verdict stays observable.
    stack.compose(
        "up",
        "-d",
        "--no-deps",
        "server",
        extra_env={"KDTREE_CI_STANDIN_ARGS": "--fault crash-on-start", "KDTREE_CI_SERVER_RESTART": "no"},
    )
    s = stack.wait(
        "the crashed verdict", lambda s: s["phase"] == "crashed" and s["log"]["crash_excerpt"], timeout=60
    )
    excerpt = "\n".join(s["log"]["crash_excerpt"])
    assert "Traceback (most recent call last)" in excerpt, excerpt
    assert any("exit code 1" in r for r in s["reasons"]), s["reasons"]
    assert s["container"]["state"]["exit_code"] == 1


def test_a_bad_value_in_env_is_named_in_the_sidecars_health_output(sidecar_image, server_image, tmp_path):
    """A bad value in .env (KDTREE_PROBE_FAILURE_THRESHOLD=0; CI's file sets the gate's): `up` fails on the dependency's health, as compose does, and
    the sidecar, held up rather than restarted in a loop, names the value in its health output."""
    require_compose()
    models = Path(tempfile.mkdtemp(prefix="kdtree-models-"))
    s = Stack(tmp_path, models)
    s.env["KDTREE_PROBE_FAILURE_THRESHOLD"] = "0"
    cmd = ["docker-compose", "-p", s.project, "--project-directory", str(REPO), "--env-file", str(s.env_file)]
    cmd += [a for f in s.files for a in ("-f", str(f))]
    try:
        up = subprocess.run([*cmd, "up", "-d"], env=s.env, capture_output=True, text=True, timeout=300)
        assert up.returncode != 0 and "is unhealthy" in up.stderr, up.stderr
        sidecar = subprocess.run([*cmd, "ps", "-q", "sidecar"], env=s.env, capture_output=True, text=True)
        cid = sidecar.stdout.strip()
        health = s.inspect("{{range .State.Health.Log}}{{.Output}}{{end}}", cid)
        assert "kdtree sidecar: KDTREE_PROBE_FAILURE_THRESHOLD='0' is invalid" in health, health
        assert s.inspect("{{.State.Running}} {{.RestartCount}}", cid) == "true 0"
    finally:
        s.down()
        shutil.rmtree(models)


def test_compose_as_shipped_on_a_machine_without_the_nvidia_runtime(sidecar_image, server_image, tmp_path):
    """docs/troubleshooting.md's row, on this GPU-less engine: `up` fails with Docker's own message, and the
    sidecar it leaves running turns broken ("no server has started") after KDTREE_START_GRACE_S. The files are what
    `docker compose up` reads with no -f: compose.yaml and its GPU file."""
    require_compose()
    models = Path(tempfile.mkdtemp(prefix="kdtree-models-"))
    s = Stack(tmp_path, models, files=[REPO / "compose.yaml", REPO / "compose.override.yaml"])
    s.env["KDTREE_START_GRACE_S"] = "3"
    try:
        cmd = [
            "docker-compose",
            "-p",
            s.project,
            "--project-directory",
            str(REPO),
            "--env-file",
            str(s.env_file),
        ]
        up = subprocess.run(
            [*cmd, *(a for f in s.files for a in ("-f", str(f))), "up", "-d"],
            env=s.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert up.returncode != 0
        assert 'could not select device driver "nvidia" with capabilities: [[gpu]]' in up.stderr, up.stderr
        troubleshooting = (REPO / "docs" / "troubleshooting.md").read_text()
        assert '`could not select device driver "nvidia" with capabilities: [[gpu]]`' in troubleshooting
        st = s.wait("the broken verdict", lambda st: st["condition"] == "broken", timeout=60)
        assert st["phase"] == "loading" and not st["ready"]
        assert any(
            "no server has started" in e and "KDTREE_START_GRACE_S=3" in e for e in st["condition_evidence"]
        )
    finally:
        s.down()
        shutil.rmtree(models)


# ---- the README's demo, as written ------------------------------------------------------------------------

DEMO_HEADING = "### Try it without a GPU\n"
# What the demo's commands read from a checkout (compose.yaml's server reads server.env even while left out).
DEMO_FILES = ("compose.yaml", "compose/demo.yaml", ".env.example", "server.env", "standins/standin_engine.py")


def readme_demo() -> list[tuple[str, list[str]]]:
    """The README's demo section: each command of its bash blocks, with the lines written under it as comments
    (what it prints; `...` stands for anything)."""
    section = (REPO / "README.md").read_text().split(DEMO_HEADING, 1)[1].split("\n### ", 1)[0]
    steps: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.splitlines():
            if line.startswith("# "):
                steps[-1][1].append(line[2:].strip())
            elif line.strip():
                steps.append((line, []))
    return steps


def printed(expected: str, output: str) -> bool:
    pattern = ".*".join(map(re.escape, expected.split("...")))
    return any(re.fullmatch(pattern, line.strip()) for line in output.splitlines())


def as_a_script(command: str, cwd: Path, env: dict, timeout: float) -> tuple[int, str]:
    """`bash -c command` as a script or a CI job runs it: no terminal (stdin from /dev/null, output to a pipe), where
    docker-compose v1's `exec` without `-T` fails ("the input device is not a TTY"); its output and errors together."""
    try:
        r = subprocess.run(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        pytest.fail(f"{command}: still running after {timeout} s:\n{out}")
    return r.returncode, r.stdout


def test_the_readmes_demo_runs_as_written(sidecar_image, tmp_path):
    """ "Try it without a GPU", command by command, in a copy of the files it reads, as a script runs it (no
    terminal): each must exit 0 and print what the README writes under it. The environment says only what CI's
    setup needs: the images' CI tag, a project name of its own, and compose v1 for `docker compose` where the v2
    plugin is absent (the README says either works). The ports are the README's, 8080 and 30000, so they must be
    free."""
    require_compose()
    steps = readme_demo()
    assert [c for c, _ in steps][:2] == [
        '[ -f .env ] || sed "s/^KDTREE_ADMIN_TOKEN=.*/KDTREE_ADMIN_TOKEN=$(openssl rand -hex 24)/" .env.example > .env',
        "docker compose -f compose.yaml -f compose/demo.yaml up -d",
    ], steps[:2]
    assert steps[-1][0] == "docker compose -f compose.yaml -f compose/demo.yaml down -v", steps[-1]
    execs = [c for c, _ in steps if " exec " in c]
    assert execs and all(" exec -T " in c for c in execs), execs  # so that each works in a script
    for port in (8080, 30000):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} is in use: the demo publishes it"
    for name in DEMO_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    project = f"kdtree-demo-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "COMPOSE_PROJECT_NAME": project, "KDTREE_SIDECAR_IMAGE": SIDECAR}
    env.pop("COMPOSE_FILE", None)
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    try:
        for command, expected in steps:
            run = command if v2 else command.replace("docker compose ", "docker-compose ")
            start = time.monotonic()
            code, out = as_a_script(run, tmp_path, env, timeout=300)
            print(f"$ {command}  ({time.monotonic() - start:.1f} s)\n{out}")
            assert code == 0, f"{command}\nexited {code}:\n{out}"
            missing = [e for e in expected if not printed(e, out)]
            assert not missing, f"{command}\ndid not print {missing}:\n{out}"
        assert "KDTREE_ADMIN_TOKEN=\n" not in (tmp_path / ".env").read_text()  # the first line set a token
    finally:
        subprocess.run(
            ["docker-compose", "-p", project, "-f", "compose.yaml", "-f", "compose/demo.yaml", "down", "-v", "-t", "2"],
            cwd=tmp_path, env=env, capture_output=True, timeout=120,
        )  # fmt: skip
