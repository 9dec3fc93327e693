"""The kdtree sidecar: readiness, status, metrics and the gated verify-mode switch for one SGLang server."""
