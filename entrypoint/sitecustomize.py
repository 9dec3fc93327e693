"""Install the kdtree verify override in every interpreter that imports SGLang's Triton attention backend.

On PYTHONPATH in the server image, so it reaches every SGLang process, including launchers that never
call SGLang's load_plugins(). At interpreter start it only adds an import hook (standard library only:
no torch, no sglang, no kdtree import). When `sglang.srt.layers.attention.triton_backend` has executed,
the hook hands the module to kdtree.install, which wraps forward_extend once per process; the SGLang
entry point (kdtree.plugin) converges on the same install.

Python runs only the first sitecustomize on sys.path; this one runs the next one it shadows, if any.
"""

import os
import sys

_TARGET = "sglang.srt.layers.attention.triton_backend"


class _InstallAfterExec:
    """Wraps the real loader of the backend module: execute it, then install the override."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        from kdtree.install import install_on_import

        install_on_import(module)


class _BackendImportHook:
    """A meta path finder that answers for one module only, by asking the other finders for its spec."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _InstallAfterExec(spec.loader)
                return spec
        return None


def _run_shadowed_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        directory = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(directory, "sitecustomize.py")
        if directory != here and os.path.isfile(candidate):
            import runpy

            runpy.run_path(candidate, run_name="sitecustomize")
            return


if not any(type(f).__name__ == "_BackendImportHook" for f in sys.meta_path):
    sys.meta_path.insert(0, _BackendImportHook())
_run_shadowed_sitecustomize()
