#!lua
--[[ extend_lease: a runner still working on a step keeps it (a heartbeat).

KEYS[1]  run hash                      realm:{wf}:run:<id>
KEYS[2]  stream the runners read       realm:{wf}:stream

ARGV[1] the step   ARGV[2] lease token   ARGV[3] lease length in ms from now
ARGV[4] the runner's stream entry

Reply: {outcome, phase, step, lease_until}
  extended   the lease now lasts until lease_until (server ms)
  not_found, not_live, wrong_step, lease_lost: as complete_step.lua (stop working on it)
]]

local run_key, stream = KEYS[1], KEYS[2]
local step, token, lease_ms, entry_id = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local refused = check_report(run_key, stream, step, token, entry_id)
if refused then
  return {refused[1], refused[2], refused[3], '0'}
end
local lease_until = now_ms() + lease_ms
redis.call('HSET', run_key, 'lease_until', lease_until)
return {'extended', 'running', step, tostring(lease_until)}
