"""DDTree (arXiv 2604.12989) for SGLang 0.5.23: the best-first draft tree, its acceptance walk, the registry pieces.

- `reference`: the pure-Python heap form of Algorithm 1 and the acceptance walk (no torch), the tests' oracle;
- `tree`: the fixed-shape torch form that runs inside a CUDA graph (imports torch);
- `accept`: the fixed-shape acceptance walk and the commit's slot permutation (imports torch);
- `fused`: the tree and the walk each as one Triton kernel, what the worker runs on CUDA (imports triton);
- `server_args`: `validate_server_args`, the check of the server arguments that SGLang and kdtree's launcher run;
- `spec`: `DDTreeSpec` and `register()` for SGLang's registry (imports SGLang);
- `worker`: `DDTreeWorker`, DFlashWorkerV2 with the tree (imports SGLang's worker; only a server imports it).
"""
