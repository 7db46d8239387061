#!lua
--[[ start_batch: start_run for many items of one workflow in one call.

One call for the whole batch, so it is all-or-nothing: nothing else runs in Redis
between its items, and a failure before the call leaves nothing behind. The caller
sends each idempotency key at most once per call (a repeated key in a batch is
deduplicated against its first item before the call), and keyless items name their
own run hash in the pointer slots.

KEYS[1]  index of all runs (zset)            realm:{wf}:runs
KEYS[2]  stream the runners read             realm:{wf}:stream
KEYS[3]  index of the workflow's keys (zset)  realm:{wf}:keys
then 4 keys per item i (base = 3 + 4*(i-1)):
  +1 run hash of the item's NEW run          realm:{wf}:run:<new id>
  +2 key pointer (the run hash if no key)    realm:{wf}:key:<key>
  +3 runs of the key (the run hash if none)  realm:{wf}:keyruns:<key>
  +4 hash of the run the key points at, when a `need_run` reply named it (else the new run hash)

ARGV[1] workflow   ARGV[2] steps (JSON list)   ARGV[3] on_live_match
ARGV[4] on_terminal_match   ARGV[5] on_params_mismatch   ARGV[6] retention in ms
ARGV[7] the first step
ARGV[8] '1' when this call may be a resend of one that ran (see start_run.lua)
then 5 values per item i (base = 8 + 5*(i-1)):
  +1 new run id   +2 idempotency key ('' = none)   +3 params (canonical JSON)
  +4 fingerprint   +5 run id of slot +4 ('' = none)

Reply: either {'need_run', i, run_id, ...} naming, per item i, the run its key points
at (nothing was written: call again naming it in slot +4 and +5), or one 6-element
group per item, flattened: {outcome, run_id, phase, step, rerun_of, params_mismatch}
with the outcomes of start_run.lua.
]]

local workflow, steps, on_live, on_terminal, on_mismatch, retention, first, resend =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local count = (#ARGV - 8) / 5

local function item_keys(i)
  local base = 3 + 4 * (i - 1)
  local has_key = ARGV[8 + 5 * (i - 1) + 2] ~= ''
  return {
    run = KEYS[base + 1], index = KEYS[1], stream = KEYS[2], key_index = KEYS[3],
    pointer = has_key and KEYS[base + 2] or nil,
    keyruns = has_key and KEYS[base + 3] or nil,
    cur = KEYS[base + 4], markers = {},
  }
end

-- First pass, reads only: every run a repeat names must be named by the caller,
-- or nothing is written at all.
local missing = {'need_run'}
for i = 1, count do
  local k = item_keys(i)
  if needs_cur(k.pointer, ARGV[8 + 5 * (i - 1) + 5]) then
    missing[#missing + 1] = i
    missing[#missing + 1] = redis.call('HGET', k.pointer, 'run')
  end
end
if #missing > 1 then
  return missing
end

local now, now_us = server_time()
local reply = {}
for i = 1, count do
  local base = 8 + 5 * (i - 1)
  local result = claim(item_keys(i), {
    id = ARGV[base + 1], workflow = workflow, key = ARGV[base + 2], params = ARGV[base + 3],
    fp = ARGV[base + 4], steps = steps, first = first, on_live = on_live,
    on_terminal = on_terminal, on_mismatch = on_mismatch, retention = retention, seq = i,
    cur_id = ARGV[base + 5], mrun_id = '', resend = resend, marks = {},
  }, now, now_us)
  for _, v in ipairs(result) do
    reply[#reply + 1] = v
  end
end
return reply
