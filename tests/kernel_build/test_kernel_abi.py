"""The C ABI as the Python binding copies it: kernel_build/include/kdtree_verify.h against the kdtree.kernel package.

The binding declares the header's structs, enums and constants again for ctypes; a field added, moved or retyped on
one side only would pass garbage to the kernel. A C compiler reports the header's `sizeof` and every field's
`offsetof`, which the ctypes structures must match, and the header's enums and constants are read from its text."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import typing
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kdtree import config, kernel  # noqa: E402

HEADER = Path(__file__).resolve().parents[2] / "kernel_build" / "include" / "kdtree_verify.h"
TEXT = HEADER.read_text()
TILE_TABLE = HEADER.parent / "kdtree_tile_configs.h"


def enum(name: str) -> dict[str, int]:
    body = re.search(r"enum " + name + r" \{(.*?)\};", TEXT, re.S)
    assert body, f"enum {name} not in {HEADER.name}"
    body = re.sub(r"/\*.*?\*/", "", body.group(1), flags=re.S)
    return {k: int(v) for k, v in re.findall(r"(\w+)\s*=\s*(\d+)", body)}


def define(name: str) -> int:
    return int(re.search(r"#define " + name + r" (\d+)", TEXT).group(1))


def test_constants_and_enums_agree():
    assert kernel.ABI_VERSION == define("KDTREE_ABI_VERSION")
    assert (kernel.QK_DIM, kernel.V_DIM) == (define("KDTREE_QK_DIM"), define("KDTREE_V_DIM"))
    assert {"KDTREE_I32": kernel.abi._I32, "KDTREE_I64": kernel.abi._I64} == enum("kdtree_index_type")
    assert {f"KDTREE_MODE_{k.upper()}": v for k, v in kernel.MODE_CODES.items()} == enum("kdtree_mode")
    assert {m.value for m in config.Mode} == set(kernel.MODE_CODES)
    names = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "FP8_E4M3", torch.float8_e5m2: "FP8_E5M2"}
    assert {f"KDTREE_KV_{names[d]}": v for d, v in kernel.KV_DTYPES.items()} == enum("kdtree_kv_dtype")
    assert {f"KDTREE_FP8_{k.upper()}": v for k, v in kernel.FP8_PATHS.items()} == enum("kdtree_fp8_path")
    assert set(kernel.FP8_PATHS) == set(
        typing.get_args(config.KernelSettings.model_fields["fp8_path"].annotation)
    )
    assert {v: k for k, v in enum("kdtree_status").items()} == kernel.STATUS


def tile_rows() -> list[tuple[str, int, str]]:
    """(NAME, ID, Type) of each row of kdtree_tile_configs.h, in its order."""
    text = re.sub(r"/\*.*?\*/", "", TILE_TABLE.read_text(), flags=re.S)
    return [
        (n, int(i), ty)
        for n, i, ty in re.findall(r"^KDTREE_TILE_CONFIG\((\w+),\s*(\d+),\s*(\w+),", text, re.M)
    ]


def test_one_tile_configuration_table_for_c_and_python():
    """kdtree_tile_configs.h (the enum, the kernel's types and its dispatch read it) and config.TILE_CONFIGS (the
    binding, the setting's allowed values and the automatic choice's order read it) list the same configurations
    in the same order; the header's enum is made from the table, not written out again."""
    rows = tile_rows()
    assert rows, f"no KDTREE_TILE_CONFIG rows in {TILE_TABLE.name}"
    assert [(name.lower(), i) for name, i, _ in rows] == list(config.TILE_CONFIGS.items())
    assert len({i for _, i, _ in rows}) == len(rows) and len({ty for _, _, ty in rows}) == len(rows)
    assert kernel.CONFIGS is config.TILE_CONFIGS
    allowed = typing.get_args(config.KernelSettings.model_fields["kernel_config"].annotation)
    assert set(typing.get_args(allowed[0])) == set(config.TILE_CONFIGS) and allowed[1] is type(None)
    body = re.search(r"enum kdtree_config \{(.*?)\};", TEXT, re.S).group(1)
    assert '#include "kdtree_tile_configs.h"' in body and not re.search(r"KDTREE_CONFIG_\w+\s*=\s*\d", body)


def test_the_compiled_enum_is_the_table(tmp_path):
    """A C compiler reads kdtree_verify.h's enum kdtree_config as the Python table says."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    lines = [f'  printf("{name} %d\\n", (int)KDTREE_CONFIG_{name.upper()});' for name in config.TILE_CONFIGS]
    src = tmp_path / "configs.c"
    src.write_text(
        '#include <stdio.h>\n#include "kdtree_verify.h"\nint main(void) {\n' + "\n".join(lines) + "\n}\n"
    )
    exe = tmp_path / "configs"
    subprocess.run(
        [cc, "-std=c11", "-Wall", "-Werror", "-I", str(HEADER.parent), str(src), "-o", str(exe)], check=True
    )
    out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout.split()
    assert dict(zip(out[::2], map(int, out[1::2]), strict=True)) == config.TILE_CONFIGS


def test_the_library_dispatches_every_configuration_of_the_table():
    """kdtree_verify_smem_bytes answers for every row (with_config reads the table) and 0 for any other value."""
    try:
        lib = kernel.library()
    except kernel.KernelUnavailable as e:
        pytest.skip(str(e))
    sizes = {name: lib.kdtree_verify_smem_bytes(i) for name, i in config.TILE_CONFIGS.items()}
    assert all(s > 0 for s in sizes.values()), sizes
    assert lib.kdtree_verify_smem_bytes(max(config.TILE_CONFIGS.values()) + 1) == 0
    assert lib.kdtree_verify_smem_bytes(0) == 0


def test_every_entry_point_the_binding_calls_is_declared():
    binding = "".join(p.read_text() for p in Path(kernel.__file__).parent.glob("*.py"))
    called = set(re.findall(r"\b(kdtree_\w+)\(", binding))
    declared = set(re.findall(r"^\S.*?\b(kdtree_\w+)\(", TEXT, re.M))
    assert called <= declared, f"called but not in the header: {sorted(called - declared)}"


@pytest.mark.parametrize(
    ("struct", "cls"),
    [("kdtree_verify_args", kernel.abi._Args), ("kdtree_parity_totals", kernel.ParityTotals)],
)
def test_struct_layout_agrees(struct, cls, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    fields = [name for name, _ in cls._fields_]
    lines = [f'  printf("sizeof %zu\\n", sizeof({struct}));']
    lines += [
        f'  printf("{f} %zu %zu\\n", offsetof({struct}, {f}), sizeof((({struct}*)0)->{f}));' for f in fields
    ]
    src = tmp_path / "layout.c"
    src.write_text(
        '#include <stddef.h>\n#include <stdio.h>\n#include "kdtree_verify.h"\nint main(void) {\n'
        + "\n".join(lines)
        + "\n  return 0;\n}\n"
    )
    exe = tmp_path / "layout"
    subprocess.run(
        [cc, "-std=c11", "-Wall", "-Werror", "-I", str(HEADER.parent), str(src), "-o", str(exe)], check=True
    )
    out = dict(
        line.split(" ", 1)
        for line in subprocess.run([exe], capture_output=True, text=True, check=True).stdout.splitlines()
    )
    assert int(out.pop("sizeof")) == ctypes.sizeof(cls), f"sizeof({struct})"
    for f in fields:
        offset, size = map(int, out[f].split())
        desc = getattr(cls, f)
        assert (desc.offset, desc.size) == (offset, size), (
            f"{struct}.{f}: binding {desc.offset}/{desc.size}, header {offset}/{size}"
        )


def test_every_entry_point_records_why_it_refused_its_arguments():
    """Each C entry point refuses bad arguments before any CUDA call and records why (kdtree_last_error), and the
    binding's one error path raises with the entry point, the status and that message. No GPU needed: the library
    loads without one."""
    try:
        lib = kernel.library()
    except kernel.KernelUnavailable as e:
        pytest.skip(str(e))
    null = None
    calls = {  # entry point -> (a call with bad arguments, what its message says)
        "kdtree_mode_gate": (
            lambda: lib.kdtree_mode_gate(null, null, null, 0, 0, null, null, null, null, null),
            "n < 2",
        ),
        "kdtree_mode_post": (
            lambda: lib.kdtree_mode_post(null, null, null, 0, null, null, 0.0, null),
            "n < 1",
        ),
        "kdtree_parity_update": (
            lambda: lib.kdtree_parity_update(null, null, 0, null, null, 0.0, null),
            "n < 1",
        ),
        "kdtree_capture_id": (lambda: lib.kdtree_capture_id(null, null), "id is NULL"),
        "kdtree_mma_peak": (lambda: lib.kdtree_mma_peak(99, null, null), "warps_per_sm"),
        "kdtree_host_device_pointer": (lambda: lib.kdtree_host_device_pointer(null, null), "host or device"),
        "kdtree_verify_ctas_per_sm": (lambda: lib.kdtree_verify_ctas_per_sm(1, null), "ctas is NULL"),
    }
    for name, (call, says) in calls.items():
        rc = call()
        message = lib.kdtree_last_error().decode()
        assert kernel.STATUS.get(rc) == "KDTREE_ERR_ARGUMENT" and says in message, (name, rc, message)
        with pytest.raises(
            RuntimeError, match=rf"^{name} failed \(KDTREE_ERR_ARGUMENT\): {re.escape(message)}$"
        ):
            kernel.loader._check(rc, name)


def test_the_launch_refuses_bad_scales_and_an_unknown_fp8_path():
    """Scales on a bf16 pool and an fp8_path outside enum kdtree_fp8_path are refused before any CUDA call (the
    pointers are never read); an fp8 pool's large v_scale is not (it is applied in fp32)."""
    try:
        lib = kernel.library()
    except kernel.KernelUnavailable as e:
        pytest.skip(str(e))
    a = kernel.abi._Args(q=1, k_ext=1, k_buf=1, out=1, qo_indptr=1, kv_indptr=1, batch=1, num_heads=1, max_q_len=1,
                     cta_slots=1, config=1, sm_scale=0.1, k_buf_stride=576, k_scale=1.0)  # fmt: skip
    for dtype, v_scale, fp8_path, says in [
        (kernel.KV_DTYPES[torch.float8_e4m3fn], 1.0, 2, "fp8_path must be"),
        (kernel.KV_DTYPES[torch.float8_e5m2], 1000.0, -1, "fp8_path must be"),
        (kernel.KV_DTYPES[torch.bfloat16], 2.0, 0, "a bf16 pool is read unscaled"),
    ]:
        a.kv_dtype, a.v_scale, a.fp8_path = dtype, v_scale, fp8_path
        assert kernel.STATUS.get(lib.kdtree_verify_launch(ctypes.byref(a), None)) == "KDTREE_ERR_ARGUMENT"
        assert says in lib.kdtree_last_error().decode()
