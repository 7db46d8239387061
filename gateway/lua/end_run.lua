#!lua
--[[ end_run: fail or cancel a run by id.

KEYS[1]  run hash                      realm:{wf}:run:<id>
KEYS[2]  key pointer (optional)        realm:{wf}:key:<key>
KEYS[3]  runs of this key (with 2)     realm:{wf}:keyruns:<key>

ARGV[1] run id   ARGV[2] final phase: failed | cancelled
ARGV[3] retention in ms   ARGV[4] error text (recorded for failed runs; may be '')

Reply: {outcome, phase}
  ended       the run was live and now has ARGV[2] as its phase
  not_live    the run had already ended (phase says how); nothing changed
  not_found   no such run (never existed, or expired)
]]

local run_key, pointer, keyruns = KEYS[1], KEYS[2], KEYS[3]
local run_id, final_phase, retention_ms, error_text = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

local phase = redis.call('HGET', run_key, 'phase')
if not phase then
  return {'not_found', ''}
end
if phase ~= 'running' then
  return {'not_live', phase}
end
if error_text ~= '' then
  redis.call('HSET', run_key, 'error', error_text)
end
end_run(run_key, run_id, final_phase, now_ms(), retention_ms, pointer, keyruns)
return {'ended', final_phase}
