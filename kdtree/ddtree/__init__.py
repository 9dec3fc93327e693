"""DDTree (arXiv 2604.12989) for SGLang 0.5.23: the best-first draft tree and its acceptance walk.

`reference` is the pure-Python heap form of Algorithm 1 and the acceptance walk (no torch), the oracle for tests;
`tree` is the fixed-shape torch form that runs inside a CUDA graph (imports torch). Nothing here registers a
speculative algorithm: there is no DDTREE worker yet.
"""
