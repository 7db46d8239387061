#!lua
--[[ start_run: claim an idempotency key and start a run, or return the run that owns it.

KEYS[1]  run hash of the NEW run            realm:{wf}:run:<new id>
KEYS[2]  index of all runs (zset, by start)  realm:{wf}:runs
KEYS[3]  stream the runners read            realm:{wf}:stream
KEYS[4]  key pointer (hash; optional)       realm:{wf}:key:<key>
KEYS[5]  runs of this key (zset; with 4)  realm:{wf}:keyruns:<key>
KEYS[6]  run hash of the CURRENT run (optional; only for cancel_existing, after a
         `need_old` reply named it)        realm:{wf}:run:<old id>

ARGV[1] new run id (chosen by the caller)   ARGV[2] workflow
ARGV[3] idempotency key ('' = none)         ARGV[4] params (canonical JSON)
ARGV[5] params fingerprint                  ARGV[6] steps (JSON list)
ARGV[7] on_live_match   use_existing | fail | cancel_existing
ARGV[8] on_terminal_match   reuse | reject | rerun_if_failed | rerun
ARGV[9] on_params_mismatch  flag | reject
ARGV[10] retention in ms (for a run this call ends)
ARGV[11] the workflow's first step (ARGV[6][1], sent apart to spare a JSON decode)

Reply: {outcome, run_id, phase, step, rerun_of, params_mismatch ('1' | '0')}
  created      ARGV[1] was started now, or by an earlier try of this same call
               (the caller-id check: a retry after a lost reply still wins)
  existing     deduplicated: run_id is the run that owns the key
  active       refused, STATE_RUN_ALREADY_ACTIVE (on_live_match = fail)
  used         refused, STATE_IDEMPOTENCY_KEY_USED (on_terminal_match = reject)
  conflict     refused, STATE_IDEMPOTENCY_KEY_CONFLICT (params differ, on_params_mismatch = reject)
  need_old     cancel_existing must end run_id: call again with KEYS[6] for it
The decision itself is `claim` in _lib.lua, shared with start_batch.lua.
Flags: the `#!lua` line makes Redis refuse the whole script under OOM before any write.
]]

local now, now_us = server_time()
return claim(
  {run = KEYS[1], index = KEYS[2], stream = KEYS[3], pointer = KEYS[4], keyruns = KEYS[5],
   old = KEYS[6]},
  {id = ARGV[1], workflow = ARGV[2], key = ARGV[3], params = ARGV[4], fp = ARGV[5],
   steps = ARGV[6], on_live = ARGV[7], on_terminal = ARGV[8], on_mismatch = ARGV[9],
   retention = ARGV[10], first = ARGV[11], seq = 0},
  now, now_us)
