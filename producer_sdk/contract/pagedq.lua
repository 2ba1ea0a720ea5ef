-- pagedq's atomic steps on Redis: one library, one local function per step.
-- Every script a client runs is this library followed by `return <step>(KEYS, ARGV)`
-- (producer_sdk/contract/scripts.py), so all of the atomic logic lives in this one file.
--
-- Each step touches the keys of one hash slot only, so the same steps run on Redis Cluster:
-- `enqueue`, `ack`, `drop`, `claim_own` and `recount` a model's keys (pagedq:{model}:*), `acquire`
-- and `publish` a request's keys (pagedq:resp:{id}, pagedq:lease:{id}).
--
-- Response streams hold one event per entry: field `e` = the msgpack event, `s` = its seq.
-- Writes are idempotent by seq: an event whose seq is not above the last stored one is skipped,
-- and a batch that would leave a gap is refused. A retried call (its reply lost on the way back)
-- therefore never writes an event twice. Writes are fenced by the request's lease: only the attempt
-- holding it (epoch and owner) writes; a later delivery of the entry takes the lease over.

-- The seq of the last event in a response stream, -1 when it holds none.
local function last_seq(resp)
  local top = redis.call('XREVRANGE', resp, '+', '-', 'COUNT', 1)
  if #top == 0 then return -1 end
  local fields = top[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 's' then return tonumber(fields[i + 1]) end
  end
  for i = 1, #fields, 2 do  -- an entry written before `s` existed
    if fields[i] == 'e' then return tonumber(cmsgpack.unpack(fields[i + 1])['seq']) end
  end
  return -1
end

-- Whether `consumer` still owns the entry (it is pending under its name). A lane or group that is
-- gone (Redis lost its data) owns nothing.
local function owns(lane, group, consumer, entry)
  local p = redis.pcall('XPENDING', lane, group, entry, entry, 1)
  if type(p) ~= 'table' or p.err then return false end
  return p[1] ~= nil and p[1][2] == consumer
end

-- The tenant field `t` of an entry, nil when the entry is gone or has none (an older SDK's).
local function entry_tenant(lane, entry)
  local got = redis.call('XRANGE', lane, entry, entry)
  if #got == 0 then return nil end
  local fields = got[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 't' then return fields[i + 1] end
  end
  return nil
end

-- Ack and delete an entry; with dead-letter fields, copy it to the dead-letter stream. The entry's
-- tenant count (hash `counts`) goes down, and the dead letter is written, only when this call is
-- the one that deletes the entry, so a repeated call never counts or letters it twice; a broken
-- count never blocks the ack.
-- ARGV from `at`: min id of the dead-letter stream (trims letters older than the retention), then
-- field/value pairs (none: no dead letter).
-- Returns whether this call deleted the entry, and the entry's tenant (nil without `t`).
local function retire(lane, dead, counts, group, entry, argv, at)
  redis.call('XACK', lane, group, entry)
  local tenant = entry_tenant(lane, entry)
  local deleted = redis.call('XDEL', lane, entry) == 1
  if not deleted then return false, nil end
  if tenant then
    local left = redis.pcall('HINCRBY', counts, tenant, -1)
    if type(left) == 'number' and left <= 0 then redis.pcall('HDEL', counts, tenant) end
  end
  if #argv > at then
    local fields = {}
    for i = at + 1, #argv do fields[#fields + 1] = argv[i] end
    redis.call('XADD', dead, 'MINID', '~', argv[at], '*', unpack(fields))
  end
  return true, tenant
end

-- Add `n` to a fixed-window counter hash (fields w: window number, n: count) and expire it one
-- window after the window ends.
local function add_in_window(key, n, now, length)
  local window = math.floor(now / length)
  local got = redis.call('HMGET', key, 'w', 'n')
  local used = 0
  if tonumber(got[1] or '') == window then used = tonumber(got[2] or '') or 0 end
  redis.call('HSET', key, 'w', window, 'n', used + n)
  redis.call('PEXPIRE', key, (window + 1) * length - now + length)
end

-- Now in unix ms: ARGV's when given (> 0, tests), else the Redis server's clock. `soft`: 0 instead
-- of an error when TIME is refused (a worker's ACL without +time must not block an ack).
local function now_ms(given, soft)
  local now = tonumber(given) or 0
  if now > 0 then return now end
  if redis.replicate_commands then redis.replicate_commands() end  -- Redis < 7: TIME before writes
  local t
  if soft then t = redis.pcall('TIME') else t = redis.call('TIME') end
  if type(t) ~= 'table' or t.err then return 0 end
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A lease epoch "<entry ms>-<entry seq>:<deliveries>" as numbers; nil when it is not one.
local function epoch_parts(epoch)
  local ms, sq, d = string.match(epoch or '', '^(%d+)%-(%d+):(%d+)$')
  if ms == nil then return nil end
  return {tonumber(ms), tonumber(sq), tonumber(d)}
end

-- -1, 0 or 1 as epoch `a` is older than, the same as or newer than `b`: a newer entry (a resubmit)
-- wins over an older one, then more deliveries of the same entry over fewer.
local function epoch_cmp(a, b)
  for i = 1, 3 do
    if a[i] < b[i] then return -1 end
    if a[i] > b[i] then return 1 end
  end
  return 0
end

-- Submit. KEYS: target lane, submitted marker, config hash, tenant counts of the model, the tenant's
-- rate window hash, the tenant's token window hash, then every lane of the model (all in the
-- model's slot).
-- ARGV: request id, payload, queue limit (<= 0: the config hash's max_queue_len, else the default
-- in ARGV[5]; <= 0 there too: unlimited), marker TTL ms, default limit, tenant, now ms (<= 0: Redis
-- TIME), rate window ms, retry-after ms to answer when the tenant's max_queued is reached, then the
-- tenant's quota as the producer read it: max_queued, requests_per_minute, tokens_per_minute (0:
-- unlimited), then the retention ms (field `r` of the entry: how long the answer is kept after its
-- final event; absent or <= 0: no `r`, the worker's own).
-- The quota, per model: at most max_queued outstanding entries, at most requests_per_minute entries
-- per window (fixed windows: now // window), and no new entry once the tokens of the tenant's
-- requests finished in the current window (counted by `ack`) reach tokens_per_minute. Only an
-- accepted request counts.
-- Reply: {'duplicate'} | {'full', queued, limit} | {'limited', quota name, used, limit, retry-after ms}
-- | {'ok', entry id}.
local function enqueue(KEYS, ARGV)
  if redis.call('EXISTS', KEYS[2]) == 1 then return {'duplicate'} end
  local limit = tonumber(ARGV[3]) or 0
  if limit <= 0 then
    limit = tonumber(redis.call('HGET', KEYS[3], 'max_queue_len') or '') or tonumber(ARGV[5]) or 0
  end
  if limit > 0 then
    local queued = 0
    for i = 7, #KEYS do queued = queued + redis.call('XLEN', KEYS[i]) end
    if queued >= limit then return {'full', queued, limit} end
  end
  local tenant = ARGV[6]
  local max_queued, per_window = tonumber(ARGV[10]) or 0, tonumber(ARGV[11]) or 0
  local tokens_per_window = tonumber(ARGV[12]) or 0
  local mine = tonumber(redis.call('HGET', KEYS[4], tenant) or '') or 0
  if max_queued > 0 and mine >= max_queued then
    return {'limited', 'max_queued', mine, max_queued, tonumber(ARGV[9])}
  end
  local window, used, now, length = 0, 0, 0, tonumber(ARGV[8])
  if per_window > 0 or tokens_per_window > 0 then
    now = now_ms(ARGV[7])
    window = math.floor(now / length)
  end
  if per_window > 0 then
    local rate = redis.call('HMGET', KEYS[5], 'w', 'n')
    if tonumber(rate[1] or '') == window then used = tonumber(rate[2] or '') or 0 end
    if used >= per_window then
      return {'limited', 'requests_per_minute', used, per_window, (window + 1) * length - now}
    end
  end
  if tokens_per_window > 0 then
    local spent = redis.call('HMGET', KEYS[6], 'w', 'n')
    local tokens = 0
    if tonumber(spent[1] or '') == window then tokens = tonumber(spent[2] or '') or 0 end
    if tokens >= tokens_per_window then
      return {'limited', 'tokens_per_minute', tokens, tokens_per_window, (window + 1) * length - now}
    end
  end
  local entry
  local retention = tonumber(ARGV[13] or '') or 0
  if retention > 0 then
    entry = redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 't', tenant, 'r', retention, 'd', ARGV[2])
  else
    entry = redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 't', tenant, 'd', ARGV[2])
  end
  redis.call('SET', KEYS[2], 1, 'PX', ARGV[4])
  redis.call('HINCRBY', KEYS[4], tenant, 1)
  if per_window > 0 then add_in_window(KEYS[5], 1, now, length) end
  return {'ok', entry}
end

-- Take a request's lease for one delivery of its entry, before reading what earlier attempts wrote.
-- KEYS: the request's lease. ARGV: owner (consumer), epoch, TTL ms.
-- Taken when it is free, held by an older epoch, or already this owner's at this epoch (a retried
-- call). Reply: {'ok'} | {'stale', epoch, owner} (a newer delivery, or another owner of this one,
-- holds it: nothing changed).
local function acquire(KEYS, ARGV)
  local owner, epoch = ARGV[1], ARGV[2]
  local mine = epoch_parts(epoch)
  if mine == nil then return redis.error_reply('ERR pagedq: bad lease epoch ' .. tostring(epoch)) end
  local held = redis.call('HMGET', KEYS[1], 'e', 'o')
  if held[1] then
    local theirs = epoch_parts(held[1])
    local c = 1
    if theirs ~= nil then c = epoch_cmp(mine, theirs) end
    if c < 0 or (c == 0 and held[2] ~= owner) then return {'stale', held[1], held[2] or ''} end
  end
  redis.call('HSET', KEYS[1], 'e', epoch, 'o', owner)
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'ok'}
end

-- Write one request's events, fenced on its lease and idempotent by seq.
-- KEYS: response stream, lease, and optionally the gateway's record. ARGV: owner, epoch, stream cap
-- (0: none), live TTL ms, result TTL ms, first seq, final (0/1), event count n, the n events.
-- While the request runs, the stream and the lease live `live TTL` past the last write; a final
-- batch sets the result TTL (the request's retention) on both (the lease keeps fencing stale writers
-- until the stream goes). A gateway's record, where there is one, gets the same TTL in the same
-- step, so it expires together with the stream.
-- Reply: {status, last seq stored}; status: 'ok' written (or already there), 'lost' the lease is
-- another attempt's, or gone (nothing written), 'gap' the stream ends before first seq - 1
-- (nothing written).
local function publish(KEYS, ARGV)
  local resp, lease = KEYS[1], KEYS[2]
  local cap, first, final, n = tonumber(ARGV[3]), tonumber(ARGV[6]), ARGV[7] == '1', tonumber(ARGV[8])
  local now = now_ms(0, true)  -- before any write (TIME): one absolute expiry for every key below
  local last = last_seq(resp)
  local held = redis.call('HMGET', lease, 'e', 'o')
  if held[1] ~= ARGV[2] or held[2] ~= ARGV[1] then return {'lost', last} end
  if first > last + 1 then return {'gap', last} end
  for j = 0, n - 1 do
    local seq = first + j
    if seq > last then
      if cap > 0 then
        redis.call('XADD', resp, 'MAXLEN', '~', cap, '*', 'e', ARGV[8 + j + 1], 's', seq)
      else
        redis.call('XADD', resp, '*', 'e', ARGV[8 + j + 1], 's', seq)
      end
    end
  end
  local ttl = tonumber(ARGV[4])
  if final then ttl = tonumber(ARGV[5]) end
  -- PEXPIREAT to one instant (each PEXPIRE would read the clock anew); PEXPIRE if TIME was refused.
  local cmd, at = 'PEXPIREAT', now + ttl
  if now <= 0 then cmd, at = 'PEXPIRE', ttl end
  if redis.call('EXISTS', resp) == 1 then redis.call(cmd, resp, at) end
  redis.call(cmd, lease, at)
  if KEYS[3] then redis.call(cmd, KEYS[3], at) end  -- a no-op where there is no record
  return {'ok', math.max(last, first + n - 1)}
end

-- Retire a request whose final event is in its response stream: ack and delete its entry (with an
-- optional dead letter), let its submitted marker expire with the result, and add its tokens to its
-- tenant's token window. Idempotent: only the call that deletes the entry counts (and only when the
-- entry's `t` is the tenant given: an entry without `t` counts nothing), so a retried call never
-- counts twice. Not fenced: a final event is only ever written by the lease holder.
-- KEYS: lane stream, dead-letter stream, tenant counts of the model, submitted marker, the tenant's
-- token window hash. ARGV: group, entry id, result TTL ms, tenant, tokens (0: none), now ms (<= 0:
-- Redis TIME), window ms, then the dead-letter part of `retire`.
-- Reply: 1 when this call deleted the entry, else 0.
local function ack(KEYS, ARGV)
  local tokens, now = tonumber(ARGV[5]) or 0, 0
  if tokens > 0 then now = now_ms(ARGV[6], true) end  -- before any write (TIME); 0 if refused: not counted
  local deleted, tenant = retire(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV, 8)
  if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('PEXPIRE', KEYS[4], ARGV[3]) end
  if deleted and now > 0 and tenant == ARGV[4] then add_in_window(KEYS[5], tokens, now, tonumber(ARGV[7])) end
  if deleted then return 1 end
  return 0
end

-- Refuse an entry that has no addressable response stream: ack, delete, dead-letter; fenced on the
-- entry's ownership. KEYS: lane stream, dead-letter stream, tenant counts of the model. ARGV:
-- group, consumer, entry id, then `retire`'s part.
-- Reply: 'ok' | 'lost'.
local function drop(KEYS, ARGV)
  if not owns(KEYS[1], ARGV[1], ARGV[2], ARGV[3]) then return 'lost' end
  retire(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[3], ARGV, 4)
  return 'ok'
end

-- Renew (idle 0) or hand over (idle huge) the entries a consumer still owns, without counting a
-- delivery. KEYS: a lane stream. ARGV: group, consumer, idle ms, entry ids.
-- Reply: the ids the consumer no longer owns.
local function claim_own(KEYS, ARGV)
  local group, consumer, idle = ARGV[1], ARGV[2], ARGV[3]
  local lost = {}
  for i = 4, #ARGV do
    if owns(KEYS[1], group, consumer, ARGV[i]) then
      redis.call('XCLAIM', KEYS[1], group, consumer, 0, ARGV[i], 'IDLE', idle, 'JUSTID')
    else
      lost[#lost + 1] = ARGV[i]
    end
  end
  return lost
end

-- Count a model's outstanding entries per tenant again from its lanes, and replace the tenant counts
-- with the result (repairs counts after entries were lost or deleted by hand, or acked by workers
-- older than the counts). KEYS: tenant counts of the model, then every lane.
-- Reply: tenant, count, tenant, count, ...
local function recount(KEYS, ARGV)
  local counts, names = {}, {}
  for i = 2, #KEYS do
    local from = '-'
    while true do
      local batch = redis.call('XRANGE', KEYS[i], from, '+', 'COUNT', 1000)
      for _, e in ipairs(batch) do
        local fields = e[2]
        for j = 1, #fields, 2 do
          if fields[j] == 't' then
            local t = fields[j + 1]
            if counts[t] == nil then
              counts[t] = 0
              names[#names + 1] = t
            end
            counts[t] = counts[t] + 1
          end
        end
      end
      if #batch < 1000 then break end
      from = '(' .. batch[#batch][1]
    end
  end
  redis.call('DEL', KEYS[1])
  local reply = {}
  for _, t in ipairs(names) do
    redis.call('HSET', KEYS[1], t, counts[t])
    reply[#reply + 1] = t
    reply[#reply + 1] = counts[t]
  end
  return reply
end
