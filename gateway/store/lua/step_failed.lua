#!lua
--[[ step_failed: a runner's handler failed on a step: retry it later, or fail the run.

KEYS[1]  run hash                      realm:{wf}:run:<id>
KEYS[2]  stream the runners read       realm:{wf}:stream
KEYS[3]  operation record              realm:{wf}:op:<op id>
KEYS[4]  key pointer (optional)        realm:{wf}:key:<key>
KEYS[5]  runs of this key (with 4)     realm:{wf}:keyruns:<key>
KEYS[6]  the key's queue (with 4)      realm:{wf}:queue:<key>
KEYS[7]  hash of the run first in the queue, once a `need_next` reply named it (with 4)
KEYS[8]  the workflow's queued runs (with 4)   realm:{wf}:queued

ARGV[1] run id   ARGV[2] the step   ARGV[3] retention in ms   ARGV[4] lease token
ARGV[5] the error text   ARGV[6] max attempts   ARGV[7] backoff in ms (attempt n waits
ARGV[7] * 2^(n-1))   ARGV[8] backoff cap in ms   ARGV[9] the runner's stream entry
ARGV[10] the horizon in ms (take_step.lua): the retry is looked at when it is due
ARGV[11] run id KEYS[7] is the hash of ('' = none)

Reply: {outcome, phase, step, attempt, retry_at}
  retry       attempts are left: the lease is given up and the step is taken again
              (same entry, still pending) once retry_at (server ms) has passed
  failed      that was the last attempt: the run is now 'failed' with the error (and the
              run first in its key's queue, if any, started)
  need_next   nothing written: call again naming this run's hash in KEYS[7], ARGV[11]
  not_found, not_live, wrong_step, lease_lost: as complete_step.lua; discarded
  op_reused: as complete_step.lua; nothing written
A resend of this call (same operation record) gets the first attempt's reply.
]]

local run_key, stream, op, pointer, keyruns = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local run_id, step, retention_ms, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local error_text, max_attempts = ARGV[5], tonumber(ARGV[6])
local backoff_ms, cap_ms, entry_id = tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]
local horizon_ms = tonumber(ARGV[10])
local q = pointer and {queue = KEYS[6], next = KEYS[7], queued = KEYS[8], next_id = ARGV[11],
  stream = stream} or nil

local what = {'fail_step', run_id, step}
local recalled = op_recall(op, what)
if recalled then
  return recalled
end
local refused = check_report(run_key, stream, step, token, entry_id)
if refused then
  return {refused[1], refused[2], refused[3], '0', '0'}
end

local now = now_ms()
local attempt = tonumber(redis.call('HGET', run_key, 'attempt')) or 1
if attempt >= max_attempts then
  local waiting = next_needed(q, pointer)
  if waiting then
    return {'need_next', waiting, '', '0', '0'}
  end
end
redis.call('HSET', run_key, 'error', error_text, 'updated_ms', now)
if attempt >= max_attempts then
  end_run(run_key, run_id, 'failed', now, retention_ms, pointer, keyruns, stream, q)
  return op_remember(op, {'failed', 'failed', step, tostring(attempt), '0'}, retention_ms,
    what)
end
local retry_at = now + math.min(backoff_ms * 2 ^ (attempt - 1), cap_ms)
-- No runner holds it now; the lease's deadline is when the retry is due.
redis.call('HSET', run_key, 'lease', '', 'lease_until', retry_at)
repark(stream, redis.call('HGET', run_key, 'entry'), retry_at, horizon_ms, now)
return op_remember(op, {'retry', 'running', step, tostring(attempt), tostring(retry_at)},
  retention_ms, what)
