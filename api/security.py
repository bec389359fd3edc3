"""Bearer-token guard for mutating endpoints (and, with ``HEADROOM_REQUIRE_TOKEN_FOR_READS``,
the reads of stored records); with no token configured they are refused."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

_bearer = HTTPBearer(auto_error=False, description="HEADROOM_TOKEN")


class AuthError(Exception):
    """Raised by the guard; rendered as a 401 problem."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Allow the request only with ``Authorization: Bearer <HEADROOM_TOKEN>``."""
    token = request.app.state.settings.token
    if token is None:
        raise AuthError("this endpoint needs HEADROOM_TOKEN to be configured on the server")
    if credentials is None:
        raise AuthError("missing bearer token (Authorization: Bearer <token>)")
    if not hmac.compare_digest(credentials.credentials.encode(), token.get_secret_value().encode()):
        raise AuthError("invalid bearer token")
