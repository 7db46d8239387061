#!lua
--[[ start_run: claim an idempotency key and start a run, or return the run that owns it.

KEYS[1]  run hash of the NEW run            realm:{wf}:run:<new id>
KEYS[2]  index of all runs (zset, by start)  realm:{wf}:runs
KEYS[3]  stream the runners read            realm:{wf}:stream
KEYS[4]  key pointer (hash)                 realm:{wf}:key:<key>       (KEYS[1] if no key)
KEYS[5]  runs of this key (zset)            realm:{wf}:keyruns:<key>   (KEYS[1] if no key)
KEYS[6]  run hash the pointer names, after a `need_run` reply named it  (else KEYS[1])
KEYS[7]  run hash a marker names, after a `need_run` reply named it     (else KEYS[1])
KEYS[8]  index of the workflow's keys (zset, by last claim)  realm:{wf}:keys
KEYS[9]  the key's queue (zset, by arrival)  realm:{wf}:queue:<key>   (KEYS[1] if no key)
KEYS[10] run hash waiting in the queue, after a `need_run` reply named it (else KEYS[1])
KEYS[11] the workflow's queued runs (zset)  realm:{wf}:queued
KEYS[12] the workflow's scheduled runs (zset, by due ms)  realm:{wf}:due
KEYS[13…] markers (strings): realm:{wf}:event:…, realm:{wf}:body:…, realm:{wf}:request:…,
         realm:{wf}:order:<entity>, realm:{wf}:rate:<n>:<trigger>:<window>

ARGV[1] new run id (chosen by the caller)   ARGV[2] workflow
ARGV[3] idempotency key ('' = none)         ARGV[4] params (canonical JSON)
ARGV[5] params fingerprint                  ARGV[6] steps (JSON list)
ARGV[7] on_live_match   use_existing | fail | cancel_existing
ARGV[8] on_terminal_match   reuse | reject | rerun_if_failed | rerun
ARGV[9] on_params_mismatch  flag | reject
ARGV[10] retention in ms (for a run this call ends, and for the markers)
ARGV[11] the workflow's first step (ARGV[6][1], sent apart to spare a JSON decode)
ARGV[12] run id KEYS[6] is the hash of ('' = none)
ARGV[13] run id KEYS[7] is the hash of ('' = none)
ARGV[14] '1' when this call may be a resend of one that ran (its reply lost, or a run
         id the caller chose): only then is KEYS[1] looked at, the caller-id check
ARGV[15] the start's flow ('' = none): 'limit max keep debounce_ms max_wait_ms delay_ms'
         (parse_flow in _lib.lua)
ARGV[16] run id KEYS[10] is the hash of ('' = none)
then 2 per marker: mode (same | dedupe | replay | order | rate), tag

Reply: {outcome, run_id, phase, step, rerun_of, params_mismatch ('1' | '0')[, due_ms]}
  created      ARGV[1] was started now, or by an earlier try of this same call
               (the caller-id check: a retry after a lost reply still wins); or, for a
               request-id marker, the run the first call with that id started
  existing     deduplicated: run_id is the run that owns the key, or that this event
               (or this body, under another event id) was given before
  active       refused, STATE_RUN_ALREADY_ACTIVE (on_live_match = fail)
  used         refused, STATE_IDEMPOTENCY_KEY_USED (on_terminal_match = reject)
  conflict     refused, STATE_IDEMPOTENCY_KEY_CONFLICT (params differ, on_params_mismatch = reject)
  stale        refused, STATE_EVENT_STALE: an event of the same entity that is not older
               started a run (phase holds the entity's mark); nothing written
  queued       ARGV[1] was created in phase 'queued', behind the key's live runs
               (on_live_match = queue); it starts when one of them ends
  scheduled    ARGV[1] was created in phase 'scheduled' (debounce, delay), or, debounced,
               run_id is the key's scheduled run, which took this start's params; due_ms
               is when its first step goes to the runners
  queue_full   refused, STATE_QUEUE_FULL: the key's queue holds its max (phase: how many)
  rate_limited refused, STATE_RATE_LIMITED: the trigger's rate limit window is full
               (phase holds the ms until it has room); nothing written
  need_run     nothing written: call again naming run_id's hash; phase says which slot:
               'pointer' (KEYS[6], ARGV[12]), 'marker' (KEYS[7], ARGV[13]) or 'queued'
               (KEYS[10], ARGV[16]: keep newest cancels the run that waits). Keys are
               never built here
The decision itself is `claim` in _lib.lua, shared with start_batch.lua.
Flags: the `#!lua` line makes Redis refuse the whole script under OOM before any write.
]]

local has_key = ARGV[3] ~= ''
local markers, marks = {}, {}
for i = 13, #KEYS do
  markers[#markers + 1] = KEYS[i]
  marks[#marks + 1] = {mode = ARGV[17 + 2 * (i - 13)], tag = ARGV[18 + 2 * (i - 13)]}
end
local now, now_us = server_time()
return claim(
  {run = KEYS[1], index = KEYS[2], stream = KEYS[3],
   pointer = has_key and KEYS[4] or nil, keyruns = has_key and KEYS[5] or nil,
   key_index = KEYS[8], cur = KEYS[6], mrun = KEYS[7], markers = markers,
   queue = KEYS[9], qrun = KEYS[10], queued = KEYS[11], due = KEYS[12]},
  {id = ARGV[1], workflow = ARGV[2], key = ARGV[3], params = ARGV[4], fp = ARGV[5],
   steps = ARGV[6], on_live = ARGV[7], on_terminal = ARGV[8], on_mismatch = ARGV[9],
   retention = ARGV[10], first = ARGV[11], seq = 0, cur_id = ARGV[12], mrun_id = ARGV[13],
   resend = ARGV[14], flow = parse_flow(ARGV[15]), qrun_id = ARGV[16], marks = marks},
  now, now_us)
