"""The verify mode and its settings, read from the environment (one place, used by every process)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict


class Mode(StrEnum):
    OFF = "off"  # SGLang's Triton path only: nothing of kdtree's runs (the kill switch)
    VALIDATE = "validate"  # Triton serves; kdtree runs beside it and is compared on the device
    ON = "on"  # kdtree serves target-verify attention
    STANDBY = "standby"  # installed and idle: Triton serves, kdtree does no attention work


# A server started in one of these switches between them while it runs (kdtree.control.ModeHolder); to or from
# `off` it restarts.
LIVE_MODES = frozenset({Mode.VALIDATE, Mode.ON, Mode.STANDBY})


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the variable and the fix."""


class VerifySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KDTREE_", extra="ignore", env_ignore_empty=True)

    verify: Mode = Mode.OFF
    validate_rtol: float = Field(
        2e-2, gt=0, description="relative L2 error above which a compared call counts as over tolerance"
    )
    state_dir: str = "/var/run/kdtree"
    heartbeat_s: float = Field(5.0, gt=0, description="how often each rank rewrites its status record")


def load_settings() -> VerifySettings:
    """Read KDTREE_* from the environment; a bad value raises ConfigError with a one-line fix."""
    try:
        return VerifySettings()
    except ValidationError as e:
        err = e.errors()[0]
        var = "KDTREE_" + str(err["loc"][0]).upper() if err.get("loc") else "KDTREE_*"
        allowed = ", ".join(m.value for m in Mode)
        hint = f"set it to one of: {allowed}" if var == "KDTREE_VERIFY" else err["msg"]
        raise ConfigError(f"{var}={err.get('input')!r} is invalid: {hint}") from None
