"""The verify mode and its settings, read from the environment (one place, used by every process)."""

from __future__ import annotations

import difflib
import functools
import importlib
import logging
import os
from collections.abc import Mapping
from enum import Enum, StrEnum
from typing import ClassVar, Literal, Self
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict


class Mode(StrEnum):
    OFF = "off"  # SGLang's Triton verify only: kdtree's kernel never runs (the kill switch; DDTREE still drafts)
    VALIDATE = "validate"  # Triton serves; kdtree runs beside it and is compared on the device
    ON = "on"  # kdtree serves target-verify attention
    STANDBY = "standby"  # installed and idle: Triton serves, kdtree does no attention work


# A server started in one of these switches between them while it runs (kdtree.state.mode_file.ModeHolder); to or from
# `off` it restarts.
LIVE_MODES = frozenset({Mode.VALIDATE, Mode.ON, Mode.STANDBY})


# The kernel's tile configurations, name -> enum kdtree_config: kernel_build/include/kdtree_tile_configs.h's rows in its
# order, which is the automatic choice's (kdtree.kernel plans in the first whose shared memory the GPU allows per
# block). The setting's allowed values and the binding read this; tests/kernel_build/test_kernel_abi.py holds it to the C table.
TILE_CONFIGS = {"wide": 1, "compact": 2}  # wide: sm_90/sm_100 shared memory; compact: sm_120's 99 KB
TileConfig = Literal[tuple(TILE_CONFIGS)]


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the variable and the fix."""


class KdtreeSettings(BaseSettings):
    """How every KDTREE_ variable is read: the base of each process's settings class (each variable one field of
    one of them). A bad value is refused by load() with one line: the variable, its value, what is wrong and, where
    the class's `fixes` has one, the fix."""

    model_config = SettingsConfigDict(
        env_prefix="KDTREE_", extra="ignore", populate_by_name=True, env_ignore_empty=True
    )
    fixes: ClassVar[
        dict[str, str]
    ] = {}  # variable -> the fix the refusal names, beyond the validator's message

    @classmethod
    def load(cls, **overrides) -> Self:
        """The settings from the environment (and overrides); ConfigError naming the first bad value. A KDTREE_
        variable that no kdtree process reads (a misspelt setting) is warned about."""
        warn_unknown_variables()
        try:
            return cls(**overrides)
        except ValidationError as e:
            raise ConfigError(invalid_setting(cls, e)) from None


# KDTREE_ variables that no settings class reads: compose's stack variables (.env), the image build's, CI's and the
# test and benchmark tools'. With the fields of every settings class they are the names a process knows (one
# environment may hold another process's); tests/stack/test_compose_files.py holds this list against those files.
OTHER_VARIABLES = frozenset(
    {
        # compose (.env.example)
        "KDTREE_MODEL", "KDTREE_MODEL_DIR", "KDTREE_TP_SIZE", "KDTREE_SPECULATIVE_ARGS", "KDTREE_SGLANG_EXTRA_ARGS",
        "KDTREE_SERVER_ENV_FILE", "KDTREE_CONTAINER_LOG_MAX_SIZE", "KDTREE_CONTAINER_LOG_MAX_FILES",
        "KDTREE_DOCKER_GID", "KDTREE_SERVER_IMAGE", "KDTREE_SIDECAR_IMAGE", "KDTREE_BASE_IMAGE", "KDTREE_CUDA_ARCHS",
        "KDTREE_REVISION", "KDTREE_BIND_ADDRESS", "KDTREE_PUBLISH_SERVER_PORT", "KDTREE_PUBLISH_SIDECAR_PORT",
        # the image build and CI (.ci/docker.sh, tests/stack/compose.ci.yaml)
        "KDTREE_SOURCE", "KDTREE_CREATED", "KDTREE_VERSION", "KDTREE_IMAGE_TAG", "KDTREE_CA_BUNDLE",
        "KDTREE_CI_LOG_DIR", "KDTREE_CI_LOAD_SECONDS", "KDTREE_CI_SERVER_RESTART", "KDTREE_CI_STANDIN_ARGS",
        # the test and benchmark tools (tests/, kernel_build/bench/)
        "KDTREE_VENV", "KDTREE_DIST", "KDTREE_ENGINE_SITE", "KDTREE_FP8_BUDGET_S", "KDTREE_FP8_ERRORS",
        "KDTREE_TIMELINE", "KDTREE_VARIANTS_DIR", "KDTREE_VARIANTS_GRID",
    }
)  # fmt: skip
# The modules of the settings classes of every process (the sidecar, kdtreectl, the launcher and its supervisor);
# this module's own serve SGLang's ranks.
SETTINGS_MODULES = ("sidecar.settings", "kdtreectl.settings", "entrypoint.launch")
_warned: set[str] = set()


@functools.cache
def known_variables() -> frozenset[str]:
    """Every KDTREE_ variable some kdtree process or the stack reads."""
    for module in SETTINGS_MODULES:
        importlib.import_module(module)
    names, classes = set(OTHER_VARIABLES), [KdtreeSettings]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        for name, field in cls.model_fields.items():
            alias = field.validation_alias
            names.update(alias.choices if isinstance(alias, AliasChoices) else ["KDTREE_" + name.upper()])
    return frozenset(str(n) for n in names)


def warn_unknown_variables(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Warn, once per process and name, about each KDTREE_ variable set that nothing reads (a misspelt setting
    would be ignored silently), with the closest known name; returns the warnings."""
    new = [v for v in environ if v.startswith("KDTREE_") and v not in _warned]
    if not new:
        return []
    known = known_variables()
    warnings = []
    for var in sorted(set(new) - known):
        _warned.add(var)
        close = difflib.get_close_matches(var, known, n=1, cutoff=0.8)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.append(
            f"kdtree: warning: {var} is set, but no kdtree setting has that name: it is ignored{hint}"
        )
        logging.getLogger("kdtree.config").warning("%s", warnings[-1])
    return warnings


def invalid_setting(cls: type[KdtreeSettings], e: ValidationError) -> str:
    """The one line that refuses a settings class's first invalid value."""
    err = e.errors()[0]
    msg = err["msg"].removeprefix("Value error, ")
    if not err.get("loc"):  # a check of several fields together: its message names them
        return msg
    name = str(err["loc"][0])
    var = name.upper() if name.upper().startswith("KDTREE_") else "KDTREE_" + name.upper()
    field = cls.model_fields.get(name)
    if field is None:  # read through an alias: pydantic names the first of the field's choices
        field = next((f for f in cls.model_fields.values() if name in _alias_names(f)), None)
    kind = field.annotation if field is not None else None
    choices = isinstance(kind, type) and issubclass(kind, Enum)
    if choices:
        msg = "set it to one of: " + ", ".join(m.value for m in kind)
    fix = cls.fixes.get(var)
    # pydantic's own constraints (a bound, a type) name no fix: the way out every optional setting has
    if not (fix or choices or err["type"] == "value_error") and field is not None and not field.is_required():
        default = field.get_default(call_default_factory=True)
        shown = default.value if isinstance(default, Enum) else default
        fix = "a value that meets this, or unset it" + (
            f" for the default ({shown})" if shown is not None else ""
        )
    return f"{var}={err.get('input')!r} is invalid: {msg}" + (f"; fix: {fix}" if fix else "")


def _alias_names(field) -> set[str]:
    alias = field.validation_alias
    choices = alias.choices if isinstance(alias, AliasChoices) else [alias] if alias else []
    return {c for c in choices if isinstance(c, str)}


def http_url(value: str, example: str = "http://HOST:PORT") -> str:
    """value, if it is an http(s) URL with a host and, if any, a port in range (at most 2,048 characters, no
    surrounding space); else ValueError naming the form (not the value: the caller's message has it)."""
    try:
        ok = isinstance(value, str) and len(value) <= 2048 and value == value.strip()
        parts = urlsplit(value) if ok else None
        ok = parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)
        # .port raises ValueError for a port out of range or not a number
        ok = ok and (parts.port is None or parts.port > 0)
    except ValueError:  # urlsplit's own refusals (an unclosed IPv6 bracket), a bad port
        ok = False
    if not ok:
        raise ValueError(f"not an http(s) URL with a host and a valid port: write it as {example}")
    return value


class StateDirSettings(KdtreeSettings):
    """The field every server-side process shares (SGLang's ranks, the launcher, the sidecar): the state volume."""

    state_dir: str = Field(
        "/var/run/kdtree",
        min_length=1,
        description="the state volume the ranks, the launcher and the sidecar share: mode file, records, logs",
    )


# Validate's bound on an fp8 KV pool, by the pool's torch dtype name (kdtree.verify keys it by dtype; the sidecar's
# gate reads it by the name a rank record gives its pool). The original (SGLang's Triton kernel) casts q and P to the
# pool's fp8 dtype; kdtree widens the pool exactly and stays within its bf16 bound (1e-2) of the fp64 of the dequantised pool, so
# the two differ by the original's own fp8 error. Measured on the H200 (device_run.sh fp8, 2026-12-02, 32 cases per
# dtype: trees, DAG masks, chains, ragged prefixes, scales 0.05-2.5, both configurations): Triton from fp64 at most
# 2.6% (e4m3) and 5.1% (e5m2), Triton from kdtree at most 2.6% and 5.1%; an earlier sweep saw 9.2% over both dtypes.
# The bound is about twice the measured maximum (kernel_build/NOTES.md, "fp8 pools"); the setting's rtol applies
# when it is the larger.
FP8_PARITY_RTOL = {"float8_e4m3fn": 0.06, "float8_e5m2": 0.12}


class KernelSettings(KdtreeSettings):
    """The kernel binding's (kdtree.kernel): which library it loads, which tile configuration it plans in and how it
    reads an fp8 pool. Read at each load and plan, so kdtree.kernel.forced can force them within one process."""

    kernel_config: TileConfig | None = Field(
        None,
        description="a tile configuration forced (TILE_CONFIGS); unset: the first the GPU's shared memory allows",
    )
    fp8_path: Literal["widen", "mma"] = Field(
        "widen",
        description="an fp8 pool's prefix: widened exactly to f16, or fp8 x fp8 mma with q and P quantised as "
        "SGLang's Triton kernel does (kdtree.kernel.FP8_PATHS)",
    )
    kernel_lib: str | None = Field(
        None, description="the kernel library's path; unset: kdtree/lib/, then kernel_build/build/"
    )


class VerifySettings(StateDirSettings, KernelSettings):
    """The kdtree runtime inside each SGLang rank."""

    fixes: ClassVar[dict[str, str]] = {
        "KDTREE_DDTREE_BUDGET": "set auto or fixed; the tree's size is the server argument "
        "--speculative-num-draft-tokens N (the budget + 1)",
    }
    verify: Mode = Mode.OFF
    validate_rtol: float = Field(
        2e-2, gt=0, description="relative L2 error above which a compared call counts as over tolerance"
    )
    heartbeat_s: float = Field(5.0, gt=0, description="how often each rank rewrites its status record")
    ddtree_budget: Literal["auto", "fixed"] = Field(
        "auto",
        description="DDTREE's verify each step: auto cuts the captured tree to the budget that gives the most tokens a "
        "second (kdtree.ddtree.budget); fixed verifies the whole tree",
    )
