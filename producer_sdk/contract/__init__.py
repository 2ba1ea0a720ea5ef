"""The Redis contract between producers and workers, in one place.

- `keys`: every key name and stream entry field.
- `pagedq.lua` + `scripts`: every atomic step (enqueue, publish, drop, claim_own, recount), their
  arguments and replies.
- `producer_sdk.protocol`: what the entries hold (msgpack request and event Structs).

Request entry
    ``XADD <keys.lane_stream(model, lane)> * id <request_id> t <tenant> d <msgpack GenerateRequest>``
    through the `enqueue` step, which answers ``duplicate`` while ``keys.submitted_marker(id)``
    exists (a resubmit follows the existing request), refuses with ``full`` when the model's lanes
    together hold `limit` entries (the SDK's limit, else the ``max_queue_len`` a worker put in
    ``keys.config(model)``, else `scripts.DEFAULT_MAX_QUEUE_LEN`), with ``limited`` when the tenant
    is over its quota (``keys.tenant_quota``: max_queued per model, counted in
    ``keys.tenant_queued(model)``; requests_per_minute, counted in ``keys.tenant_rate``;
    tokens_per_minute, counted in ``keys.tenant_tokens`` by the final `publish`), else adds the
    entry, sets the marker and counts it for its tenant.
    Queue length = XLEN of the lanes: a worker XDELs an entry once its request finished, in the
    step that also takes it off its tenant's count (only when that XDEL removed it).

Response stream ``keys.response_stream(id)``
    One entry per event: ``e`` = msgpack event, ``s`` = its seq (0, 1, 2, ... per request, contiguous
    across worker crashes). Written only by the `publish` step: fenced on the entry's ownership and
    idempotent by seq (a repeated seq is skipped, a gap refused). While the request runs the stream
    lives `live TTL` past its last write; the final event sets the shorter result TTL. A reader
    follows with ``XREAD BLOCK`` from ``0-0``.

Dead letters ``keys.dead_letters(model)``
    id, code, reason, lane, entry, worker, the first bytes of the payload with its length and SHA-1;
    trimmed by age (MINID).

Cancel
    ``SET keys.cancel_flag(id) 1 EX <ttl>`` then ``PUBLISH keys.control_channel(model) <msgpack
    ControlMessage(type="cancel", request_id=id)>``.

Workers
    Consumer group ``keys.group(model)`` on every lane. Heartbeats: ``ZADD keys.heartbeats(model)
    <now_ms> <worker>`` and ``SET keys.worker_state(model, worker) <JSON WorkerState> PX <3 beats>``.
    Ownership: `claim_own` renews in-flight entries (idle 0) or hands them over (idle "forever");
    entries idle past the claim timeout are taken with XAUTOCLAIM and resumed from their stream.
"""
