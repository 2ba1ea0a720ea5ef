"""Lua scripts the worker runs atomically on Redis.

Ownership fencing: a worker only writes a request's events, or acks its entry, while the entry is
still pending under its own consumer name. If a worker was presumed dead (a long pause, a network
partition) and another worker reclaimed its entries, the first worker's late writes are refused
instead of interleaving with the new owner's, so a reader never sees a token twice.
"""

from __future__ import annotations

# KEYS: per request i, its lane stream (2i-1) and response stream (2i).
# ARGV: group, consumer, ttl ms, then per request: entry id, stream cap, final (0/1), event count,
# the events. Returns the 1-based indices of requests this consumer no longer owns (nothing written).
PUBLISH = """
local group, consumer, ttl = ARGV[1], ARGV[2], ARGV[3]
local lost = {}
local a = 4
for i = 1, #KEYS / 2 do
  local lane, resp = KEYS[2 * i - 1], KEYS[2 * i]
  local entry, cap, final, n = ARGV[a], ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3])
  a = a + 4
  local p = redis.call('XPENDING', lane, group, entry, entry, 1)
  if p[1] == nil or p[1][2] ~= consumer then
    table.insert(lost, i)
  else
    for j = 0, n - 1 do
      redis.call('XADD', resp, 'MAXLEN', '~', cap, '*', 'e', ARGV[a + j])
    end
    if n > 0 then redis.call('PEXPIRE', resp, ttl) end
    if final == '1' then
      redis.call('XACK', lane, group, entry)
      redis.call('XDEL', lane, entry)
    end
  end
  a = a + n
end
return lost
"""

# KEYS[1]: a lane stream. ARGV: group, consumer, idle ms to set, entry ids.
# For each entry still owned by `consumer`: XCLAIM it to itself with that idle time, without counting
# a delivery. idle 0 = renew ownership (not reclaimable for a full timeout); a huge idle = hand it
# over (any worker's next XAUTOCLAIM takes it). Returns the ids no longer owned.
CLAIM_OWN = """
local group, consumer, idle = ARGV[1], ARGV[2], ARGV[3]
local lost = {}
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], group, ARGV[i], ARGV[i], 1)
  if p[1] ~= nil and p[1][2] == consumer then
    redis.call('XCLAIM', KEYS[1], group, consumer, 0, ARGV[i], 'IDLE', idle, 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""
