"""Optional API keys: Bearer authentication and per-key limits for the ingress.

Pure Python (pydantic only). ``AppConfig.http.api_keys`` lists :class:`ApiKeySpec` entries; an empty list
leaves the API open. The ingress builds a :class:`Keyring` from them once, then for each request

- :meth:`Keyring.authenticate` maps the ``Authorization`` header to an :class:`ApiKey` (or raises a
  401 :class:`~app.api.APIError`),
- :meth:`ApiKey.max_tokens_limit` and :meth:`ApiKey.check_prompt` apply the key's limits,
- :meth:`Keyring.acquire` takes one of the key's concurrent-request slots (or raises a 429 with
  ``Retry-After``); the returned :class:`Lease` is released when the request ends, however it ends.

A key is never kept, compared, logged or echoed as text: the keyring holds SHA-256 digests, compares
them with :func:`hmac.compare_digest`, and names a key by its configured ``name``. A rejected key is
logged as an 8-hex-digit HMAC under a per-process random salt (:meth:`Keyring.fingerprint`), which
links repeated attempts within one process but cannot be reversed or checked offline.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from app.api import APIError, invalid, rate_limit_error

log = logging.getLogger(__name__)


class ApiKeySpec(BaseModel):
    """One API key: where its secret comes from (exactly one of ``key``, ``key_env``, ``key_file``) and its
    limits (``None``: only the application's own limits apply)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="how logs and metrics name the key (never the key itself)")
    key: SecretStr | None = Field(None, description="the key itself (tests; it then sits in the config)")
    key_env: str | None = Field(None, description="environment variable of the ingress replica holding the key")
    key_file: str | None = Field(None, description="file holding the key (surrounding whitespace is stripped)")
    max_concurrent: int | None = Field(None, ge=1, description="requests of this key in flight at once")
    max_prompt_tokens: int | None = Field(None, ge=1, description="prompt tokens per request")
    max_tokens: int | None = Field(None, ge=1, description="max_tokens per request (also caps the default)")

    @model_validator(mode="after")
    def _one_source(self) -> ApiKeySpec:
        given = [s for s in ("key", "key_env", "key_file") if getattr(self, s) is not None]
        if len(given) != 1:
            raise ValueError(f"API key {self.name!r}: give exactly one of key, key_env, key_file (got {given})")
        return self

    def secret(self, environ: Mapping[str, str] | None = None) -> str:
        """The key's text, read now; errors name the source, never the key."""
        if self.key is not None:
            text, where = self.key.get_secret_value(), "key"
        elif self.key_env is not None:
            env = os.environ if environ is None else environ
            if not env.get(self.key_env):
                raise ValueError(f"API key {self.name!r}: environment variable {self.key_env} is not set")
            text, where = env[self.key_env].strip(), f"environment variable {self.key_env}"
        else:
            try:
                text = Path(self.key_file).read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"API key {self.name!r}: cannot read {self.key_file}: {type(exc).__name__}") from None
            where = self.key_file
        if not text or not text.isascii() or not text.isprintable() or any(c.isspace() for c in text):
            raise ValueError(f"API key {self.name!r} (from {where}): a key must be non-empty printable ASCII "
                             "without spaces")
        return text


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "backslashreplace")).digest()


@dataclass(frozen=True)
class ApiKey:
    """An authenticated caller: the key's name and limits (the digest stays inside the keyring)."""

    name: str
    max_concurrent: int | None = None
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None

    def max_tokens_limit(self, app_limit: int) -> int:
        """The largest max_tokens this caller may ask for."""
        return app_limit if self.max_tokens is None else min(app_limit, self.max_tokens)

    def check_prompt(self, prompt_tokens: int) -> None:
        """Raise a 400 when the prompt is longer than the key allows."""
        if self.max_prompt_tokens is not None and prompt_tokens > self.max_prompt_tokens:
            raise invalid(f"This API key allows prompts of at most {self.max_prompt_tokens} tokens; your prompt has "
                          f"{prompt_tokens}.", param="prompt", code="prompt_too_long")


OPEN = ApiKey("-")  # the caller when no keys are configured: no limits of its own


class Lease:
    """One concurrent-request slot of a key; :meth:`release` is idempotent."""

    def __init__(self, counts: dict[str, int] | None, name: str) -> None:
        self._counts, self._name = counts, name
        self.released = counts is None

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._counts[self._name] -= 1


@dataclass
class Keyring:
    """The configured keys (as digests) and how many requests each has in flight."""

    keys: list[tuple[bytes, ApiKey]] = field(default_factory=list)
    active: dict[str, int] = field(default_factory=dict)
    _salt: bytes = field(default_factory=lambda: os.urandom(16), repr=False)

    @classmethod
    def from_specs(cls, specs: list[ApiKeySpec], environ: Mapping[str, str] | None = None) -> Keyring:
        ring = cls()
        names: set[str] = set()
        for spec in specs:
            if spec.name in names:
                raise ValueError(f"API key name {spec.name!r} is used twice")
            names.add(spec.name)
            digest = _digest(spec.secret(environ))
            if any(hmac.compare_digest(digest, d) for d, _ in ring.keys):
                raise ValueError(f"API key {spec.name!r} has the same key as another entry")
            ring.keys.append((digest, ApiKey(spec.name, spec.max_concurrent, spec.max_prompt_tokens,
                                             spec.max_tokens)))
            ring.active[spec.name] = 0
        return ring

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def fingerprint(self, token: str) -> str:
        """A short, non-reversible tag of a presented key (stable within this process only)."""
        return hmac.new(self._salt, token.encode("utf-8", "backslashreplace"), hashlib.sha256).hexdigest()[:8]

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The caller of a request whose ``Authorization`` header is ``authorization``; 401 unless it is
        ``Bearer <a configured key>``. With no keys configured every caller is :data:`OPEN`."""
        if not self.enabled:
            return OPEN
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized("You didn't provide an API key. You need to provide your API key in an "
                                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        presented, match = _digest(token), None
        for digest, key in self.keys:  # every entry is compared: the time does not depend on which one matched
            if hmac.compare_digest(digest, presented):
                match = key
        if match is None:
            log.info("rejected an unknown API key (fingerprint %s)", self.fingerprint(token))
            raise _unauthorized("Incorrect API key provided.")
        return match

    def acquire(self, key: ApiKey) -> Lease:
        """Take one of ``key``'s concurrent-request slots; 429 with ``Retry-After`` when all are taken."""
        if key is OPEN or key.name not in self.active:
            return Lease(None, key.name)
        if key.max_concurrent is not None and self.active[key.name] >= key.max_concurrent:
            raise rate_limit_error(f"Too many concurrent requests for this API key: at most {key.max_concurrent} "
                                   "may be in flight at once.", retry_after_s=1.0)
        self.active[key.name] += 1
        return Lease(self.active, key.name)


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
