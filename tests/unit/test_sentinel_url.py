"""Sentinel URLs: the parser, redaction, the clients built from them (no server needed), arq's settings."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio

from producer_sdk.contract.connection import (
    SentinelURL,
    client_options,
    connect,
    is_sentinel_url,
    parse_sentinel_url,
    redact_url,
    redis_from_url,
)


def test_one_sentinel_default_port_and_db():
    assert parse_sentinel_url("redis+sentinel://sentinel/mymaster") == SentinelURL([("sentinel", 26379)], "mymaster")


def test_several_sentinels_credentials_db_and_sentinel_auth():
    url = "redis+sentinel://agent:p%40ss@h1:26379,h2:26380,[::1]:26381,[fe80::1]/svc-a/3?sentinel_password=s3&sentinel_username=sen"
    assert parse_sentinel_url(url) == SentinelURL(
        sentinels=[("h1", 26379), ("h2", 26380), ("::1", 26381), ("fe80::1", 26379)],
        service_name="svc-a",
        db=3,
        username="agent",
        password="p@ss",
        sentinel_username="sen",
        sentinel_password="s3",
    )


def test_password_only_as_requirepass():
    t = parse_sentinel_url("redis+sentinel://:secret@h1/mymaster/0")
    assert (t.username, t.password) == (None, "secret")


def test_scheme_is_case_insensitive_and_others_are_not_sentinel():
    assert is_sentinel_url("REDIS+SENTINEL://h/m")
    assert not is_sentinel_url("redis://h:6379/0")
    assert not is_sentinel_url("rediss://h:6380/0")


@pytest.mark.parametrize(
    "url, problem",
    [
        ("redis+sentinel://h1:26379", "service_name"),
        ("redis+sentinel://h1:26379/", "service_name"),
        ("redis+sentinel://h1/m/0/extra", "service_name"),
        ("redis+sentinel://h1/m/zero", "number"),
        ("redis+sentinel://h1:port/m", "port"),
        ("redis+sentinel://h1,,h2/m", "host"),
        ("redis+sentinel://h1/m?socket_timeout=3", "unknown option"),
        ("redis://h1/0", r"not a redis\+sentinel"),
    ],
)
def test_bad_urls_say_what_is_wrong(url, problem):
    with pytest.raises(ValueError, match=problem):
        parse_sentinel_url(url)


def test_redaction_hides_every_password():
    assert redact_url("redis://u:pw@h:6379/0") == "redis://u:***@h:6379/0"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert (
        redact_url("redis+sentinel://u:pw@h1,h2/m/0?sentinel_password=x&sentinel_username=s")
        == "redis+sentinel://u:***@h1,h2/m/0?sentinel_password=***&sentinel_username=s"
    )


@pytest.mark.parametrize("asyncio", [False, True], ids=["sync", "asyncio"])
def test_sentinel_client_gets_the_contract_options(asyncio):
    """The primary's connections get pagedq's settings, the URL's credentials and db; the Sentinels'
    connections get their own credentials and short timeouts. Building the client connects to nothing."""
    url = "redis+sentinel://agent:pw@h1:26379,h2/mymaster/2?sentinel_password=spw"
    client = connect(url, asyncio=asyncio, socket_timeout=12.0, max_connections=7)
    cls = redis.asyncio.Redis if asyncio else redis.Redis
    assert isinstance(client, cls)
    pool = client.connection_pool
    kw = pool.connection_kwargs
    expected = client_options(asyncio=asyncio, socket_timeout=12.0)
    for key in ("socket_timeout", "socket_connect_timeout", "socket_keepalive", "health_check_interval"):
        assert kw[key] == expected[key]
    assert kw["retry"]._retries == 0 and kw["decode_responses"] is False
    assert (kw["db"], kw["username"], kw["password"]) == (2, "agent", "pw")
    assert pool.max_connections == 7 and pool.service_name == "mymaster" and pool.is_master
    nodes = client.sentinel.sentinels
    assert [
        (n.connection_pool.connection_kwargs["host"], n.connection_pool.connection_kwargs["port"]) for n in nodes
    ] == [
        ("h1", 26379),
        ("h2", 26379),
    ]
    node_kw = nodes[0].connection_pool.connection_kwargs
    assert (node_kw["password"], node_kw["username"], node_kw["socket_timeout"]) == ("spw", None, 5.0)


def test_plain_urls_still_go_to_redis_py():
    client = redis_from_url("redis://u:pw@h:6390/4", asyncio=False, socket_timeout=3)
    kw = client.connection_pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"], kw["password"], kw["socket_timeout"]) == ("h", 6390, 4, "pw", 3)
    client.close()


def test_arq_settings_for_a_sentinel_url():
    pytest.importorskip("arq")
    from producer_sdk.arq_bridge import redis_settings

    s = redis_settings("redis+sentinel://u:pw@h1:26379,h2:26380/svc/5")
    assert (s.host, s.sentinel, s.sentinel_master, s.database, s.username, s.password) == (
        [("h1", 26379), ("h2", 26380)],
        True,
        "svc",
        5,
        "u",
        "pw",
    )
    assert redis_settings("redis://h:6379/1").host == "h"
    with pytest.raises(ValueError, match="Sentinels"):
        redis_settings("redis+sentinel://h1/svc?sentinel_password=x")


def test_db_from_the_url_else_the_option_else_zero():
    def db(url: str, **kw) -> int:
        client = connect(url, asyncio=False, socket_timeout=1, **kw)
        try:
            return client.connection_pool.connection_kwargs.get("db", 0)
        finally:
            client.close()

    assert db("redis+sentinel://h/m/2", db=4) == 2
    assert db("redis+sentinel://h/m", db=4) == 4
    assert db("redis+sentinel://h/m") == 0
