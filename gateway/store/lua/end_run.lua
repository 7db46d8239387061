#!lua
--[[ end_run: fail or cancel a run by id.

KEYS[1]  run hash                      realm:{wf}:run:<id>
KEYS[2]  operation record              realm:{wf}:op:<op id>
KEYS[3]  stream the runners read       realm:{wf}:stream
KEYS[4]  the workflow's scheduled runs  realm:{wf}:due
KEYS[5]  key pointer (optional)        realm:{wf}:key:<key>
KEYS[6]  runs of this key (with 5)     realm:{wf}:keyruns:<key>
KEYS[7]  the key's queue (with 5)      realm:{wf}:queue:<key>
KEYS[8]  hash of the run first in the queue, once a `need_next` reply named it (with 5)
KEYS[9]  the workflow's queued runs (with 5)   realm:{wf}:queued

ARGV[1] run id   ARGV[2] final phase: failed | cancelled
ARGV[3] retention in ms   ARGV[4] error text (recorded for failed runs; may be '')
ARGV[5] a runner's lease token ('' = an operator's call: no lease checked)
ARGV[6] run id KEYS[8] is the hash of ('' = none)

Reply: {outcome, phase}
  ended       the run was live (or waiting: queued, scheduled) and now has ARGV[2] as
              its phase; a run waiting in its key's queue took the place it freed
  need_next   nothing written: call again naming this run's hash in KEYS[8], ARGV[6]
  not_live    the run had already ended (phase says how); nothing changed
  not_found   no such run (never existed, or expired)
  lease_lost  ARGV[5] is not the run's lease (another runner holds the step): nothing changed
  op_reused   the operation id already named another call (op_recall in _lib.lua)
The run's current step entry is acknowledged for the runners when it ends.
A resend of this call (same operation record) gets the first attempt's reply.
]]

local run_key, op, stream, due, pointer, keyruns = KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  KEYS[5], KEYS[6]
local run_id, final_phase, retention_ms, error_text = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local token = ARGV[5] or ''
local q = pointer and {queue = KEYS[7], next = KEYS[8], queued = KEYS[9], next_id = ARGV[6],
  stream = stream} or nil

local what = {final_phase, run_id, ''}
local recalled = op_recall(op, what)
if recalled then
  return recalled
end

local phase = redis.call('HGET', run_key, 'phase')
if not phase then
  return {'not_found', ''}
end
if phase == 'queued' or phase == 'scheduled' then
  -- Never started: it leaves its queue, or the due index.
  if error_text ~= '' then
    redis.call('HSET', run_key, 'error', error_text)
  end
  end_waiting(run_key, run_id, final_phase, now_ms(), retention_ms, pointer, keyruns, q, due)
  return op_remember(op, {'ended', final_phase}, retention_ms, what)
end
if phase ~= 'running' then
  return {'not_live', phase}
end
if token ~= '' and redis.call('HGET', run_key, 'lease') ~= token then
  return {'lease_lost', phase}
end
local waiting = next_needed(q, pointer)
if waiting then
  return {'need_next', waiting}
end
if error_text ~= '' then
  redis.call('HSET', run_key, 'error', error_text)
end
end_run(run_key, run_id, final_phase, now_ms(), retention_ms, pointer, keyruns, stream, q)
return op_remember(op, {'ended', final_phase}, retention_ms, what)
