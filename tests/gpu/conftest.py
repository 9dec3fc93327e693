"""GPU tests import SGLang through sglang_stubs (stand-ins for compiled packages the attention path never calls)
when the real compiled packages are absent, as on a bare GPU machine with only SGLang's Python wheels."""

import importlib.util

# sglang_stubs is in standins/, on sys.path through pytest's pythonpath setting (pyproject.toml).
if importlib.util.find_spec("sgl_kernel") is None and importlib.util.find_spec("sglang") is not None:
    import sglang_stubs  # noqa: F401
