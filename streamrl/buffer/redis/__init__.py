"""Redis replay buffer (``buffer.backend=redis``): shared by processes and machines, inspectable.

Modules, one job each (dependencies point down the list; none imports this face):

- ``backend``: ``RedisBuffer``, the ``ReplayBuffer`` backend (admission, put, take, ack, rebase);
- ``writer``: ``LoopWriter``, an event loop's awaitable replica calls in shared pipelines;
- ``leases``: ``Heartbeat``, which renews a client's admission leases (slots of a process that
  died come back once its lease expires);
- ``stats``: the stats hash as ``BufferStats``, and ``print_stats`` / ``watch_stats`` (behind
  ``streamrl buffer stats``);
- ``wire``: the key layout (``RunKeys``) and the stream entries, encoded and decoded (msgspec);
- ``scripts``: the Lua scripts that keep every counter atomic with the data it describes, and
  their registration on a client;
- ``connection``: clients, retries through a Redis restart or outage, raw round trips.

Keys of run ``<run>``::

    streamrl:<run>:groups  stream, one msgspec-msgpack ``Group`` per entry (fields group_id,
                           min_version, data, holder); consumer group ``learners``, created at
                           init
    streamrl:<run>:stats   hash: learner_version produced consumed queued started in_flight
                           dropped refused malformed reclaimed staleness_mean staleness_max
                           staleness_sum staleness_count groups_per_step max_staleness
                           last_update_ts bus_endpoint (the trainer's weight-bus endpoint, for
                           streamrl serve), lost (set when the keys were made again, below)
    streamrl:<run>:holders hash: admissions in flight per holder, ``<name>@<client session>``
                           (a replica incarnation, or "" for streamrl serve's episodes)
    streamrl:<run>:leases  sorted set: holder -> when its lease expires (Redis time, seconds);
                           a holder whose lease is not live is gone: its slots are reclaimed
    streamrl:<run>:dead    stream, malformed and refused entries (source_id, reason, original
                           fields)
    streamrl:<run>:ids     set, every group_id ever put (put is idempotent)
    streamrl:<run>:queued  set, entry ids put and not yet taken (queued = SCARD)
    streamrl:<run>:taken   set, entry ids taken and not yet acked
    streamrl:<run>:minv    hash, entry id -> min_version of each queued entry put by PUT (lets
                           TAKE check and count a batch without reading its data)

At a glance: ``redis-cli HGETALL streamrl:<run>:stats`` (counters, learner version) and
``redis-cli XINFO GROUPS streamrl:<run>:groups`` (``lag``: entries no learner has read yet;
``pending``: read, not yet acked); ``streamrl buffer stats`` adds the holders and their leases.

Leases (``leases``): a process's admissions outlive it by ``lease_ttl_s`` at most. Each claim
sets its holder's lease, the client renews it from a heartbeat thread every third of that, and
the heartbeats and a learner waiting in ``take`` reclaim the slots of holders whose lease is not
live (logged once, naming the holder; counted as ``reclaimed``). ``rebase`` (a trainer resume)
keeps the slots of holders with a live lease (a ``streamrl serve`` that outlived the trainer
keeps its open groups) and drops the others; ``close`` ends the client's leases.

Learner lifecycle: XREADGROUP -> train -> checkpoint (with the taken group ids) -> ``ack``
(XACK). After a crash the unacked entries are delivered again: a restarted learner with the same
consumer name first reads its own pending entries (id 0); entries of a consumer that vanished
are claimed with XAUTOCLAIM once idle longer than ``claim_idle_s`` (``rebase`` claims them all
at once). Group ids already trained are passed back as ``skip_ids``: they are acked, not
delivered twice. Entries that do not decode as a ``Group`` (garbage bytes, wrong type, missing
fields) are acked, copied to the dead-letter stream, counted as ``malformed`` and logged with
their id; they never reach, nor crash, the learner. Decoding is msgspec, never pickle. Entries
with a token newer than the learner version (``base.newer_than_learner``) are refused the same
way, counted as ``refused``, the line naming the holder that put them.

Redis restarted empty (no persistence) or the run's keys deleted: the learner's next take or ack
meets NOGROUP and makes the keys again as a rebase from what it knows (its version and the
groups it consumed; ``RedisBuffer._recreate``): groups put since are delivered, admission
reopens within the bound, the bus endpoint is announced again; it warns once with the groups
lost (queued there as of its last stats read) and records them as ``lost``.

Acked entries are trimmed from the head of the stream (XTRIM MINID, never XDEL, which would make
XINFO's ``lag`` unknown), so a long-running service keeps only its backlog.

Round trips (tests/buffer/test_redis_buffer.py counts them): ``try_admit``, ``admit_up_to``
(n slots in one script), ``put``, ``put_and_admit`` (the put and the next group's admission in
one script), ``cancel_admission``, ``set_version`` and ``ack`` (XACK and trim) are one script
each (a claim sets its lease in the same script; the heartbeat is one script every
``lease_ttl_s / 3``). The awaitable calls a replica makes from its event loop (``atry_admit``,
``aadmit_up_to``, ``aput``, ``aput_and_admit``, ``acancel_admission``)
go through that loop's writer (``writer.LoopWriter``): every call queued while a pipeline is out
travels in the next one, consecutive puts as one PUT script (one XADD per group inside), so a
replica with a few groups in flight pays well under one round trip per group; each caller gets
its own result or error. A ``take`` of ready entries is one round trip: XREADGROUP COUNT n and
the TAKE script pipelined, the script counting the batch the read delivered (and publishing the
learner version) when it is complete and fresh; otherwise the entries are decoded first and
counted with one CONSUME script. Every entry is decoded once. XAUTOCLAIM is polled at most once
a second.
"""

from streamrl.buffer.redis.backend import RedisBuffer
from streamrl.buffer.redis.stats import print_stats, watch_stats
from streamrl.buffer.redis.wire import CONSUMER_GROUP, RunKeys

__all__ = ["CONSUMER_GROUP", "RedisBuffer", "RunKeys", "print_stats", "watch_stats"]
