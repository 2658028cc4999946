"""Bearer-token guard of the mutating endpoints (drain, flush).

No token configured: those endpoints answer 403 and say how to set one — never open by
default.  A token configured: a request without ``Authorization: Bearer <token>``, or with a
wrong one, gets 401 with ``WWW-Authenticate: Bearer`` before the endpoint runs, so it changes
nothing.  Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .settings import AdminSettings

bearer = HTTPBearer(auto_error=False, scheme_name="AdminToken",
                    description="The admin token given to `kvring admin` (--token or KVRING_ADMIN_TOKEN).")


async def require_token(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    settings: AdminSettings = request.app.state.settings
    if settings.token is None:
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            "mutating endpoints are disabled because no admin token is configured; start "
                            "`kvring admin` with KVRING_ADMIN_TOKEN set (e.g. `export KVRING_ADMIN_TOKEN=$(openssl "
                            "rand -hex 32)`) or --token, and send it as `Authorization: Bearer <token>`")
    given = credentials.credentials.encode() if credentials is not None else b""
    if not hmac.compare_digest(given, settings.token.encode()):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED,
                            "this endpoint needs the admin token: send `Authorization: Bearer <token>`"
                            + (" (the token given is not the right one)" if credentials is not None else ""),
                            headers={"WWW-Authenticate": "Bearer"})
