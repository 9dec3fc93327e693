"""kdtreectl's variables: the defaults of its flags (the README's kdtreectl table). The sidecar's own settings are
sidecar/settings.py; KDTREE_ADMIN_TOKEN, KDTREE_SERVER_URL and KDTREE_SERVER_API_KEY mean the same thing in both,
so that kdtreectl run in the sidecar's container (docker compose exec sidecar kdtreectl) finds them set."""

from __future__ import annotations

from pydantic import SecretStr

from kdtree.config import KdtreeSettings


class CtlSettings(KdtreeSettings):
    sidecar_url: str = "http://127.0.0.1:8080"  # --url
    admin_token: SecretStr | None = None  # --token: the bearer token for mode, rollout, check --flip
    server_url: str = "http://127.0.0.1:30000"  # check --server-url: the SGLang server
    server_api_key: SecretStr | None = None  # check: SGLang's --api-key, sent with its completions
