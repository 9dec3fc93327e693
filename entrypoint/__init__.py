"""How the SGLang server container starts: config validation, then exec of sglang.launch_server."""
