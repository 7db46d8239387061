#!lua
--[[ extend_lease: a runner still working on a step keeps it (a heartbeat).

KEYS[1]  run hash                      realm:{wf}:run:<id>
KEYS[2]  stream the runners read       realm:{wf}:stream

ARGV[1] the step   ARGV[2] lease token   ARGV[3] lease length in ms from now
ARGV[4] the runner's stream entry   ARGV[5] the horizon in ms (take_step.lua): the
entry is not looked at again before the new deadline

Reply: {outcome, phase, step, lease_until}
  extended   the lease now lasts until lease_until (server ms)
  not_found, not_live, wrong_step, lease_lost: as complete_step.lua (stop working on it)
]]

local run_key, stream = KEYS[1], KEYS[2]
local step, token, lease_ms, entry_id = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local horizon_ms = tonumber(ARGV[5])
local refused = check_report(run_key, stream, step, token, entry_id)
if refused then
  return {refused[1], refused[2], refused[3], '0'}
end
local now = now_ms()
local lease_until = now + lease_ms
redis.call('HSET', run_key, 'lease_until', lease_until)
repark(stream, redis.call('HGET', run_key, 'entry'), lease_until, horizon_ms, now)
return {'extended', 'running', step, tostring(lease_until)}
