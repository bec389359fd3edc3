"""Bearer-token guard for mutating endpoints (and, with ``HEADROOM_REQUIRE_TOKEN_FOR_READS``,
the reads of stored records); with no token configured they are refused.

Each guarded route declares ``require_token`` (the OpenAPI shows the bearer scheme on it); its
router's ``TokenFirst`` route class checks the same token before the request body is read.
FastAPI reads and parses a body before it solves a route's dependencies, so with the
dependency alone a client without the token made the server read and parse up to
``MAX_BODY_BYTES`` for its 401 (68 ms of CPU for 1 MiB).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, Request, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import SecretStr

_bearer = HTTPBearer(auto_error=False, description="HEADROOM_TOKEN")


class AuthError(Exception):
    """Raised by the guard; rendered as a 401 problem."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def refusal(token: SecretStr | None, credentials: str | None) -> str | None:
    """Why a request bearing ``credentials`` (the token of its ``Authorization: Bearer``
    header, None without one) is refused when the server's token is ``token``; None: allowed."""
    if token is None:
        return "this endpoint needs HEADROOM_TOKEN to be configured on the server"
    if credentials is None:
        return "missing bearer token (Authorization: Bearer <token>)"
    if not hmac.compare_digest(credentials.encode(), token.get_secret_value().encode()):
        return "invalid bearer token"
    return None


def bearer_credentials(authorization: str | None) -> str | None:
    """The token of an ``Authorization`` header value, read as ``HTTPBearer`` reads it."""
    scheme, credentials = get_authorization_scheme_param(authorization)
    if not (authorization and scheme and credentials) or scheme.lower() != "bearer":
        return None
    return credentials


def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Allow the request only with ``Authorization: Bearer <HEADROOM_TOKEN>``."""
    why = refusal(
        request.app.state.settings.token, credentials.credentials if credentials else None
    )
    if why is not None:
        raise AuthError(why)


class TokenFirst(APIRoute):
    """A route that, when it declares ``require_token``, checks the token before its body is
    read: a refused request is answered 401 with its body left unread."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if not any(d.dependency is require_token for d in self.dependencies):
            return handler

        async def token_first(request: Request) -> Response:
            settings = request.app.state.settings
            why = refusal(settings.token, bearer_credentials(request.headers.get("authorization")))
            if why is not None:
                raise AuthError(why)
            return await handler(request)

        return token_first
