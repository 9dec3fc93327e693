"""kdtreectl's variables: the defaults of its flags (docs/configuration.md's kdtreectl table). The sidecar's own
settings are sidecar/settings.py; KDTREE_ADMIN_TOKEN (or KDTREE_ADMIN_TOKEN_FILE), KDTREE_SERVER_URL and
KDTREE_SERVER_API_KEY mean the same thing in both, so that kdtreectl run in the sidecar's container (docker compose
exec sidecar kdtreectl, or kubectl exec into a pod's sidecar, whose token is a Secret's file) finds them set."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import PrivateAttr, SecretStr, model_validator

from kdtree.config import KdtreeSettings, http_url
from sidecar.settings import token_from


class CtlSettings(KdtreeSettings):
    sidecar_url: str = "http://127.0.0.1:8080"  # --url
    admin_token: SecretStr | None = None  # --token: the bearer token for mode, rollout, check --flip
    admin_token_file: Path | None = None  # the same token from a file (a Kubernetes pod's Secret volume)
    server_url: str = "http://127.0.0.1:30000"  # check --server-url: the SGLang server
    server_api_key: SecretStr | None = None  # check: SGLang's --api-key, sent with its completions
    # why no token came from the token variables (both set, a file unreadable or not a token): kdtreectl warns, and
    # only the commands that need a token fail (the sidecar's 401), unless --token gives one
    _token_problem: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _token_from_file(self) -> CtlSettings:
        """The token from KDTREE_ADMIN_TOKEN_FILE where that is set, as the sidecar reads it (never both)."""
        value = self.admin_token.get_secret_value() if self.admin_token else None
        try:
            token = token_from(value, self.admin_token_file, "KDTREE_ADMIN_TOKEN")
        except ValueError as e:
            token, self._token_problem = None, str(e)
        self.admin_token = SecretStr(token) if token else None
        return self

    @property
    def token_problem(self) -> str | None:
        return self._token_problem


def url_flag(variable: str):
    """argparse's type for a URL flag whose default is `variable`'s: kdtree.config's check, as a usage error (exit
    2). argparse converts a default given as text too, so a bad variable is refused only where its flag is read."""

    def parse(text: str) -> str:
        try:
            return http_url(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"{text[:100]!r} is {e} (the flag, or {variable} without it)"
            ) from None

    return parse
