#!lua
--[[ cancel_key: cancel the live run that an idempotency key points at.

The caller reads the pointer first to learn the run's id (keys are never built
in Lua); this script re-checks it, so a start that moved the key in between is
never cancelled by mistake.

KEYS[1]  key pointer                   realm:{wf}:key:<key>
KEYS[2]  runs of this key              realm:{wf}:keyruns:<key>
KEYS[3]  run hash the caller read      realm:{wf}:run:<id>
KEYS[4]  operation record              realm:{wf}:op:<op id>

ARGV[1] run id the caller read   ARGV[2] retention in ms

Reply: {outcome, run_id}
  cancelled   that run was live and is now cancelled
  not_live    the key's run had already ended; nothing changed
  no_key      the key points at no run (or at one that no longer exists: the
              pointer is removed, so the key is free, and the key's run set
              expires after ARGV[2])
  moved       the key now points at run_id: read it again and retry
  op_reused   the operation id already named another call (op_recall in _lib.lua)
A resend of this call (same operation record) gets the first attempt's reply.
]]

local pointer, keyruns, run_key, op = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local expected, retention_ms = ARGV[1], ARGV[2]

local what = {'cancel_key', pointer, ''}
local recalled = op_recall(op, what)
if recalled then
  return recalled
end
local cur = redis.call('HMGET', pointer, 'run', 'phase')
if not cur[1] then
  return {'no_key', ''}
end
if cur[1] ~= expected then
  return {'moved', cur[1]}
end
if not redis.call('HGET', run_key, 'id') then
  -- The pointer names a run that no longer exists: nothing is live under the key.
  redis.call('DEL', pointer)
  redis.call('ZREM', keyruns, expected)
  -- The run set was kept for as long as that run was live (no TTL); its other runs
  -- ended and expire within retention, so it expires then too, as after an ending.
  redis.call('PEXPIRE', keyruns, retention_ms)
  return {'no_key', ''}
end
if cur[2] ~= 'running' then
  return op_remember(op, {'not_live', cur[1]}, retention_ms, what)
end
end_run(run_key, expected, 'cancelled', now_ms(), retention_ms, pointer, keyruns)
return op_remember(op, {'cancelled', expected}, retention_ms, what)
