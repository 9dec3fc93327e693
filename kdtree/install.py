"""One idempotent install of the verify override per process, reached by either of two paths.

- Entry point (`kdtree.plugin:register`, group `sglang.srt.plugins`): SGLang's `load_plugins()` calls it
  in every process it starts; it registers an AROUND hook with SGLang's HookRegistry, and
  `load_plugins()` applies it right after all plugins ran (`HookRegistry.apply_hooks()`).
- Import hook (`entrypoint/sitecustomize.py`): for launchers that never call `load_plugins()`, the
  override is wrapped directly around `forward_extend` right after the Triton backend module executes.

Whichever path comes first installs; the other then finds the install and does nothing, so
`forward_extend` is wrapped once. The installing process prints one line:
`[kdtree] installed verify override (mode=..., pid=..., tp_rank=..., via=entry-point|import-hook)`. SGLang publishes a scheduler's
tp rank only after plugins load, so the line usually says `tp_rank=?`; the status record carries the
rank as soon as it is known (see kdtree.state.heartbeat).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING

from kdtree.config import ConfigError, VerifySettings

if TYPE_CHECKING:
    from kdtree.state.heartbeat import Heartbeat
    from kdtree.verify import VerifyOverride

TARGET_MODULE = "sglang.srt.layers.attention.triton_backend"
TARGET_CLASS = "TritonAttnBackend"
TARGET_METHOD = "forward_extend"
TARGET = f"{TARGET_MODULE}.{TARGET_CLASS}.{TARGET_METHOD}"
MARKER = "__kdtree_override__"  # set on the wrapper the import hook makes

_lock = threading.RLock()
_installed_by: str | None = None  # "entry-point" | "import-hook"
_override: VerifyOverride | None = None
_heartbeat: Heartbeat | None = None


def forward_extend_override(original_fn, *args, **kwargs):
    """The AROUND hook (HookRegistry signature): the process's VerifyOverride decides per call."""
    return _override(original_fn, *args, **kwargs)


def install_via_registry() -> bool:
    """Entry-point path: register the AROUND hook with SGLang's HookRegistry. True if this call installed.

    A bad KDTREE_* value exits the process with the message: load_plugins() logs and skips a plugin's
    ordinary exception, which would leave a misconfigured server running without anyone noticing.
    """
    global _installed_by
    with _lock:
        if _installed_by is not None:
            return False
        try:
            _activate()
        except ConfigError as e:
            raise SystemExit(f"[kdtree] {e}") from None
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(TARGET, forward_extend_override, HookType.AROUND)
        _installed_by = "entry-point"
        _announce()
        return True


def install_on_import(module: ModuleType) -> bool:
    """Import-hook path: wrap forward_extend in the freshly executed backend module. True if this call installed.

    A bad KDTREE_* value raises ConfigError, so the import of SGLang's Triton backend fails with it.
    """
    global _installed_by
    with _lock:
        if _installed_by is not None:
            return False
        cls = getattr(module, TARGET_CLASS)
        original = cls.__dict__[TARGET_METHOD]
        if override_layers(original):  # already ours (a reloaded kdtree.install): never wrap twice
            return False
        _activate()

        @functools.wraps(original)
        def forward_extend(*args, **kwargs):
            return forward_extend_override(original, *args, **kwargs)

        setattr(forward_extend, MARKER, True)
        setattr(cls, TARGET_METHOD, forward_extend)
        _installed_by = "import-hook"
        _announce()
        return True


def _activate() -> None:
    global _override, _heartbeat
    settings = VerifySettings.load()  # ConfigError on a bad value, before anything is changed
    from kdtree.state.heartbeat import Heartbeat
    from kdtree.verify import VerifyOverride

    _override = VerifyOverride(settings)
    _heartbeat = Heartbeat(
        settings.state_dir,
        snapshot=_override.snapshot,
        installed=is_installed,
        follow=_override.mode.follow,
        layers=installed_layers,
    )


def _announce() -> None:
    rank = _heartbeat.resolve_rank()
    tp_rank = "?" if rank is None else rank[0]
    print(
        f"[kdtree] installed verify override (mode={_override.mode.mode.value}, pid={os.getpid()}, "
        f"tp_rank={tp_rank}, via={_installed_by})",
        flush=True,
    )
    _heartbeat.beat()  # a record now if the rank is already known; the heartbeat keeps it fresh
    _heartbeat.start(_override.settings.heartbeat_s)


def override_layers(fn) -> int:
    """How many kdtree wrappers sit in forward_extend's wrapper chain (1 when installed, never 2)."""
    layers = 0
    while fn is not None:
        closure = getattr(fn, "__closure__", None) or ()
        if getattr(fn, MARKER, False) or any(_cell(c) is forward_extend_override for c in closure):
            layers += 1
        fn = getattr(fn, "__wrapped__", None)
    return layers


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def installed_layers() -> int:
    """kdtree wrappers in SGLang's forward_extend now: 1 once installed, 0 before (no import, no CUDA)."""
    module = sys.modules.get(TARGET_MODULE)
    cls = getattr(module, TARGET_CLASS, None)
    return 0 if cls is None else override_layers(cls.__dict__.get(TARGET_METHOD))


def is_installed() -> bool:
    """True when SGLang's forward_extend runs through the override now (no import, no CUDA)."""
    return installed_layers() > 0


def installed_by() -> str | None:
    return _installed_by


def current_override() -> VerifyOverride | None:
    return _override
