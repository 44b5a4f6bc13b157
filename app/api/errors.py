"""The errors of the OpenAI-compatible API: :class:`APIError` (its :meth:`APIError.to_dict` is the OpenAI error
body) and the helpers that word each kind (400 invalid, unknown and unsupported parameters, 401-413, 429, 5xx)."""

from __future__ import annotations

import json
import math
from typing import Any, Literal

ErrorType = Literal["invalid_request_error", "rate_limit_error", "server_error", "not_found_error", "permission_error"]


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-style body ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, *, type: ErrorType = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return (f"APIError({self.status}, {self.message!r}, type={self.type!r}, param={self.param!r}, "
                f"code={self.code!r})")


def _printable(text: str) -> str:
    """``text`` with lone surrogates (valid in JSON strings, not in UTF-8) escaped, so an error that quotes
    a client's string can always be encoded."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def rate_limit_error(message: str, retry_after_s: float | None = None) -> APIError:
    """A 429 ``rate_limit_error``, with a ``Retry-After`` header (whole seconds, at least 1) when given."""
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    return APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded", headers=headers)


def server_error(message: str = "The server had an error while processing your request.",
                 status: int = 500) -> APIError:
    """A 5xx ``server_error``."""
    return APIError(status, message, type="server_error")


def permission_error(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 403 ``permission_error``: the caller may not do what it asked (e.g. a ``priority`` above its key's)."""
    return APIError(403, message, type="permission_error", param=param, code=code)


def request_timeout(seconds: float) -> APIError:
    """A 408 for a request body that did not arrive within ``seconds``."""
    return APIError(408, f"The request body did not arrive within {seconds:g} seconds.", code="request_timeout")


def not_found_error(message: str) -> APIError:
    """A 404 ``not_found_error`` (unknown route or object)."""
    return APIError(404, message, type="not_found_error", code="not_found")


def body_too_large(limit: int) -> APIError:
    """A 413 for a request body over ``limit`` bytes."""
    return APIError(413, f"The request body is too large: at most {limit} bytes are accepted.",
                    code="request_too_large")


def check_content_length(header: str | None, limit: int) -> None:
    """Raise 413 early when a declared ``Content-Length`` is over ``limit`` (the body is still counted as
    it arrives: the header may be absent or wrong)."""
    if header is not None and header.strip().isdigit() and int(header) > limit:
        raise body_too_large(limit)



def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _type_error(param: str, expected: str, value: Any) -> APIError:
    return invalid(f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)} instead.",
                   param=param, code="invalid_type")


def _value_error(param: str, message: str, code: str = "invalid_value") -> APIError:
    return invalid(f"Invalid value for '{param}': {message}", param=param, code=code)


def _missing(param: str, message: str | None = None) -> APIError:
    return invalid(message or f"Missing required parameter: '{param}'.", param=param,
                   code="missing_required_parameter")


def unsupported(param: str, accepted: tuple = ()) -> APIError:
    """A 400 for a known parameter that Remask does not implement (sent with another value than its default)."""
    hint = f" Omit it or send {' or '.join(json.dumps(v) for v in accepted)}." if accepted else ""
    return invalid(f"Remask does not support '{param}'.{hint}", param=param, code="unsupported_parameter")


def unknown(param: str) -> APIError:
    """A 400 for a field Remask does not know (as OpenAI words it)."""
    return invalid(f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")

