"""The Lua scripts of the Redis buffer: every counter moves in the same atomic step as the data
it counts.

One constant per script (``INIT``, ``ADMIT``, ``CANCEL``, ``RELEASE``, ``PUT``,
``SET_VERSION``, ``CONSUME``, ``DISCARD``, ``ACK``, ``REBASE``), each prefixed with the shared
helpers (``touch`` stamps ``last_update_ts``, ``num`` reads a counter, ``set_queued`` sets
``queued`` from the queued set, ``settle`` retires one of a holder's admissions)
and documented with its KEYS, ARGV and reply. Key names are those of ``redis.RunKeys``: stats
and holders (hashes), ids / queued / taken (sets), groups / dead (streams).

Dependencies: none; ``buffer/redis.py`` registers these scripts and is their only user.
"""

_HELPERS = """
local function touch(h)
  local t = redis.call('TIME')
  redis.call('HSET', h, 'last_update_ts', t[1] .. '.' .. string.format('%06d', tonumber(t[2])))
end
local function num(h, f) return tonumber(redis.call('HGET', h, f) or '0') end
local function set_queued(h, q) redis.call('HSET', h, 'queued', redis.call('SCARD', q)) end
-- Retire one of a holder's admissions: false when it holds none.
local function settle(h, holders, holder)
  if num(holders, holder) <= 0 then return false end
  if redis.call('HINCRBY', holders, holder, -1) == 0 then redis.call('HDEL', holders, holder) end
  redis.call('HINCRBY', h, 'in_flight', -1)
  return true
end
"""

# Create the run's counters (missing ones only) and fix its bound the first time.
# KEYS: stats; ARGV: groups_per_step max_staleness.
# Returns the run's stored {groups_per_step, max_staleness} (the caller refuses a mismatch).
INIT = _HELPERS + """
local h = KEYS[1]
for _, f in ipairs({'learner_version', 'produced', 'consumed', 'queued', 'started', 'in_flight',
                    'dropped', 'malformed', 'staleness_sum', 'staleness_count',
                    'staleness_max', 'staleness_mean'}) do
  redis.call('HSETNX', h, f, 0)
end
redis.call('HSETNX', h, 'groups_per_step', ARGV[1])
redis.call('HSETNX', h, 'max_staleness', ARGV[2])
if redis.call('HEXISTS', h, 'last_update_ts') == 0 then touch(h) end
return redis.call('HMGET', h, 'groups_per_step', 'max_staleness')
"""

# The bound, checked and claimed in one step against the learner version read in the same step.
# KEYS: stats holders; ARGV: holder.
# Returns 1 with a slot claimed (started, in_flight, the holder's count +1) when
# started < (V + eta + 1) * B, else 0.
ADMIT = _HELPERS + """
local h = KEYS[1]
local v, b, eta = num(h, 'learner_version'), num(h, 'groups_per_step'), num(h, 'max_staleness')
if num(h, 'started') < (v + eta + 1) * b then
  redis.call('HINCRBY', h, 'started', 1)
  redis.call('HINCRBY', h, 'in_flight', 1)
  redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
  touch(h)
  return 1
end
return 0
"""

# Give back a slot ADMIT claimed (the replica will not put its group).
# KEYS: stats holders; ARGV: holder. Returns 1; an error reply when the holder holds none.
CANCEL = _HELPERS + """
local h = KEYS[1]
if not settle(h, KEYS[2], ARGV[1]) then
  return redis.error_reply('cancel_admission: no admitted group is in flight for holder '
                          .. ARGV[1])
end
redis.call('HINCRBY', h, 'started', -1)
touch(h)
return 1
"""

# Give back every slot a holder still holds (its replica died).
# KEYS: stats holders; ARGV: holder. Returns how many slots were given back.
RELEASE = _HELPERS + """
local h = KEYS[1]
local n = num(KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if n > 0 then
  redis.call('HINCRBY', h, 'in_flight', -n)
  redis.call('HINCRBY', h, 'started', -n)
  touch(h)
end
return n
"""

# Append a group to the stream, at most once per group_id, and move its slot to queued; count
# it for its producer ('produced:<p>', and 'version:<p>' its min_version: how far behind the
# learner that producer samples).
# KEYS: stats ids groups queued holders; ARGV: group_id min_version (-1: none) data holder
# producer ('': none).
# Returns 1, or 0 when group_id was put before (put is idempotent).
PUT = _HELPERS + """
local h = KEYS[1]
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then return 0 end
local id = redis.call('XADD', KEYS[3], '*', 'group_id', ARGV[1], 'min_version', ARGV[2],
                      'data', ARGV[3])
redis.call('SADD', KEYS[4], id)
if not settle(h, KEYS[5], ARGV[4]) then
  -- put without admission: it still holds a slot, so started = consumed+queued+in_flight
  redis.call('HINCRBY', h, 'started', 1)
end
redis.call('HINCRBY', h, 'produced', 1)
if ARGV[5] ~= '' then
  redis.call('HINCRBY', h, 'produced:' .. ARGV[5], 1)
  if ARGV[2] ~= '-1' then redis.call('HSET', h, 'version:' .. ARGV[5], ARGV[2]) end
end
set_queued(h, KEYS[4])
touch(h)
return 1
"""

# Raise the learner version (never lower it).
# KEYS: stats; ARGV: version strict ('1': a lower version is an error reply, else ignored).
# Returns the learner version now stored.
SET_VERSION = _HELPERS + """
local h = KEYS[1]
local cur, v = num(h, 'learner_version'), tonumber(ARGV[1])
if v < cur then
  if ARGV[2] == '1' then
    return redis.error_reply('set_version: learner_version=' .. v .. ' < current ' .. cur ..
                             ' (resuming a checkpoint: use rebase; a new run: use another'
                             .. ' buffer.run, or purge this one)')
  end
  return cur
end
redis.call('HSET', h, 'learner_version', v)
touch(h)
return v
"""

# Count taken entries as consumed, once each, with their staleness; raise the learner version.
# KEYS: stats queued taken; ARGV: version, then (entry id, staleness) pairs.
# Returns how many entries were newly counted.
CONSUME = _HELPERS + """
local h = KEYS[1]
if tonumber(ARGV[1]) > num(h, 'learner_version') then
  redis.call('HSET', h, 'learner_version', ARGV[1])
end
local n, ssum, smax = 0, 0, num(h, 'staleness_max')
for i = 2, #ARGV, 2 do
  -- Counted once per entry, even when a crash makes it delivered twice.
  if redis.call('SADD', KEYS[3], ARGV[i]) == 1 then
    if redis.call('SREM', KEYS[2], ARGV[i]) == 0 then
      redis.call('HINCRBY', h, 'started', 1)  -- an entry that bypassed put
      redis.call('HINCRBY', h, 'produced', 1)
    end
    local s = tonumber(ARGV[i + 1])
    n = n + 1
    ssum = ssum + s
    if s > smax then smax = s end
  end
end
if n > 0 then
  redis.call('HINCRBY', h, 'consumed', n)
  local cnt = redis.call('HINCRBY', h, 'staleness_count', n)
  local sum = redis.call('HINCRBY', h, 'staleness_sum', ssum)
  redis.call('HSET', h, 'staleness_max', smax, 'staleness_mean', string.format('%.4f', sum / cnt))
end
set_queued(h, KEYS[2])
touch(h)
return n
"""

# Ack an entry the learner will not train on and fix the counters its kind moves.
# KEYS: stats queued taken groups dead;
# ARGV: entry_id kind (dropped | malformed | skipped) reason consumer_group.
# dropped frees its admission slot; malformed is copied to the dead-letter stream. Returns 1.
DISCARD = _HELPERS + """
local h, id, kind = KEYS[1], ARGV[1], ARGV[2]
redis.call('XACK', KEYS[4], ARGV[4], id)
local was_queued = redis.call('SREM', KEYS[2], id)
local was_taken = redis.call('SREM', KEYS[3], id)
if kind == 'dropped' then
  redis.call('HINCRBY', h, 'dropped', 1)
  -- give the admission slot back, so a replica can start a replacement (no deadlock)
  if was_queued == 1 or was_taken == 1 then redis.call('HINCRBY', h, 'started', -1) end
  if was_taken == 1 then redis.call('HINCRBY', h, 'consumed', -1) end
elseif kind == 'malformed' then
  redis.call('HINCRBY', h, 'malformed', 1)
  if was_queued == 1 then redis.call('HINCRBY', h, 'started', -1) end
  local fields = {'source_id', id, 'reason', ARGV[3]}
  local entry = redis.call('XRANGE', KEYS[4], id, id)[1]
  if entry then
    for i = 1, #entry[2], 2 do
      fields[#fields + 1] = 'field:' .. entry[2][i]
      fields[#fields + 1] = entry[2][i + 1]
    end
  end
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', 10000, '*', unpack(fields))
elseif kind == 'skipped' then  -- trained before a restart (recorded in the checkpoint)
  if was_queued == 1 then redis.call('HINCRBY', h, 'consumed', 1) end
end
set_queued(h, KEYS[2])
touch(h)
return 1
"""

# Ack trained entries (XACK), forget them as taken and, when asked, trim every acked entry from
# the head of the stream (XTRIM MINID, never XDEL: XINFO's lag stays known), all in one round
# trip. Everything before the oldest pending entry is acked; with none pending, everything up to
# the group's last delivered entry is.
# KEYS: stats taken groups; ARGV: consumer_group trim ('1': trim) entry ids...
# Returns how many entries were acked.
ACK = _HELPERS + """
local n = 0
for i = 3, #ARGV do
  n = n + redis.call('XACK', KEYS[3], ARGV[1], ARGV[i])
  redis.call('SREM', KEYS[2], ARGV[i])
end
if ARGV[2] == '1' then
  local pending = redis.call('XPENDING', KEYS[3], ARGV[1])
  local minid = pending[2]
  if pending[1] == 0 then
    for _, info in ipairs(redis.call('XINFO', 'GROUPS', KEYS[3])) do
      local f = {}
      for j = 1, #info, 2 do f[info[j]] = info[j + 1] end
      if f['name'] == ARGV[1] then
        local ms, seq = string.match(f['last-delivered-id'], '^(%d+)-(%d+)$')
        minid = ms .. '-' .. string.format('%d', tonumber(seq) + 1)
      end
    end
  end
  if minid then redis.call('XTRIM', KEYS[3], 'MINID', minid) end
end
touch(KEYS[1])
return n
"""

# After a restart from a checkpoint: requeue taken-not-trained entries, reset the counters.
# KEYS: stats queued taken holders; ARGV: version consumed in_flight groups_per_step
# max_staleness.
# Returns the number of queued entries.
REBASE = _HELPERS + """
local h = KEYS[1]
if tonumber(ARGV[3]) == 0 then redis.call('DEL', KEYS[4]) end  -- no replica holds a slot
redis.call('SUNIONSTORE', KEYS[2], KEYS[2], KEYS[3])  -- taken, not trained: deliver again
redis.call('DEL', KEYS[3])
local q = redis.call('SCARD', KEYS[2])
redis.call('HSET', h, 'learner_version', ARGV[1], 'consumed', ARGV[2], 'in_flight', ARGV[3],
           'queued', q, 'started', tonumber(ARGV[2]) + q + tonumber(ARGV[3]),
           'groups_per_step', ARGV[4], 'max_staleness', ARGV[5])
touch(h)
return q
"""
