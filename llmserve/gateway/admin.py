"""The gateway's admin pages behind an admin key once callers need keys.

The dashboard, /metrics and the API docs name every upstream URL, every tenant namespace and the dollars spent
and saved per namespace: nothing a tenant may read. With no keys at all the gateway is open (a local one) and
so are they. With keys, they need the admin key, as `Authorization: Bearer KEY` (Prometheus' `authorization`
scrape setting) or as HTTP Basic's password (a browser's own prompt, whose credentials the dashboard's fetches
then carry); without an admin key configured they are closed, unless the config opens them on purpose.
"""

from __future__ import annotations

import base64
import binascii
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from llmserve.server.errors import error_body

ADMIN_PATHS = ("/dashboard", "/metrics", "/docs", "/redoc", "/openapi.json")
REALM = b'Basic realm="llmserve gateway admin", Bearer'


def is_admin_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in ADMIN_PATHS)


def presented_key(authorization: str) -> str | None:
    """The key in `Bearer KEY`, or the password in `Basic base64(user:KEY)`; None when there is none."""
    scheme, _, value = authorization.partition(" ")
    scheme, value = scheme.lower(), value.strip()
    if scheme == "bearer" and value:
        return value
    if scheme == "basic" and value:
        try:
            _, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return password or None
    return None


class AdminGate:
    """ASGI gate in front of the app: admin paths need the admin key when `protected`."""

    def __init__(self, app: ASGIApp, admin_key: str | None, protected: bool) -> None:
        self.app = app
        self._key = admin_key
        self._protected = protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._protected or not is_admin_path(scope["path"]):
            return await self.app(scope, receive, send)
        given = presented_key(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"))
        if self._key is not None and given is not None and hmac.compare_digest(given.encode(), self._key.encode()):
            return await self.app(scope, receive, send)
        if self._key is None:
            status, message, headers = 403, ("the admin pages are closed while API keys are set: give the gateway "
                                             "an admin key (admin_key_env in its config, or --admin-key), or open "
                                             "them on purpose (open_admin: true)"), []
        elif given is None:
            status, message, headers = 401, "the admin pages need the admin key", [(b"www-authenticate", REALM)]
        else:
            status, message, headers = 403, "this key is not the admin key", []
        code = "invalid_api_key" if status == 401 else "forbidden"
        body = error_body(status, message, code=code)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
        await send({"type": "http.response.body", "body": body})
