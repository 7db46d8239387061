#!lua
--[[ take_step: hand a ready step to a runner under a lease, or refuse it.

The runner read the entry from the stream (XREADGROUP, or XAUTOCLAIM for an entry
whose lease lapsed or whose retry is due); keys are never built in Lua, so it names
the run's hash from the entry's run id.

KEYS[1]  run hash                      realm:{wf}:run:<id>
KEYS[2]  stream the runners read       realm:{wf}:stream
KEYS[3]  key pointer (optional)        realm:{wf}:key:<key>      (after a need_key reply)
KEYS[4]  runs of this key (with 3)     realm:{wf}:keyruns:<key>
KEYS[5]  the key's queue (with 3)      realm:{wf}:queue:<key>
KEYS[6]  hash of the run first in the queue, once a `need_next` reply named it (with 3)
KEYS[7]  the workflow's queued runs (with 3)   realm:{wf}:queued

ARGV[1] the entry's id   ARGV[2] the entry's step   ARGV[3] the lease token (new)
ARGV[4] lease length in ms   ARGV[5] the runner (the group's consumer that read it)
ARGV[6] the horizon in ms: the idle time after which runners re-claim pending entries
ARGV[7] the workflow's max attempts   ARGV[8] retention in ms (for a run this fails)
ARGV[9] run id KEYS[6] is the hash of ('' = none)

Reply: {outcome, attempt, params, output, lease_until}
  taken      the step is the runner's until lease_until (server ms): attempt n of the
             step (1 on the first try), the run's params and the previous step's output
             ('' when none). A resend of this call (same token) gets the same reply.
  stale      the run ended, or is past this step (or at a newer entry of it): the entry
             is acknowledged, never handed out, and nothing runs
  leased     another runner's lease on the step has not lapsed (or its retry is not
             due yet): left alone, and not looked at again before the lease lapses
  exhausted  the lease of the step's last attempt lapsed (its runner neither reported
             nor extended it: killed, stalled, a poison payload): the run is failed
             with an error saying so, and the entry acknowledged
  need_key   nothing written: the run has an idempotency key (params says which) and
             must be failed: call again with its pointer and run set as KEYS[3], KEYS[4]
             (and its queue, KEYS[5])
  need_next  nothing written: the run is to be failed and its key's queue has a run
             waiting (params names it): call again with its hash as KEYS[6], ARGV[9]
]]

local run_key, stream, pointer, keyruns = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local entry_id, step, token, lease_ms = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local runner, horizon_ms = ARGV[5], tonumber(ARGV[6])
local max_attempts, retention_ms = tonumber(ARGV[7]), ARGV[8]
local q = pointer and {queue = KEYS[5], next = KEYS[6], queued = KEYS[7], next_id = ARGV[9] or '',
  stream = stream} or nil

local run = redis.call('HMGET', run_key,
  'id', 'phase', 'step', 'entry', 'lease', 'lease_until', 'attempt', 'params', 'output', 'key')
if not run[1] or run[2] ~= 'running' or run[3] ~= step or (run[4] and run[4] ~= entry_id) then
  ack(stream, entry_id)
  return {'stale', '0', '', '', '0'}
end
if run[5] == token then
  return {'taken', run[7], run[8], run[9] or '', run[6]}
end
local now = now_ms()
if run[6] and tonumber(run[6]) > now then
  park(stream, runner, entry_id, tonumber(run[6]), horizon_ms, now)
  return {'leased', '0', '', '', run[6]}
end
local attempt = tonumber(run[7]) or 0
if attempt >= max_attempts then
  -- No attempt is left. A failed attempt fails the run itself (step_failed.lua), so
  -- this is a lease that lapsed (or a limit lowered by a reload since the last try).
  local key = run[10] or ''
  if key ~= '' and not pointer then
    return {'need_key', '0', key, '', '0'}
  end
  local waiting = next_needed(q, pointer)
  if waiting then
    return {'need_next', '0', waiting, '', '0'}
  end
  if run[5] and run[5] ~= '' then
    redis.call('HSET', run_key, 'error', string.format(
      "the lease on step '%s' lapsed on its last attempt (%d of %d): its runner neither "
      .. 'reported nor extended it in time', step, attempt, max_attempts))
  end
  end_run(run_key, run[1], 'failed', now, retention_ms, pointer, keyruns, stream, q)
  return {'exhausted', tostring(attempt), '', '', '0'}
end
attempt = attempt + 1
local lease_until = now + lease_ms
redis.call('HSET', run_key, 'lease', token, 'lease_until', lease_until, 'attempt', attempt,
  'updated_ms', now)
park(stream, runner, entry_id, lease_until, horizon_ms, now)
return {'taken', tostring(attempt), run[8], run[9] or '', tostring(lease_until)}
