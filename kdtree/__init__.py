"""kdtree: MLA tree-verify attention for SGLang.

Importing this package is cheap: no torch, no sglang. The kernel binding (`kdtree.kernel`) and the
SGLang override (`kdtree.verify`) import torch/sglang themselves, only when used.
"""

__version__ = "0.1.0"
