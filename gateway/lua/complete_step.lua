#!lua
--[[ complete_step: record that a run's current step finished; queue the next one.

KEYS[1]  run hash                      realm:{wf}:run:<id>
KEYS[2]  stream the runners read       realm:{wf}:stream
KEYS[3]  operation record              realm:{wf}:op:<op id>
KEYS[4]  key pointer (optional)        realm:{wf}:key:<key>
KEYS[5]  runs of this key (with 4)     realm:{wf}:keyruns:<key>

ARGV[1] run id   ARGV[2] the step that finished   ARGV[3] retention in ms

Reply: {outcome, phase, step}
  advanced    the run moved on to `step`, and a stream entry for it was added
  completed   that was the last step: the run is now 'completed'
  not_found   no such run (never existed, or expired)
  not_live    the run has ended (phase says how): STATE_RUN_NOT_LIVE
  wrong_step  ARGV[2] is not the current step (step names the current one)
A resend of this call (same operation record) gets the first attempt's reply.
]]

local run_key, stream, op, pointer, keyruns = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local run_id, done_step, retention_ms = ARGV[1], ARGV[2], ARGV[3]

local recalled = op_recall(op)
if recalled then
  return recalled
end

local run = redis.call('HMGET', run_key, 'id', 'phase', 'step', 'steps', 'workflow', 'params')
if not run[1] then
  return {'not_found', '', ''}
end
local phase, step = run[2], run[3]
if phase ~= 'running' then
  return {'not_live', phase, step}
end
if step ~= done_step then
  return {'wrong_step', phase, step}
end

local now = now_ms()
local steps = cjson.decode(run[4])
local next_step = nil
for i, name in ipairs(steps) do
  if name == step then
    next_step = steps[i + 1]
    break
  end
end

if next_step == nil then
  end_run(run_key, run_id, 'completed', now, retention_ms, pointer, keyruns)
  return op_remember(op, {'completed', 'completed', step}, retention_ms)
end
redis.call('HSET', run_key, 'step', next_step, 'updated_ms', now)
if pointer and redis.call('HGET', pointer, 'run') == run_id then
  redis.call('HSET', pointer, 'step', next_step)
end
redis.call('XADD', stream, '*', 'run_id', run_id, 'workflow', run[5], 'step', next_step,
  'params', run[6])
return op_remember(op, {'advanced', 'running', next_step}, retention_ms)
