#!lua
--[[ start_due: start a scheduled run (debounce, delay) once its due time has come.

Called by the sweep of any `realm listen` process for the runs it read from the due
index: the phase is checked here, so however many sweeps call it for one run, its
first step is handed to the runners once.

KEYS[1]  the workflow's scheduled runs (zset, by due ms)  realm:{wf}:due
KEYS[2]  run hash                      realm:{wf}:run:<id>
KEYS[3]  stream the runners read       realm:{wf}:stream
KEYS[4]  key pointer (optional)        realm:{wf}:key:<key>

ARGV[1] run id

Reply: {outcome, ms}
  started        its first step went to the runners; ms: how late, by the server's clock
  not_due        its due time moved on (a debounced start): ms is the new due time
  not_scheduled  it started, was cancelled or is gone: it left the due index
  need_key       nothing written: the run has a key (ms holds it): call again with its
                 pointer as KEYS[4]
]]

local due, run_key, stream, pointer = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local run_id = ARGV[1]

local run = redis.call('HMGET', run_key, 'phase', 'due_ms', 'workflow', 'step', 'params', 'key')
if run[1] ~= 'scheduled' then
  redis.call('ZREM', due, run_id)
  return {'not_scheduled', '0'}
end
local now = now_ms()
local due_ms = tonumber(run[2]) or now
if due_ms > now then
  redis.call('ZADD', due, due_ms, run_id)
  return {'not_due', tostring(due_ms)}
end
if (run[6] or '') ~= '' and not pointer then
  return {'need_key', run[6]}
end
local entry = redis.call('XADD', stream, '*', 'run_id', run_id, 'workflow', run[3],
  'step', run[4], 'params', run[5])
redis.call('HSET', run_key, 'phase', 'running', 'entry', entry, 'updated_ms', now,
  'started_ms', now)
redis.call('ZREM', due, run_id)
if pointer and redis.call('HGET', pointer, 'run') == run_id then
  redis.call('HSET', pointer, 'phase', 'running')
end
return {'started', tostring(now - due_ms)}
