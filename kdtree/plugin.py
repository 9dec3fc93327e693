"""SGLang plugin entry point (`[project.entry-points."sglang.srt.plugins"] kdtree = "kdtree.plugin:register"`).

SGLang's load_plugins() calls register() first thing in every process it starts (each tensor-parallel
scheduler among them), then applies the registered hooks. register() makes no CUDA call: the worker's
device is not configured yet at that point.
"""

from __future__ import annotations


def register() -> None:
    """Register the target-verify override as an AROUND hook on TritonAttnBackend.forward_extend, and the DDTREE
    speculative algorithm (`kdtree.ddtree.spec`), once each."""
    from kdtree.ddtree.spec import register as register_ddtree
    from kdtree.install import install_via_registry

    install_via_registry()
    register_ddtree()
