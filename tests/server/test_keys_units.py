"""Keys file, key store, limiter and the access rules, without a server."""
from __future__ import annotations

import hashlib
import stat
import tomllib
from pathlib import Path

import pytest

from loraserve.keys import (OPEN, KeyFileError, Limits, Principal, append_key, entry_toml,
                            load_keys, parse_keys)
from loraserve.server.limits import LimitExceeded, Limiter
from loraserve.server.metrics import ServerMetrics
from loraserve.server.tenancy import (NOBODY, Tenancy, TenancyConfig, presented_key,
                                      scoped_prefixes, visible_ids)


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


GOOD = f"""
[keys.acme-prod]
sha256 = "{sha('k-acme')}"
role = "user"
tenants = ["acme"]
weight = 2
max_concurrent = 3
requests_per_second = 0.5
tokens_per_minute = 600

[keys."ops.root"]
sha256 = "{sha('k-root').upper()}"
role = "admin"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return path


def test_a_good_file(tmp_path: Path) -> None:
    store = load_keys(write(tmp_path, GOOD))
    acme = store.find("k-acme")
    assert acme is not None and acme.key_id == "acme-prod" and not acme.admin
    assert acme.tenants == ("acme",) and acme.weight == 2.0 and not acme.load
    assert acme.limits == Limits(3, 0.5, 600)
    root = store.find("k-root")
    assert root is not None and root.admin and root.tenants == ("*",)
    assert store.find("k-nope") is None and store.find("") is None


@pytest.mark.parametrize("text, reason", [
    ('[keys.a]\nsha256 = "abc"\nrole = "user"\ntenants = ["a"]', "64 hex digits"),
    (f'[keys.a]\nsha256 = "{"g" * 64}"\nrole = "user"\ntenants = ["a"]', "64 hex digits"),
    (f'[keys.a]\nsha256 = "{sha("x")}"\nrole = "root"\ntenants = ["a"]', "unknown role 'root'"),
    (f'[keys.a]\nsha256 = "{sha("x")}"\nrole = "user"\ntenants = ["a"]\nkey = "x"',
     "unknown field 'key'"),
    (f'[keys.a]\nsha256 = "{sha("x")}"\nrole = "user"\ntenants = ["a"]\nmax_concurrent = "3"',
     "max_concurrent must be an integer"),
    (f'[keys.a]\nsha256 = "{sha("x")}"\nrole = "user"', "needs tenants"),
    (f'[keys.a]\nsha256 = "{sha("x")}"\nrole = "user"\ntenants = []', "at least one tenant"),
    (f'[keys.a]\nsha256 = "{sha("x")}"\nrole = "user"\ntenants = ["a/b"]', "invalid tenant"),
    (f'[keys.a]\nsha256 = "{sha("x")}"\nrole = "user"\ntenants = ["a"]\nweight = 0',
     "weight must be"),
    (f'[keys.a]\nsha256 = "{sha("x")}"\nrole = "admin"\n[keys.b]\nsha256 = "{sha("x")}"\n'
     'role = "admin"', "same sha256"),
    ('[keys.a]\nsha256 = "abc\nrole = "user"', "malformed TOML"),
    ('[users.a]\nrole = "user"', "unknown table 'users'"),
    ('[keys.a]\nrole = "user"\ntenants = ["a"]', "missing field 'sha256'"),
])
def test_a_bad_file_is_refused_with_a_one_line_reason(tmp_path: Path, text: str,
                                                      reason: str) -> None:
    with pytest.raises(KeyFileError) as err:
        load_keys(write(tmp_path, text))
    message = str(err.value)
    assert reason in message and "\n" not in message and "keys.toml" in message


def test_append_key_writes_only_the_hash_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "new" / "keys.toml"
    path.parent.mkdir()
    p = Principal("acme-ci", admin=False, tenants=("acme", "beta"), load=True, weight=0.5,
                  limits=Limits(max_concurrent=2, requests_per_second=1.5))
    key = append_key(path, p)
    assert key.startswith("tml-") and len(key) > 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert key not in path.read_text() and sha(key) in path.read_text()
    second = append_key(path, Principal("root", admin=True))
    store = load_keys(path)
    assert store.find(key) == p and store.find(second).admin
    with pytest.raises(KeyFileError, match="exists"):
        append_key(path, Principal("root", admin=True))
    with pytest.raises(KeyFileError, match="key id"):
        append_key(path, Principal("bad id", admin=True))
    assert len(load_keys(path)) == 2  # nothing half-written


def test_entry_toml_round_trips() -> None:
    p = Principal("x", admin=False, tenants=("a",), limits=Limits(tokens_per_minute=10))
    store = parse_keys(tomllib.loads(entry_toml(p, sha("k"))))
    assert store.find("k") == p


def test_visibility_rules() -> None:
    user = Principal("u", admin=False, tenants=("acme", "ac"))
    assert user.sees("acme") and not user.sees("beta") and not user.may_control("acme")
    assert Principal("l", admin=False, tenants=("acme",), load=True).may_control("acme")
    assert not Principal("l", admin=False, tenants=("acme",), load=True).may_control("beta")
    assert OPEN.sees("anything") and OPEN.may_control("anything") and not NOBODY.sees("x")
    assert visible_ids(user, ["org/base", "acme/a", "beta/b", "ac/c"], "org/base") == \
        ["org/base", "acme/a", "ac/c"]
    assert scoped_prefixes(user, "") == ["ac/", "acme/"]
    assert scoped_prefixes(user, "acm") == ["acme/"]
    assert scoped_prefixes(user, "acme/sup") == ["acme/sup"]
    assert scoped_prefixes(user, "beta/") == []
    assert scoped_prefixes(OPEN, "beta/") == ["beta/"]


def test_presented_key() -> None:
    assert presented_key([(b"authorization", b"Bearer  k1 ")]) == "k1"
    assert presented_key([(b"authorization", b"bearer k1")]) == "k1"
    assert presented_key([(b"x-api-key", b"k2")]) == "k2"
    assert presented_key([(b"authorization", b"Basic abc"), (b"x-api-key", b"k2")]) == "k2"
    assert presented_key([]) is None


def test_who_may_reach_what(tmp_path: Path) -> None:
    tenancy = Tenancy(TenancyConfig(api_key="api", keys_file=write(tmp_path, GOOD),
                                    metrics_key="mk"), ServerMetrics())

    def status(path: str, key: str | None, method: str = "GET") -> int:
        try:
            tenancy.caller(path, method, key)
        except Exception as exc:
            return exc.status  # type: ignore[attr-defined]
        return 200

    assert [status("/v1/models", k) for k in (None, "bad", "k-acme", "k-root", "api", "mk")] == \
        [401, 401, 200, 200, 200, 401]
    assert [status("/metrics", k) for k in (None, "bad", "k-acme", "k-root", "api", "mk")] == \
        [401, 401, 403, 200, 200, 200]
    assert [status("/admin/reload-keys", k, "POST") for k in (None, "k-acme", "k-root")] == \
        [401, 403, 200]
    assert status("/health", None) == status("/ready", None) == 200
    assert status("/v1/models", None, "OPTIONS") == 200
    legacy = Tenancy(TenancyConfig(api_key="api"), ServerMetrics())
    assert legacy.caller("/metrics", "GET", None) is NOBODY  # as before tenants: open
    assert Tenancy(TenancyConfig(), ServerMetrics()).caller("/admin/x", "POST", None) is OPEN


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_limiter_buckets_and_concurrency_per_key_and_tenant() -> None:
    clock = Clock()
    limiter = Limiter(clock)
    p = Principal("k", admin=False, tenants=("a", "b"),
                  limits=Limits(max_concurrent=2, requests_per_second=1, tokens_per_minute=60))
    first = limiter.admit(p, "a", 1, 10)
    with pytest.raises(LimitExceeded) as err:  # the second request within the second
        limiter.admit(p, "a", 1, 10)
    assert err.value.limit == "requests_per_second" and err.value.headers["Retry-After"] == "1"
    assert err.value.body()["error"]["type"] == "rate_limit_error"
    limiter.admit(p, "b", 1, 10)  # another tenant: its own state
    clock.now += 1
    with pytest.raises(LimitExceeded) as err:  # 2 in flight would be 1 + 2 > 2
        limiter.admit(p, "a", 2, 10)
    assert err.value.limit == "max_concurrent"
    first.release()
    first.release()  # idempotent
    second = limiter.admit(p, "a", 2, 40)  # 50 of 60 tokens used
    second.release()
    clock.now += 1
    with pytest.raises(LimitExceeded) as err:
        limiter.admit(p, "a", 1, 30)  # 12 tokens there (10 + 1 s x 1/s ... capped), 30 asked
    assert err.value.limit == "tokens_per_minute"
    assert int(err.value.headers["Retry-After"]) >= 10
    with pytest.raises(LimitExceeded) as err:
        limiter.admit(p, "a", 1, 61)  # never fits
    assert err.value.headers["Retry-After"] == "60"
    assert limiter.admit(Principal("free", admin=False, tenants=("a",)), "a", 100, 10**9)


def test_new_limits_on_reload_keep_the_sequences_in_flight() -> None:
    clock = Clock()
    limiter = Limiter(clock)
    old = Principal("k", admin=False, tenants=("a",), limits=Limits(max_concurrent=2))
    lease = limiter.admit(old, "a", 2, 1)
    new = Principal("k", admin=False, tenants=("a",), limits=Limits(max_concurrent=3))
    limiter.admit(new, "a", 1, 1)
    with pytest.raises(LimitExceeded):
        limiter.admit(new, "a", 1, 1)
    lease.release()
    limiter.admit(new, "a", 2, 1)
