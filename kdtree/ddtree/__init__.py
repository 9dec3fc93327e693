"""DDTree (arXiv 2604.12989) for SGLang 0.5.23: the best-first draft tree, its acceptance walk, the registry pieces.

- `reference`: the pure-Python heap form of Algorithm 1 and the acceptance walk (no torch), the tests' oracle;
- `tree`: the fixed-shape torch form that runs inside a CUDA graph (imports torch);
- `spec`: `validate_server_args` and `DDTreeSpec` for `SpeculativeAlgorithm.register` (imports SGLang).
Nothing here registers DDTREE, and kdtree's plugin does not either: there is no DDTree worker yet.
"""
