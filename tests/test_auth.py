"""API keys and their limits (app.auth), the body-size and schema helpers of app.api: no Ray."""

from __future__ import annotations

import json
import logging
import pickle

import pytest
from pydantic import ValidationError

from app.api import APIError, body_too_large, check_content_length, parse_request, request_schema
from app.auth import OPEN, ApiKeySpec, KeyHash, Keyring, hash_key
from app.config import AppConfig

SECRET_A = "sk-alpha-0123456789"
SECRET_B = "sk-bravo-9876543210"


def ring(**limits) -> Keyring:
    return Keyring.from_specs([ApiKeySpec(name="alpha", key=SECRET_A, **limits),
                               ApiKeySpec(name="bravo", key=SECRET_B)])


def assert_401(exc: APIError, *secrets: str) -> None:
    assert exc.status == 401 and exc.headers.get("WWW-Authenticate") == "Bearer"
    body = exc.to_dict()
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    text = json.dumps(body) + repr(exc) + str(exc)
    for s in secrets:
        assert s not in text


def test_no_keys_means_open_access():
    keys = Keyring.from_specs([])
    assert not keys.enabled
    assert keys.authenticate(None) is OPEN and keys.authenticate("Bearer anything") is OPEN
    lease = keys.acquire(OPEN)
    lease.release()
    assert OPEN.max_tokens_limit(512) == 512
    OPEN.check_prompt(10**9)


def test_right_key_authenticates_by_name():
    keys = ring()
    assert keys.authenticate(f"Bearer {SECRET_A}").name == "alpha"
    assert keys.authenticate(f"bearer   {SECRET_B}  ").name == "bravo"


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer   ", f"Basic {SECRET_A}", SECRET_A,
                                    f"Bearer {SECRET_A}x", f"Bearer {SECRET_A[:-1]}", "Bearer sk-\udcff",
                                    f"Bearer {SECRET_A.upper()}", "Bearer \u00e9\u00e8"])
def test_missing_or_wrong_key_is_401_without_echo(header):
    with pytest.raises(APIError) as info:
        ring().authenticate(header)
    assert_401(info.value, SECRET_A, SECRET_B, *(header.split()[1:] if header and " " in header.strip() else []))


def test_rejected_key_is_logged_as_a_fingerprint_only(caplog):
    keys = ring()
    wrong = "sk-wrong-key-abcdef"
    with caplog.at_level(logging.DEBUG, logger="app.auth"), pytest.raises(APIError):
        keys.authenticate(f"Bearer {wrong}")
    fp = keys.fingerprint(wrong)
    assert len(fp) == 8 and int(fp, 16) >= 0
    assert fp in caplog.text and wrong not in caplog.text and SECRET_A not in caplog.text
    assert keys.fingerprint(wrong) == fp and keys.fingerprint(wrong + "!") != fp
    assert ring().fingerprint(wrong) != fp  # a fresh salt per keyring: not checkable elsewhere


def test_keys_from_env_and_file(tmp_path):
    path = tmp_path / "key.txt"
    path.write_text(f"  {SECRET_B}\n")
    specs = [ApiKeySpec(name="env", key_env="REMASK_TEST_KEY"), ApiKeySpec(name="file", key_file=str(path))]
    keys = Keyring.from_specs(specs, environ={"REMASK_TEST_KEY": SECRET_A})
    assert keys.authenticate(f"Bearer {SECRET_A}").name == "env"
    assert keys.authenticate(f"Bearer {SECRET_B}").name == "file"


def test_bad_key_sources_fail_at_start_without_the_key(tmp_path):
    with pytest.raises(ValueError, match="REMASK_NOPE is not set"):
        Keyring.from_specs([ApiKeySpec(name="e", key_env="REMASK_NOPE")], environ={})
    with pytest.raises(ValueError, match="cannot read"):
        Keyring.from_specs([ApiKeySpec(name="f", key_file=str(tmp_path / "missing"))])
    with pytest.raises(ValueError) as info:
        Keyring.from_specs([ApiKeySpec(name="s", key="sk with space")])
    assert "sk with space" not in str(info.value)
    with pytest.raises(ValueError, match="used twice"):
        Keyring.from_specs([ApiKeySpec(name="a", key=SECRET_A), ApiKeySpec(name="a", key=SECRET_B)])
    with pytest.raises(ValueError, match="same key"):
        Keyring.from_specs([ApiKeySpec(name="a", key=SECRET_A), ApiKeySpec(name="b", key=SECRET_A)])


@pytest.mark.parametrize("sources", [{}, {"key": SECRET_A, "key_env": "X"}, {"key_env": "X", "key_file": "/k"},
                                     {"key": SECRET_A, "key_hash": hash_key(SECRET_A, iterations=1000)}])
def test_spec_needs_exactly_one_source(sources):
    with pytest.raises(ValidationError):
        ApiKeySpec(name="k", **sources)


def test_config_never_shows_an_inline_key():
    cfg = AppConfig(http={"api_keys": [{"name": "alpha", "key": SECRET_A, "max_concurrent": 2}]})
    assert SECRET_A not in repr(cfg) and SECRET_A not in str(cfg.model_dump())
    assert SECRET_A not in cfg.model_dump_json()
    again = pickle.loads(pickle.dumps(cfg))  # the builder hands the config to the deployments through Ray
    assert Keyring.from_specs(again.http.api_keys).authenticate(f"Bearer {SECRET_A}").name == "alpha"
    with pytest.raises(ValidationError):
        AppConfig(http={"api_keys": [{"name": "alpha", "key": SECRET_A, "max_concurrent": 0}]})


def test_concurrency_limit_429_and_release():
    keys = ring(max_concurrent=2)
    alpha = keys.authenticate(f"Bearer {SECRET_A}")
    first, second = keys.acquire(alpha), keys.acquire(alpha)
    with pytest.raises(APIError) as info:
        keys.acquire(alpha)
    err = info.value
    assert err.status == 429 and err.type == "rate_limit_error" and int(err.headers["Retry-After"]) >= 1
    bravo = keys.authenticate(f"Bearer {SECRET_B}")  # other keys are not affected
    leases = [keys.acquire(bravo) for _ in range(50)]
    first.release()
    first.release()  # idempotent: never frees a slot twice
    third = keys.acquire(alpha)
    with pytest.raises(APIError):
        keys.acquire(alpha)
    for lease in [second, third, *leases]:
        lease.release()
    assert keys.active == {"alpha": 0, "bravo": 0}


def test_per_key_token_limits():
    keys = Keyring.from_specs([ApiKeySpec(name="small", key=SECRET_A, max_tokens=32, max_prompt_tokens=16)])
    small = keys.authenticate(f"Bearer {SECRET_A}")
    assert small.max_tokens_limit(256) == 32 and small.max_tokens_limit(8) == 8
    small.check_prompt(16)
    with pytest.raises(APIError) as info:
        small.check_prompt(17)
    assert info.value.status == 400 and info.value.param == "prompt" and info.value.code == "prompt_too_long"
    # the key's max_tokens is the parser's limit: past it a 400, and it caps the default
    opts = dict(known_models=["m"], max_tokens_limit=small.max_tokens_limit(256), default_max_tokens=128)
    assert parse_request("completion", json.dumps({"prompt": "x"}), **opts).max_tokens == 32
    with pytest.raises(APIError) as info:
        parse_request("completion", json.dumps({"prompt": "x", "max_tokens": 33}), **opts)
    assert info.value.param == "max_tokens" and info.value.code == "integer_above_max_value"


def test_body_limit_helpers():
    check_content_length(None, 100)
    check_content_length("100", 100)
    check_content_length("not a number", 100)  # the streamed count still applies
    with pytest.raises(APIError) as info:
        check_content_length("101", 100)
    assert info.value.status == 413 and info.value.to_dict()["error"]["code"] == "request_too_large"
    assert body_too_large(5).status == 413


def test_errors_quoting_lone_surrogates_still_encode():
    # "\ud800" is a valid JSON string escape but not encodable as UTF-8: the 404 quotes the model name
    with pytest.raises(APIError) as info:
        parse_request("completion", '{"prompt": "x", "model": "\\ud800"}', known_models=["m"],
                      max_tokens_limit=8, default_max_tokens=8)
    assert info.value.status == 404
    json.dumps(info.value.to_dict(), ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("kind,required", [("completion", "prompt"), ("chat", "messages")])
def test_request_schema_documents_the_parser(kind, required):
    schema = request_schema(kind, "tiny", 64)
    assert required in schema["required"] and "$ref" not in json.dumps(schema)
    props = schema["properties"]
    assert props["max_tokens"]["maximum"] == 64 and props["max_tokens"]["minimum"] == 1
    assert props["model"]["anyOf"][0] == {"enum": ["tiny"]}
    assert props["threshold"]["exclusiveMinimum"] == 0 and props["threshold"]["maximum"] == 1
    if kind == "chat":
        message = props["messages"]["anyOf"][0]["items"]
        assert message["properties"]["role"]["enum"] == ["system", "user", "assistant", "tool"]  # tool: a call's result
        assert set(message["required"]) == {"role"}  # an assistant message with tool_calls may have no content


def test_a_hashed_key_authenticates_once_hashed_and_holds_no_key(monkeypatch):
    """``key_hash``: the config holds a salted hash; the key authenticates, another does not; each distinct
    presented key is hashed once (then remembered under its digest), and the plain entries still work beside."""
    hashed = hash_key(SECRET_A, iterations=1000)
    assert SECRET_A not in hashed and hashed != hash_key(SECRET_A, iterations=1000)  # a fresh salt each time
    calls = []
    of = KeyHash.of
    monkeypatch.setattr(KeyHash, "of", lambda self, token: calls.append(token) or of(self, token))
    keys = Keyring.from_specs([ApiKeySpec(name="alpha", key_hash=hashed, max_concurrent=3),
                               ApiKeySpec(name="bravo", key=SECRET_B)])
    assert keys.enabled and keys.authenticate(f"Bearer {SECRET_A}").name == "alpha"
    assert keys.authenticate(f"Bearer {SECRET_A}").max_concurrent == 3 and len(calls) == 1  # remembered
    assert keys.authenticate(f"Bearer {SECRET_B}").name == "bravo" and len(calls) == 1  # a plain entry matched
    for _ in range(2):
        with pytest.raises(APIError) as info:
            keys.authenticate("Bearer sk-wrong")
        assert_401(info.value, SECRET_A)
    assert len(calls) == 2  # a wrong key is hashed once too
    cfg = AppConfig(http={"api_keys": [{"name": "alpha", "key_hash": hashed}]})
    assert SECRET_A not in cfg.model_dump_json()
    with pytest.raises(ValueError, match="key_hash"):
        ApiKeySpec(name="alpha", key_hash=hashed).secret()


@pytest.mark.parametrize("bad", ["sha256$1$00$00", "pbkdf2_sha256$10$" + "00" * 16 + "$" + "00" * 32,
                                 "pbkdf2_sha256$5000$00$" + "00" * 32, "pbkdf2_sha256$5000$" + "00" * 16 + "$zz"])
def test_a_malformed_key_hash_is_refused_naming_the_field(bad):
    with pytest.raises(ValidationError, match="key_hash must read pbkdf2_sha256"):
        ApiKeySpec(name="alpha", key_hash=bad)
