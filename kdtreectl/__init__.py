"""kdtreectl: the operator's command line for the kdtree sidecar (status, wait, mode, check, rollout)."""
