#!lua
--[[ complete_step: record that a run's current step finished; queue the next one.

KEYS[1]  run hash                      realm:{wf}:run:<id>
KEYS[2]  stream the runners read       realm:{wf}:stream
KEYS[3]  operation record              realm:{wf}:op:<op id>
KEYS[4]  key pointer (optional)        realm:{wf}:key:<key>
KEYS[5]  runs of this key (with 4)     realm:{wf}:keyruns:<key>
KEYS[6]  the key's queue (with 4)      realm:{wf}:queue:<key>
KEYS[7]  hash of the run first in the queue, once a `need_next` reply named it (with 4)
KEYS[8]  the workflow's queued runs (with 4)   realm:{wf}:queued

ARGV[1] run id   ARGV[2] the step that finished   ARGV[3] retention in ms
ARGV[4] the runner's lease token ('' = an operator's report: no lease checked)
ARGV[5] the step's output (JSON text; '' = none: the next step gets null)
ARGV[6] the stream entry the runner took ('' = unknown)
ARGV[7] run id KEYS[7] is the hash of ('' = none)

Reply: {outcome, phase, step}
  advanced    the run moved on to `step`, and a stream entry for it was added
  completed   that was the last step: the run is now 'completed' (and the run first in
              its key's queue, if any, started)
  need_next   nothing written: call again naming this run's hash in KEYS[7], ARGV[7]
  not_found   no such run (never existed, or expired)
  not_live    the run has ended (phase says how): STATE_RUN_NOT_LIVE; discarded
  wrong_step  ARGV[2] is not the current step (step names the current one); discarded
  lease_lost  another runner holds a newer lease on the step; discarded
  op_reused   the operation id already named another call: {'op_reused', kind, run, step}
              (op_recall in _lib.lua); nothing written
The step's stream entry is acknowledged for the runners when the step is done or
its result discarded for good (check_report in _lib.lua).
A resend of this call (same operation record) gets the first attempt's reply.
]]

local run_key, stream, op, pointer, keyruns = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local run_id, done_step, retention_ms = ARGV[1], ARGV[2], ARGV[3]
local token, output, entry_id = ARGV[4], ARGV[5], ARGV[6]
local q = pointer and {queue = KEYS[6], next = KEYS[7], queued = KEYS[8], next_id = ARGV[7],
  stream = stream} or nil

local what = {'complete_step', run_id, done_step}
local recalled = op_recall(op, what)
if recalled then
  return recalled
end

local refused = check_report(run_key, stream, done_step, token, entry_id)
if refused then
  return refused
end

local run = redis.call('HMGET', run_key, 'steps', 'workflow', 'params', 'entry')
local now = now_ms()
local steps = cjson.decode(run[1])
local next_step = nil
for i, name in ipairs(steps) do
  if name == done_step then
    next_step = steps[i + 1]
    break
  end
end
if next_step == nil then
  local waiting = next_needed(q, pointer)
  if waiting then
    return {'need_next', waiting, ''}
  end
end
ack(stream, run[4])
-- The next step's input is this step's output: none is null, never an earlier one's.
if output ~= '' then
  redis.call('HSET', run_key, 'output', output)
else
  redis.call('HDEL', run_key, 'output')
end

if next_step == nil then
  end_run(run_key, run_id, 'completed', now, retention_ms, pointer, keyruns, nil, q)
  return op_remember(op, {'completed', 'completed', done_step}, retention_ms, what)
end
local entry = redis.call('XADD', stream, '*', 'run_id', run_id, 'workflow', run[2],
  'step', next_step, 'params', run[3])
redis.call('HSET', run_key, 'step', next_step, 'updated_ms', now, 'entry', entry,
  'attempt', 0)
redis.call('HDEL', run_key, 'lease', 'lease_until')
if pointer and redis.call('HGET', pointer, 'run') == run_id then
  redis.call('HSET', pointer, 'step', next_step)
end
return op_remember(op, {'advanced', 'running', next_step}, retention_ms, what)
