"""The Redis contract between producers and workers, in one place.

- `keys`: every key name and stream entry field, and the hash-tag layout (a model's keys share one
  hash slot, a request's keys another: the same steps run on one node, through Sentinel and on Redis
  Cluster).
- `pagedq.lua` + `scripts`: every atomic step (enqueue, acquire, publish, ack, drop, claim_own,
  recount), their arguments and replies; `steps` runs them (EVALSHA; a step's script is loaded on
  NOSCRIPT).
- `connection` and `cluster`: every client pagedq builds from a URL (``redis://``, ``rediss://``,
  ``unix://``, ``redis+sentinel://``, ``redis+cluster://``, ``rediss+cluster://``).
- `migrate`: moving a single node from the layout before hash tags (`pagedq migrate`).
- `producer_sdk.protocol`: what the entries hold (msgpack request and event Structs).

Request entry
    ``XADD <keys.lane_stream(model, lane)> * id <request_id> t <tenant> r <retention ms> d <msgpack
    GenerateRequest>`` through the `enqueue` step (`r`: how long the answer is kept after its final
    event, the producer's `result_ttl_s`; absent from older SDKs, whose entries get the worker's own).
    The producer first reads the tenant's quota (``HMGET keys.tenant_quota(tenant)`` of
    `scripts.QUOTA_FIELDS`) and passes it as arguments. The step answers
    ``duplicate`` while ``keys.submitted_marker(model, id)`` exists (a resubmit follows the existing
    request), refuses with ``full`` when the model's lanes together hold `limit` entries (the SDK's
    limit, else the ``max_queue_len`` a worker put in ``keys.config(model)``, else
    `scripts.DEFAULT_MAX_QUEUE_LEN`), with ``limited`` when the tenant is over its quota on this model
    (max_queued, counted in ``keys.tenant_queued(model)``; requests_per_minute, counted in
    ``keys.tenant_rate(model, tenant)``; tokens_per_minute, counted in ``keys.tenant_tokens(model,
    tenant)`` by the worker's `ack`), else adds the entry, sets the marker and counts it for its tenant.
    Queue length = XLEN of the lanes: a worker XDELs an entry once its request's final event is stored,
    in the `ack` step, which also takes it off its tenant's count (only when that XDEL removed it).

Lease ``keys.lease(id)``
    Which delivery of the request's entry may write its response stream: epoch ``<entry id>:<deliveries>``
    (`scripts.lease_epoch`) and owner (the consumer name). A worker takes it with `acquire` before it
    reads the response stream; a newer epoch wins (a later delivery of the same entry, or a newer entry
    of the same request id), so an earlier attempt's writes are refused from then on.

Response stream ``keys.response_stream(id)``
    One entry per event: ``e`` = msgpack event, ``s`` = its seq (0, 1, 2, ... per request, contiguous
    across worker crashes). Written only by the `publish` step: fenced on the lease (epoch and owner;
    ``lost`` when another attempt holds it or it is gone) and idempotent by seq (a repeated seq is
    skipped, a gap refused with ``gap``). While the request runs the stream and the lease live
    `live TTL` past their last write; a final batch sets the request's retention on both, and the same
    step gives the gateway's record ``keys.gateway_record(id)`` the stream's TTL. The `ack` of
    the entry is a separate step, run after the final event is stored (the stream and the entry live in
    different hash slots), so a reader may see the final event a round trip before the entry is acked. A reader
    follows with ``XREAD BLOCK`` from ``0-0``.

Dead letters ``keys.dead_letters(model)``
    id, code, reason, lane, entry, worker, the first bytes of the payload with its length and SHA-1;
    trimmed by age (MINID). Written by `ack` (after an ``Error`` event) or by `drop` (an entry refused
    without an event, such as one whose request id cannot be read; fenced on its ownership in the
    consumer group), only by the call that deletes the entry.

Cancel
    ``SET keys.cancel_flag(id) 1 EX <ttl>``, then ``PUBLISH keys.control_channel(model) <msgpack
    ControlMessage(type="cancel", request_id=id)>``: two commands, not one pipeline.

Workers
    Consumer group ``keys.group(model)`` on every lane. Heartbeats: ``ZADD keys.heartbeats(model)
    <now_ms> <worker>`` and ``SET keys.worker_state(model, worker) <JSON WorkerState> PX <3 beats>``.
    Ownership: `claim_own` renews in-flight entries (idle 0) or hands them over (idle "forever");
    entries idle past the claim timeout are taken with XAUTOCLAIM, their lease taken with `acquire`,
    and resumed from their stream.
"""
