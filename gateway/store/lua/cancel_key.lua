#!lua
--[[ cancel_key: cancel the runs an idempotency key holds: its live run (its live runs,
under on_live_match 'queue'), a scheduled one, and every run waiting in its queue.

The caller reads the pointer and the queue first to learn the runs' ids (keys are
never built in Lua); this script re-checks them, so a start that moved the key in
between is never cancelled by mistake.

KEYS[1]  key pointer                   realm:{wf}:key:<key>
KEYS[2]  runs of this key              realm:{wf}:keyruns:<key>
KEYS[3]  operation record              realm:{wf}:op:<op id>
KEYS[4]  stream the runners read       realm:{wf}:stream
KEYS[5]  the key's queue               realm:{wf}:queue:<key>
KEYS[6]  the workflow's queued runs    realm:{wf}:queued
KEYS[7]  the workflow's scheduled runs realm:{wf}:due
KEYS[8…] the run hash of each id in ARGV[5…], in the same order

ARGV[1] retention in ms
ARGV[2] the run id the caller read from the pointer
ARGV[3] the pointer's live list the caller read ('' = none)
ARGV[4] the queue the caller read: its ids, space-separated, in order ('' = empty)
ARGV[5…] ids: the pointer's run, then its live runs and the queue's, each once

Reply: {outcome, run_id, count}
  cancelled   `count` runs were live, scheduled or waiting and are now cancelled
  not_live    the key's run had already ended and nothing waited; nothing changed
  no_key      the key points at no run (or at one that no longer exists: the
              pointer is removed, so the key is free, and the key's run set
              expires after ARGV[1])
  moved       the key or its queue changed since the caller read them: read again and retry
  op_reused   the operation id already named another call (op_recall in _lib.lua)
A resend of this call (same operation record) gets the first attempt's reply.
]]

local pointer, keyruns, op, stream = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local queue, queued, due = KEYS[5], KEYS[6], KEYS[7]
local retention_ms, expected, expected_live, expected_queue = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

local what = {'cancel_key', pointer, ''}
local recalled = op_recall(op, what)
if recalled then
  return recalled
end
local cur = redis.call('HMGET', pointer, 'run', 'phase', 'live')
if not cur[1] then
  return {'no_key', '', '0'}
end
local waiting = redis.call('ZRANGE', queue, 0, -1)
if cur[1] ~= expected or (cur[3] or '') ~= expected_live
    or table.concat(waiting, ' ') ~= expected_queue then
  return {'moved', cur[1], '0'}
end
local hash_of = {}
for i = 5, #ARGV do
  hash_of[ARGV[i]] = KEYS[i + 3]
end
if not redis.call('HGET', hash_of[expected], 'id') and #waiting == 0 then
  -- The pointer names a run that no longer exists: nothing is live under the key.
  redis.call('DEL', pointer)
  redis.call('ZREM', keyruns, expected)
  -- The run set was kept for as long as that run was live (no TTL); its other runs
  -- ended and expire within retention, so it expires then too, as after an ending.
  redis.call('PEXPIRE', keyruns, retention_ms)
  return {'no_key', '', '0'}
end

local now, count = now_ms(), 0
-- The waiting runs first: ending the live ones must not start them.
local q = {queue = queue, queued = queued}
for _, id in ipairs(waiting) do
  if redis.call('HGET', hash_of[id], 'phase') == 'queued' then
    end_waiting(hash_of[id], id, 'cancelled', now, retention_ms, nil, nil, q, nil)
    count = count + 1
  else
    redis.call('ZREM', queue, id)
    redis.call('ZREM', queued, id)
  end
end
local live = {}
for id in string.gmatch(cur[3] or '', '%S+') do
  live[#live + 1] = id
end
if cur[1] ~= '' and not string.find(' ' .. (cur[3] or '') .. ' ', ' ' .. cur[1] .. ' ', 1, true) then
  live[#live + 1] = cur[1]
end
for _, id in ipairs(live) do
  local phase = redis.call('HGET', hash_of[id], 'phase')
  if phase == 'running' then
    end_run(hash_of[id], id, 'cancelled', now, retention_ms, pointer, keyruns, stream)
    count = count + 1
  elseif phase == 'scheduled' then
    end_waiting(hash_of[id], id, 'cancelled', now, retention_ms, pointer, keyruns, nil, due)
    count = count + 1
  end
end
if count == 0 then
  return op_remember(op, {'not_live', cur[1], '0'}, retention_ms, what)
end
return op_remember(op, {'cancelled', cur[1], tostring(count)}, retention_ms, what)
