#!lua
--[[ repoint: point an idempotency key at the newest run of its key that exists (reconcile).

The target is decided here, from the key's run set as Redis holds it now, never
from what the caller read earlier: a start that reran the key between the
caller's read and this call has already made its new run the newest member, so a
repair can never move the key back to a run that was superseded.

Keys are never built in a script (a cluster routes by the KEYS it is given), so the caller passes the run hashes of the
candidates: the newest members it read, and the run the pointer named. The walk
goes from the newest member down: a member whose hash is gone is skipped (and
dropped from the set), the first one whose hash exists is the target. A member
the caller did not pass stops the walk: the reply names it and the caller calls
again with it. The walk reads at most one member more than were passed.

KEYS[1]  key pointer                     realm:{wf}:key:<key>
KEYS[2]  runs of this key (zset)         realm:{wf}:keyruns:<key>
KEYS[3]  operation record                realm:{wf}:op:<op id>
KEYS[4..] the run hash of each id in ARGV, in the same order   realm:{wf}:run:<id>

ARGV[1..] candidate run ids (their hashes are KEYS[4..])

Reply: {outcome, ...}
  written, run, held   the pointer named `held` ('' = none) and now names `run`, the
                       newest existing run of the key, with its phase, step and
                       fingerprint; it expires with the run if the run has ended,
                       never if it is live
  current, run         the pointer already names `run`, the newest existing run (a
                       start or another repair got there first): nothing written
  deleted, held        no run of the key exists any more: the pointer (naming `held`,
                       a run that is gone) and the run set were removed; the key is free
  need, id...          nothing written: call again passing these ids too (members the
                       walk reached, or the pointer's run, that were not passed)
A resend of this call (same operation record) gets the first attempt's reply; a
`need` reply is not recorded, so the next call may reuse the record.
The key index (realm:{wf}:keys) is not written here: a pointer is only written when
the key's run set holds its target, and a key whose run set or pointer exists is in
the index already (the claim that wrote them added it; the sweep keeps it while
either exists; reconcile --scan adds the keys of an older gateway).
]]

local pointer, keyruns, op = KEYS[1], KEYS[2], KEYS[3]
-- How many unknown members one `need` reply names: the walk stops at the first
-- one, and the members just below it are what the next walk will reach.
local NEED_BATCH = 8

local recalled = op_recall(op)
if recalled then
  return recalled
end

local run_key_of = {}
for i = 1, #ARGV do
  run_key_of[ARGV[i]] = KEYS[i + 3]
end

local held = redis.call('HGET', pointer, 'run') or ''
local members = redis.call('ZREVRANGE', keyruns, 0, #ARGV)
local target, gone = nil, {}
for i, id in ipairs(members) do
  local run_key = run_key_of[id]
  if not run_key then
    local need = {'need'}
    for _, more in ipairs(redis.call('ZREVRANGE', keyruns, i - 1, i + NEED_BATCH - 2)) do
      if not run_key_of[more] then
        need[#need + 1] = more
      end
    end
    return need
  end
  if redis.call('EXISTS', run_key) == 1 then
    target = id
    break
  end
  gone[#gone + 1] = id
end

if #gone > 0 then
  redis.call('ZREM', keyruns, unpack(gone))
end

if not target then
  -- Every member read was passed and is gone, and at most #ARGV were (one more
  -- would have been unknown): the walk reached the end of the set. No run of
  -- this key exists.
  if held ~= '' then
    local held_key = run_key_of[held]
    if not held_key then
      return {'need', held}
    end
    if redis.call('EXISTS', held_key) == 1 then
      -- The pointer names a run that exists but is missing from the set (a partial
      -- restore): it is the key's only run, so keep it, and put it back in the set.
      redis.call('ZADD', keyruns, next_score(keyruns, select(2, server_time())), held)
      return op_remember(op, {'current', held})
    end
  end
  redis.call('DEL', pointer, keyruns)
  return op_remember(op, {'deleted', held})
end

if held == target then
  return op_remember(op, {'current', target})
end

local run_key = run_key_of[target]
local run = redis.call('HMGET', run_key, 'phase', 'step', 'fp')
-- A queued key's live runs and limit stay with the key: its queue's next start needs them.
local queueing = redis.call('HMGET', pointer, 'live', 'limit')
redis.call('DEL', pointer)
redis.call('HSET', pointer, 'run', target, 'phase', run[1] or '', 'step', run[2] or '',
  'fp', run[3] or '')
if queueing[1] then
  redis.call('HSET', pointer, 'live', queueing[1], 'limit', queueing[2] or '1')
end
local ttl = redis.call('PTTL', run_key)
if ttl > 0 then
  redis.call('PEXPIRE', pointer, ttl)
  redis.call('PEXPIRE', keyruns, ttl)
else
  redis.call('PERSIST', keyruns)
end
return op_remember(op, {'written', target, held})
