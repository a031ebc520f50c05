"""Short-lived JWTs standing for an API key (`POST /api/v1/auth/token`, the Tinker SDK's login).

A token is HS256-signed (PyJWT) with the server's secret: `$LORASERVE_JWT_SECRET` when set (so
several servers, or a restarted one, accept each other's tokens), else random per server start.
It carries the key's id (`sub`), a binding to that key (`kb`: an HMAC of the key's hash, so a
key rotated or removed from the keys file takes its tokens with it), `iat` and `exp`.

A valid token resolves to the principal of its key in the *current* KeyStore: tenancy, limits
and the admin role apply to the token bearer exactly as to the key.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time

import jwt

from loraserve.keys import KeyEntry, KeyStore, Principal

SECRET_ENV = "LORASERVE_JWT_SECRET"
TOKEN_TTL_S = 3600  # the SDK refreshes 5 minutes before `exp`
ISSUER = "loraserve"
_ALGORITHM = "HS256"


def looks_like_jwt(credential: str) -> bool:
    """A JWT is three base64url parts; an API key is not worth a signature check otherwise."""
    return credential.startswith("eyJ") and credential.count(".") == 2


class TokenIssuer:
    """Mints and verifies the tokens of one server (see module doc)."""

    def __init__(self, secret: str | bytes | None = None, ttl_s: float = TOKEN_TTL_S) -> None:
        secret = secret or os.environ.get(SECRET_ENV)
        # a configured secret of any length becomes a 256-bit HMAC key
        self._secret = secrets.token_bytes(32) if not secret else hashlib.sha256(
            secret.encode() if isinstance(secret, str) else secret).digest()
        self.ttl_s = ttl_s

    def mint(self, principal: Principal, store: KeyStore) -> str:
        """A token for the key `principal` was found by (its entry in `store`); a server without
        keys (principal OPEN, no entry) mints an unbound one, accepted only where no key is
        asked for."""
        entry = _entry_of(principal, store)
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": principal.key_id or "", "iat": now,
                  "exp": now + int(self.ttl_s),
                  "kb": self._binding(entry) if entry is not None else ""}
        return jwt.encode(claims, self._secret, algorithm=_ALGORITHM)

    def principal(self, token: str, store: KeyStore) -> Principal | None:
        """The principal of a valid, unexpired token whose key is still in `store`; else None."""
        try:
            claims = jwt.decode(token, self._secret, algorithms=[_ALGORITHM], issuer=ISSUER,
                                options={"require": ["exp", "iat", "sub"]})
        except jwt.PyJWTError:
            return None
        found = None
        for entry in store.entries:  # every entry compared: time independent of which matches
            bound = hmac.compare_digest(self._binding(entry), str(claims.get("kb", "")))
            if bound and entry.principal.key_id == claims["sub"]:
                found = entry.principal
        return found

    def _binding(self, entry: KeyEntry) -> str:
        return hmac.new(self._secret, entry.digest, hashlib.sha256).hexdigest()[:32]


def _entry_of(principal: Principal, store: KeyStore) -> KeyEntry | None:
    return next((e for e in store.entries if e.principal is principal), None) or \
        next((e for e in store.entries if e.principal == principal), None)
