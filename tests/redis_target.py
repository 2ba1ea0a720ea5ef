"""Which Redis the tests run against: one redis-server, or (`PAGEDQ_TEST_REDIS=cluster`, the cluster
pass of `make test`, with redis-py >= 6) a real local Redis Cluster of 3 masters and 3 replicas."""

from __future__ import annotations

import os

ON_CLUSTER = os.environ.get("PAGEDQ_TEST_REDIS", "node") == "cluster"
