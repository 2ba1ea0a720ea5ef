"""redis+cluster:// URLs, and the cluster client built from one (no server needed)."""

from __future__ import annotations

import pytest
import redis

from producer_sdk.contract.cluster import ClusterURL, is_cluster, is_cluster_url, parse_cluster_url
from producer_sdk.contract.connection import connect, redact_url
from producer_sdk.validation import validate_model_name


def test_cluster_urls_parse():
    assert parse_cluster_url("redis+cluster://h1:7000,h2,[::1]:7002") == ClusterURL(
        nodes=[("h1", 7000), ("h2", 6379), ("::1", 7002)]
    )
    got = parse_cluster_url("rediss+cluster://user:p%40ss@h1:7000/0")
    assert (got.username, got.password, got.ssl, got.nodes) == ("user", "p@ss", True, [("h1", 7000)])
    assert is_cluster_url("REDIS+CLUSTER://h") and not is_cluster_url("redis://h") and not is_cluster_url("x")


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("redis+cluster://h1/3", "database 0 only"),
        ("redis+cluster://h1?read_from_replicas=1", "no \\?options"),
        ("redis+cluster://:7000", "host\\[:port\\]"),
        ("redis+cluster://h1:port", "bad port"),
        ("redis://h1", "not a redis\\+cluster"),
    ],
)
def test_bad_cluster_urls_say_why(url, error):
    with pytest.raises(ValueError, match=error):
        parse_cluster_url(url)


def test_a_bad_port_error_hides_the_password():
    with pytest.raises(ValueError) as info:
        parse_cluster_url("redis+cluster://u:secret@h1:port")
    assert "secret" not in str(info.value)
    assert redact_url("redis+cluster://u:secret@h1,h2") == "redis+cluster://u:***@h1,h2"


def test_the_client_of_a_cluster_url():
    """redis-py 6 and newer: a cluster client that connects lazily. Older: refused, with the reason."""
    if int(redis.__version__.split(".")[0]) < 6:
        with pytest.raises(RuntimeError, match="redis-py >= 6"):
            connect("redis+cluster://127.0.0.1:1", asyncio=True, socket_timeout=5)
        return
    for flavour in (True, False):
        if not flavour:
            with pytest.raises(redis.exceptions.RedisClusterException):  # the sync client connects at once
                connect("redis+cluster://127.0.0.1:1", asyncio=False, socket_timeout=5, connect_timeout=0.5)
            continue
        client = connect("redis+cluster://u:pw@127.0.0.1:1", asyncio=True, socket_timeout=7)
        assert is_cluster(client)


@pytest.mark.parametrize("name", ["default", "meta-llama/Llama-3.1-8B", "qwen2.5:7b", "a@b+c=d"])
def test_model_names_that_fit_a_hash_tag(name):
    assert validate_model_name(name) == name


@pytest.mark.parametrize("name", ["", "a{b}", "two words", "star*", "x" * 129, None])
def test_model_names_that_do_not(name):
    with pytest.raises(ValueError, match="model name must match"):
        validate_model_name(name)
