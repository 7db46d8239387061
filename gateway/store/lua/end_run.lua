#!lua
--[[ end_run: fail or cancel a run by id.

KEYS[1]  run hash                      realm:{wf}:run:<id>
KEYS[2]  operation record              realm:{wf}:op:<op id>
KEYS[3]  stream the runners read       realm:{wf}:stream
KEYS[4]  key pointer (optional)        realm:{wf}:key:<key>
KEYS[5]  runs of this key (with 4)     realm:{wf}:keyruns:<key>

ARGV[1] run id   ARGV[2] final phase: failed | cancelled
ARGV[3] retention in ms   ARGV[4] error text (recorded for failed runs; may be '')
ARGV[5] a runner's lease token ('' = an operator's call: no lease checked)

Reply: {outcome, phase}
  ended       the run was live and now has ARGV[2] as its phase
  not_live    the run had already ended (phase says how); nothing changed
  not_found   no such run (never existed, or expired)
  lease_lost  ARGV[5] is not the run's lease (another runner holds the step): nothing changed
  op_reused   the operation id already named another call (op_recall in _lib.lua)
The run's current step entry is acknowledged for the runners when it ends.
A resend of this call (same operation record) gets the first attempt's reply.
]]

local run_key, op, stream, pointer, keyruns = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local run_id, final_phase, retention_ms, error_text = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local token = ARGV[5] or ''

local what = {final_phase, run_id, ''}
local recalled = op_recall(op, what)
if recalled then
  return recalled
end

local phase = redis.call('HGET', run_key, 'phase')
if not phase then
  return {'not_found', ''}
end
if phase ~= 'running' then
  return {'not_live', phase}
end
if token ~= '' and redis.call('HGET', run_key, 'lease') ~= token then
  return {'lease_lost', phase}
end
if error_text ~= '' then
  redis.call('HSET', run_key, 'error', error_text)
end
end_run(run_key, run_id, final_phase, now_ms(), retention_ms, pointer, keyruns, stream)
return op_remember(op, {'ended', final_phase}, retention_ms, what)
