#!lua
--[[ take_step: hand a ready step to a runner under a lease, or refuse it.

The runner read the entry from the stream (XREADGROUP, or XAUTOCLAIM for an entry
whose lease lapsed or whose retry is due); keys are never built in Lua, so it names
the run's hash from the entry's run id.

KEYS[1]  run hash                      realm:{wf}:run:<id>
KEYS[2]  stream the runners read       realm:{wf}:stream

ARGV[1] the entry's id   ARGV[2] the entry's step   ARGV[3] the lease token (new)
ARGV[4] lease length in ms

Reply: {outcome, attempt, params, output, lease_until}
  taken    the step is the runner's until lease_until (server ms): attempt n of the
           step (1 on the first try), the run's params and the previous step's output
           ('' when none). A resend of this call (same token) gets the same reply.
  stale    the run ended, or is past this step (or at a newer entry of it): the entry
           is acknowledged, never handed out, and nothing runs
  leased   another runner's lease on the step has not lapsed (or its retry is not
           due yet): left alone
]]

local run_key, stream = KEYS[1], KEYS[2]
local entry_id, step, token, lease_ms = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])

local run = redis.call('HMGET', run_key,
  'id', 'phase', 'step', 'entry', 'lease', 'lease_until', 'attempt', 'params', 'output')
if not run[1] or run[2] ~= 'running' or run[3] ~= step or (run[4] and run[4] ~= entry_id) then
  ack(stream, entry_id)
  return {'stale', '0', '', '', '0'}
end
if run[5] == token then
  return {'taken', run[7], run[8], run[9] or '', run[6]}
end
local now = now_ms()
if run[6] and tonumber(run[6]) > now then
  return {'leased', '0', '', '', run[6]}
end
local attempt = (tonumber(run[7]) or 0) + 1
local lease_until = now + lease_ms
redis.call('HSET', run_key, 'lease', token, 'lease_until', lease_until, 'attempt', attempt,
  'updated_ms', now)
return {'taken', tostring(attempt), run[8], run[9] or '', tostring(lease_until)}
