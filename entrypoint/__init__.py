"""How the SGLang server container starts: config validation, then sglang.launch_server as a supervised child."""
