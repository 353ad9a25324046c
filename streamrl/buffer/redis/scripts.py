"""The Lua scripts of the Redis buffer: every counter moves in the same atomic step as the data
it counts; ``Scripts`` registers them on a client.

One constant per script (``INIT``, ``ADMIT``, ``CANCEL``, ``RELEASE``, ``PUT``,
``SET_VERSION``, ``TAKE``, ``CONSUME``, ``DISCARD``, ``ACK``, ``REBASE``, ``LEASE``), each
prefixed with the shared helpers (``touch`` stamps ``last_update_ts``, ``num`` reads a counter,
``capacity`` is the staleness bound, ``set_queued`` sets ``queued`` from the queued set,
``settle`` retires one of a holder's admissions, ``clock`` is Redis's time, ``chunked`` makes one
variadic call per thousand items, ``count_taken`` counts taken entries as consumed, ``forget_gone``
forgets the holders whose lease is not live) and documented with its KEYS, ARGV and reply. Key
names are those of ``wire.RunKeys``: stats holders and minv (hashes), ids / queued / taken
(sets), leases (sorted set), groups / dead (streams).

Leases: every script that claims a slot (ADMIT, PUT with admit_next) also sets its holder's
lease in the same step, to Redis's clock plus the claimer's lease seconds; LEASE renews them and
reclaims the slots of every holder whose lease is not live (expired, or removed when its client
closed), and REBASE keeps only the slots of holders whose lease is live. Redis's clock, not the
clients', so hosts whose clocks disagree still agree on who is gone.

Dependencies: redis-py (``Script``); the backend and its writer are the only users.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.commands.core import Script

_HELPERS = """
local function touch(h)
  local t = redis.call('TIME')
  redis.call('HSET', h, 'last_update_ts', t[1] .. '.' .. string.format('%06d', tonumber(t[2])))
end
local function num(h, f) return tonumber(redis.call('HGET', h, f) or '0') end
-- How many groups may have been started by the stored learner version: (V + eta + 1) * B, the
-- Lua twin of Admission.capacity (buffer/base.py), here to check and claim in one atomic step.
local function capacity(h)
  local s = redis.call('HMGET', h, 'learner_version', 'groups_per_step', 'max_staleness')
  return (tonumber(s[1] or '0') + tonumber(s[3] or '0') + 1) * tonumber(s[2] or '0')
end
local function set_queued(h, q) redis.call('HSET', h, 'queued', redis.call('SCARD', q)) end
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
-- Retire one of a holder's admissions: false when it holds none.
local function settle(h, holders, holder)
  if num(holders, holder) <= 0 then return false end
  if redis.call('HINCRBY', holders, holder, -1) == 0 then redis.call('HDEL', holders, holder) end
  redis.call('HINCRBY', h, 'in_flight', -1)
  return true
end
-- redis.call(cmd, key, [arg,] items...) once per chunk of items (Lua unpacks at most a few
-- thousand values at once): one variadic call instead of one per item, since each redis.call
-- costs a microsecond or two beyond its command. Array replies are joined, numbers summed.
local function chunked(cmd, key, arg, items)
  local out, sum = {}, 0
  for i = 1, #items, 1000 do
    local last = math.min(i + 999, #items)
    local r
    if arg then r = redis.call(cmd, key, arg, unpack(items, i, last))
    else r = redis.call(cmd, key, unpack(items, i, last)) end
    if type(r) == 'table' then
      for _, v in ipairs(r) do out[#out + 1] = v end
    else
      sum = sum + r
    end
  end
  return out, sum
end
-- Forget the holders whose lease is not live at `now` (expired, or never set or removed: a
-- client that closed; a holder with a live lease is alive) and the expired leases. Returns
-- {holder, slots, ...} of the forgotten holders and their slots in all.
local function forget_gone(holders, leases, now)
  local flat = redis.call('HGETALL', holders)
  local names, out, total = {}, {}, 0
  for i = 1, #flat, 2 do names[#names + 1] = flat[i] end
  local expiry = chunked('ZMSCORE', leases, false, names)
  for i, name in ipairs(names) do
    local t = tonumber(expiry[i])
    if t == nil or t <= now then
      local slots = tonumber(flat[2 * i])
      redis.call('HDEL', holders, name)
      out[#out + 1] = name
      out[#out + 1] = slots
      total = total + slots
    end
  end
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
  return out, total
end
-- Count taken entries as consumed, once each (a crash can deliver one twice), with their
-- staleness; ids (distinct) and stalenesses are parallel lists. Returns how many were newly
-- counted.
local function count_taken(h, queued, taken, ids, stalenesses)
  local n, ssum, smax, bypassed = 0, 0, num(h, 'staleness_max'), 0
  local was_taken = chunked('SMISMEMBER', taken, false, ids)
  local was_queued = chunked('SMISMEMBER', queued, false, ids)
  local new = {}
  for i, id in ipairs(ids) do
    if was_taken[i] == 0 then
      new[#new + 1] = id
      if was_queued[i] == 0 then bypassed = bypassed + 1 end  -- an entry that bypassed put
      local s = stalenesses[i]
      n = n + 1
      ssum = ssum + s
      if s > smax then smax = s end
    end
  end
  if n > 0 then
    chunked('SADD', taken, false, new)
    chunked('SREM', queued, false, new)
    if bypassed > 0 then
      redis.call('HINCRBY', h, 'started', bypassed)
      redis.call('HINCRBY', h, 'produced', bypassed)
    end
    redis.call('HINCRBY', h, 'consumed', n)
    local cnt = redis.call('HINCRBY', h, 'staleness_count', n)
    local sum = redis.call('HINCRBY', h, 'staleness_sum', ssum)
    redis.call('HSET', h, 'staleness_max', smax, 'staleness_mean',
               string.format('%.4f', sum / cnt))
  end
  return n
end
"""

# Create the run's counters (missing ones only) and fix its bound the first time.
# KEYS: stats; ARGV: groups_per_step max_staleness.
# Returns the run's stored {groups_per_step, max_staleness} (the caller refuses a mismatch).
INIT = _HELPERS + """
local h = KEYS[1]
for _, f in ipairs({'learner_version', 'produced', 'consumed', 'queued', 'started', 'in_flight',
                    'dropped', 'refused', 'malformed', 'reclaimed', 'staleness_sum',
                    'staleness_count', 'staleness_max', 'staleness_mean'}) do
  redis.call('HSETNX', h, f, 0)
end
redis.call('HSETNX', h, 'groups_per_step', ARGV[1])
redis.call('HSETNX', h, 'max_staleness', ARGV[2])
if redis.call('HEXISTS', h, 'last_update_ts') == 0 then touch(h) end
return redis.call('HMGET', h, 'groups_per_step', 'max_staleness')
"""

# The bound, checked and claimed in one step against the learner version read in the same step.
# KEYS: stats holders leases; ARGV: holder n lease_s.
# Claims min(n, capacity - started) slots (started, in_flight and the holder's count rise by
# as many), sets the holder's lease to now + lease_s, and returns how many: 0 when the bound is
# reached.
ADMIT = _HELPERS + """
local h = KEYS[1]
local n = math.min(tonumber(ARGV[2]), capacity(h) - num(h, 'started'))
if n > 0 then
  redis.call('HINCRBY', h, 'started', n)
  redis.call('HINCRBY', h, 'in_flight', n)
  redis.call('HINCRBY', KEYS[2], ARGV[1], n)
  redis.call('ZADD', KEYS[3], clock() + tonumber(ARGV[3]), ARGV[1])
  touch(h)
  return n
end
return 0
"""

# Give back a slot ADMIT claimed (the replica will not put its group).
# KEYS: stats holders [leases]; ARGV: holder. Returns 1; an error reply when the holder holds none.
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

# Give back every slot a holder still holds (its replica died) and end its lease.
# KEYS: stats holders leases; ARGV: holder. Returns how many slots were given back.
RELEASE = _HELPERS + """
local h = KEYS[1]
local n = num(KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if n > 0 then
  redis.call('HINCRBY', h, 'in_flight', -n)
  redis.call('HINCRBY', h, 'started', -n)
  touch(h)
end
return n
"""

# Append groups to the stream, each at most once per group_id and with the holder that put it
# (the learner names it when it refuses the group), and move each one's slot to
# queued (one of its holder's admissions is settled; a put without one takes a fresh slot, so
# started = consumed + queued + in_flight); count each for its producer ('produced:<p>', and
# 'version:<p>' its min_version: how far behind the learner that producer samples). A group may
# also claim its holder's next slot (admit_next: the lease seconds, '0': no claim), as ADMIT
# would, lease included, right after its put: a replica's put and its next admission are one
# round trip. A batch of groups is one call (the
# buffer's writer sends every put queued meanwhile at once, at most PUT_BATCH): one XADD per
# group; the sets, the minv hash and the counters are written once per batch. The groups' bytes
# pass through Lua, which since Redis 7.0 hashes every byte of a string it is given
# (redis/redis#9449): about 1.1 us per KiB, 9 of PUT's 22 us per 8 KiB group. An XADD outside
# the script would not cost it, but then no one-round-trip put could skip a group put before.
# KEYS: stats ids groups queued holders minv (entry id -> min_version, for TAKE) leases;
# ARGV: 6 per group: group_id min_version (-1: none) data holder producer ('': none) admit_next.
# A holder is ``<name>@<client session>`` (wire.put_args); the entry records its name only.
# Returns a string of 2 characters per group: put ('1', or '0' when group_id was put before:
# put is idempotent) and admitted ('1' when admit_next claimed a slot, else '0'); one bulk
# string, not an array of 2 per group, because the client parses each array element apart.
PUT = _HELPERS + """
local h, holders = KEYS[1], KEYS[5]
local bound, started = capacity(h), num(h, 'started')
local started0, in_flight, produced = started, 0, 0
local held, held0, by_producer, last_version, leased = {}, {}, {}, {}, {}
local gids = {}
for i = 1, #ARGV, 6 do gids[#gids + 1] = ARGV[i] end
local seen = redis.call('SMISMEMBER', KEYS[2], unpack(gids))
local new_gids, new_ids, versions, out, batch = {}, {}, {}, {}, {}
for k, gid in ipairs(gids) do
  local i = 6 * k - 5
  local mv, holder, p = ARGV[i + 1], ARGV[i + 3], ARGV[i + 4]
  if held[holder] == nil then
    held[holder] = num(holders, holder)
    held0[holder] = held[holder]
  end
  local put, admitted = 0, 0
  if seen[k] == 0 and not batch[gid] then  -- the same group twice in a batch: the first counts
    batch[gid] = true
    local id = redis.call('XADD', KEYS[3], '*', 'group_id', gid, 'min_version', mv,
                          'data', ARGV[i + 2], 'holder', string.match(holder, '^(.*)@') or holder)
    new_gids[#new_gids + 1] = gid
    new_ids[#new_ids + 1] = id
    versions[#versions + 1] = id
    versions[#versions + 1] = mv
    if held[holder] > 0 then  -- settle one of the holder's admissions
      held[holder] = held[holder] - 1
      in_flight = in_flight - 1
    else  -- a put without admission still holds a slot
      started = started + 1
    end
    produced = produced + 1
    if p ~= '' then
      by_producer[p] = (by_producer[p] or 0) + 1
      if mv ~= '-1' then last_version[p] = mv end
    end
    put = 1
  end
  local lease_s = tonumber(ARGV[i + 5])
  if lease_s > 0 and started < bound then  -- the bound, as ADMIT checks it
    started = started + 1
    in_flight = in_flight + 1
    held[holder] = held[holder] + 1
    leased[holder] = lease_s
    admitted = 1
  end
  out[#out + 1] = put
  out[#out + 1] = admitted
end
out = table.concat(out)
if started == started0 and produced == 0 and in_flight == 0 then return out end
if produced > 0 then
  redis.call('SADD', KEYS[2], unpack(new_gids))
  redis.call('SADD', KEYS[4], unpack(new_ids))
  redis.call('HSET', KEYS[6], unpack(versions))
  redis.call('HINCRBY', h, 'produced', produced)
end
for holder, n in pairs(held) do
  if n ~= held0[holder] then
    if n == 0 then redis.call('HDEL', holders, holder)
    else redis.call('HINCRBY', holders, holder, n - held0[holder]) end
  end
end
if next(leased) then
  local now = clock()
  for holder, lease_s in pairs(leased) do redis.call('ZADD', KEYS[7], now + lease_s, holder) end
end
if started ~= started0 then redis.call('HINCRBY', h, 'started', started - started0) end
if in_flight ~= 0 then redis.call('HINCRBY', h, 'in_flight', in_flight) end
for p, n in pairs(by_producer) do redis.call('HINCRBY', h, 'produced:' .. p, n) end
for p, v in pairs(last_version) do redis.call('HSET', h, 'version:' .. p, v) end
set_queued(h, KEYS[4])
touch(h)
return out
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

# Count the batch the learner's XREADGROUP '>' COUNT count just delivered (sent before this in
# one pipeline: a take is one round trip), as CONSUME would, when it is complete: `count`
# entries delivered to `consumer` after `after_id` (the last entry id it had seen), each put by
# PUT (queued, its min_version in the minv hash), no older than the bound and not newer than
# the learner (negative staleness: the learner refuses it, base.newer_than_learner). Otherwise
# nothing is counted here: the learner decodes, drops and dead-letters what it must, and counts
# the rest with CONSUME. Raises the learner version first (never lowers it): before the learner
# waits.
# KEYS: stats queued taken groups minv;
# ARGV: consumer_group consumer after_id count learner_version max_staleness.
# Returns the ids counted (the learner checks them against what it read: a retried pipeline
# may have delivered others first), {} when none.
TAKE = _HELPERS + """
local h = KEYS[1]
local v, count, eta = tonumber(ARGV[5]), tonumber(ARGV[4]), tonumber(ARGV[6])
if v > num(h, 'learner_version') then
  redis.call('HSET', h, 'learner_version', v)
  touch(h)
end
local pending = redis.call('XPENDING', KEYS[4], ARGV[1], '(' .. ARGV[3], '+', count, ARGV[2])
if #pending < count then return {} end
local ids, stalenesses = {}, {}
for i, p in ipairs(pending) do ids[i] = p[1] end
local versions = chunked('HMGET', KEYS[5], false, ids)
local queued = chunked('SMISMEMBER', KEYS[2], false, ids)
for i, id in ipairs(ids) do
  local mv = tonumber(versions[i])
  if mv == nil or queued[i] == 0 then return {} end
  local s = 0
  if mv ~= -1 then s = v - mv end
  if s > eta or s < 0 then return {} end
  stalenesses[i] = s
end
count_taken(h, KEYS[2], KEYS[3], ids, stalenesses)
chunked('HDEL', KEYS[5], false, ids)
set_queued(h, KEYS[2])
touch(h)
return ids
"""

# Count taken entries as consumed, once each, with their staleness; raise the learner version.
# KEYS: stats queued taken minv; ARGV: version, then (entry id, staleness) pairs.
# Returns how many entries were newly counted.
CONSUME = _HELPERS + """
local h = KEYS[1]
if tonumber(ARGV[1]) > num(h, 'learner_version') then
  redis.call('HSET', h, 'learner_version', ARGV[1])
end
local ids, stalenesses, seen = {}, {}, {}
for i = 2, #ARGV, 2 do
  if not seen[ARGV[i]] then  -- count_taken wants distinct ids
    seen[ARGV[i]] = true
    ids[#ids + 1] = ARGV[i]
    stalenesses[#stalenesses + 1] = tonumber(ARGV[i + 1])
  end
end
local n = count_taken(h, KEYS[2], KEYS[3], ids, stalenesses)
if #ids > 0 then chunked('HDEL', KEYS[4], false, ids) end
set_queued(h, KEYS[2])
touch(h)
return n
"""

# Ack an entry the learner will not train on and fix the counters its kind moves.
# KEYS: stats queued taken groups dead minv;
# ARGV: entry_id kind (dropped | refused | malformed | skipped) reason consumer_group.
# dropped frees its admission slot; refused and malformed free it too and are copied to the
# dead-letter stream (an entry TAKE counted as consumed is uncounted). Returns 1.
DISCARD = _HELPERS + """
local h, id, kind = KEYS[1], ARGV[1], ARGV[2]
redis.call('XACK', KEYS[4], ARGV[4], id)
local was_queued = redis.call('SREM', KEYS[2], id)
local was_taken = redis.call('SREM', KEYS[3], id)
redis.call('HDEL', KEYS[6], id)
if kind == 'dropped' or kind == 'refused' or kind == 'malformed' then
  redis.call('HINCRBY', h, kind, 1)
  -- give the admission slot back, so a replica can start a replacement (no deadlock)
  if was_queued == 1 or was_taken == 1 then redis.call('HINCRBY', h, 'started', -1) end
  if was_taken == 1 then redis.call('HINCRBY', h, 'consumed', -1) end
end
if kind == 'refused' or kind == 'malformed' then
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
local ids = {}
for i = 3, #ARGV do ids[#ids + 1] = ARGV[i] end
local _, n = chunked('XACK', KEYS[3], ARGV[1], ids)
chunked('SREM', KEYS[2], false, ids)
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

# After a restart from a checkpoint: requeue taken-not-trained entries, drop the slots of holders
# that are gone (lease not live), keep those of live ones (a streamrl serve that outlived the
# trainer), reset the counters.
# KEYS: stats queued taken holders leases; ARGV: version consumed groups_per_step max_staleness.
# Returns {queued, slots kept, holders kept, slots dropped, holders dropped}.
REBASE = _HELPERS + """
local h = KEYS[1]
local now = clock()
local dead, dropped = forget_gone(KEYS[4], KEYS[5], now)
local kept, live = 0, 0
for _, n in ipairs(redis.call('HVALS', KEYS[4])) do
  kept = kept + tonumber(n)
  live = live + 1
end
redis.call('SUNIONSTORE', KEYS[2], KEYS[2], KEYS[3])  -- taken, not trained: deliver again
redis.call('DEL', KEYS[3])
local q = redis.call('SCARD', KEYS[2])
redis.call('HSET', h, 'learner_version', ARGV[1], 'consumed', ARGV[2], 'in_flight', kept,
           'queued', q, 'started', tonumber(ARGV[2]) + q + kept,
           'groups_per_step', ARGV[3], 'max_staleness', ARGV[4])
touch(h)
return {q, kept, live, dropped, #dead / 2}
"""

# A client's heartbeat: renew its holders' leases, then reclaim the slots of every holder whose
# lease is not live (its process died: no heartbeat for its lease seconds), counted as
# 'reclaimed'; leases long expired are forgotten.
# KEYS: stats holders leases; ARGV: lease_s, then the holders to renew (none: only reclaim).
# Returns {holder, slots, ...}: the holders whose slots were reclaimed (the caller logs them:
# this is atomic, so each reclaim is seen by one client only).
LEASE = _HELPERS + """
local h = KEYS[1]
local now = clock()
for i = 2, #ARGV do redis.call('ZADD', KEYS[3], now + tonumber(ARGV[1]), ARGV[i]) end
local dead, total = forget_gone(KEYS[2], KEYS[3], now)
if total > 0 then
  redis.call('HINCRBY', h, 'in_flight', -total)
  redis.call('HINCRBY', h, 'started', -total)
  redis.call('HINCRBY', h, 'reclaimed', total)
  touch(h)
end
return dead
"""


class Scripts:
    """The scripts registered on one client: each call is an EVALSHA, and a script the server
    forgot (it restarted) is loaded again."""

    def __init__(self, client: redis.Redis) -> None:
        s = client.register_script
        self.admit, self.cancel, self.put = s(ADMIT), s(CANCEL), s(PUT)
        self.admit_many = s(ADMIT)  # the same script: its replies are counts, not flags
        self.release = s(RELEASE)
        self.set_version, self.consume, self.take = s(SET_VERSION), s(CONSUME), s(TAKE)
        self.discard, self.ack, self.rebase = s(DISCARD), s(ACK), s(REBASE)
        self.lease = s(LEASE)


def script_result(script: Script, keys: list[str], args: list[Any], reply: Any) -> Any:
    """The result of an EVALSHA of ``script`` that returned ``reply`` raw: an error reply is
    raised; NOSCRIPT (Redis restarted and forgot it) loads the script and runs it again."""
    if isinstance(reply, redis.exceptions.NoScriptError):
        return script(keys=keys, args=args)
    if isinstance(reply, Exception):
        raise reply
    return reply


def admitted(put_reply: bytes, i: int) -> bool:
    """Whether the ``i``-th group of a PUT call claimed its holder's next slot (the reply holds
    two characters per group: put, admitted)."""
    return put_reply[2 * i + 1:2 * i + 2] == b"1"
