#!lua
--[[ cancel_key: cancel the live run that an idempotency key points at.

The caller reads the pointer first to learn the run's id (keys are never built
in Lua); this script re-checks it, so a start that moved the key in between is
never cancelled by mistake.

KEYS[1]  key pointer                   realm:{wf}:key:<key>
KEYS[2]  runs of this key              realm:{wf}:keyruns:<key>
KEYS[3]  run hash the caller read      realm:{wf}:run:<id>

ARGV[1] run id the caller read   ARGV[2] retention in ms

Reply: {outcome, run_id}
  cancelled   that run was live and is now cancelled
  not_live    the key's run had already ended; nothing changed
  no_key      the key points at no run
  moved       the key now points at run_id: read it again and retry
]]

local pointer, keyruns, run_key = KEYS[1], KEYS[2], KEYS[3]
local expected, retention_ms = ARGV[1], ARGV[2]

local cur = redis.call('HMGET', pointer, 'run', 'phase')
if not cur[1] then
  return {'no_key', ''}
end
if cur[1] ~= expected then
  return {'moved', cur[1]}
end
if cur[2] ~= 'running' then
  return {'not_live', cur[1]}
end
end_run(run_key, expected, 'cancelled', now_ms(), retention_ms, pointer, keyruns)
return {'cancelled', expected}
