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

Reply: {outcome, run_id, phase, step, rerun_of, params_mismatch ('1' | '0')}
  created      ARGV[1] was started now, or by an earlier try of this same call
               (the caller-id check: a retry after a lost reply still wins)
  existing     deduplicated: run_id is the run that owns the key
  active       refused, STATE_RUN_ALREADY_ACTIVE (on_live_match = fail)
  used         refused, STATE_IDEMPOTENCY_KEY_USED (on_terminal_match = reject)
  conflict     refused, STATE_IDEMPOTENCY_KEY_CONFLICT (params differ, on_params_mismatch = reject)
  need_old     cancel_existing must end run_id: call again with KEYS[6] for it
Flags: the `#!lua` line makes Redis refuse the whole script under OOM before any write.
]]

local run_key, index, stream = KEYS[1], KEYS[2], KEYS[3]
local pointer, keyruns, old_key = KEYS[4], KEYS[5], KEYS[6]
local new_id, workflow, key, params, fingerprint, steps_json =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local on_live, on_terminal, on_mismatch, retention_ms = ARGV[7], ARGV[8], ARGV[9], ARGV[10]

-- Caller-id check: this exact call already committed (its reply was lost).
local mine = redis.call('HMGET', run_key, 'phase', 'step', 'rerun_of')
if mine[1] then
  return {'created', new_id, mine[1], mine[2] or '', mine[3] or '', '0'}
end

local now = now_ms()
local rerun_of = ''

if pointer then
  local cur = redis.call('HMGET', pointer, 'run', 'phase', 'step', 'fp')
  local cur_id, cur_phase, cur_step, cur_fp = cur[1], cur[2], cur[3], cur[4]
  if cur_id then
    local mismatch = (cur_fp ~= fingerprint) and '1' or '0'
    local function existing()
      if mismatch == '1' and on_mismatch == 'reject' then
        return {'conflict', cur_id, cur_phase, cur_step or '', '', mismatch}
      end
      return {'existing', cur_id, cur_phase, cur_step or '', '', mismatch}
    end
    if cur_phase == 'running' then
      if on_live == 'use_existing' then
        return existing()
      elseif on_live == 'fail' then
        return {'active', cur_id, cur_phase, cur_step or '', '', mismatch}
      end
      -- cancel_existing: end the live run and start the new one in this same call.
      if not old_key or redis.call('HGET', old_key, 'id') ~= cur_id then
        return {'need_old', cur_id, cur_phase, cur_step or '', '', mismatch}
      end
      end_run(old_key, cur_id, 'cancelled', now, retention_ms, pointer, keyruns)
    else
      if on_terminal == 'reuse' then
        return existing()
      elseif on_terminal == 'reject' then
        return {'used', cur_id, cur_phase, cur_step or '', '', mismatch}
      elseif on_terminal == 'rerun_if_failed' and cur_phase == 'completed' then
        return existing()
      end
      -- rerun, or rerun_if_failed after a failed or cancelled run.
    end
    rerun_of = cur_id
  end
end

local steps = cjson.decode(steps_json)
local first = steps[1]
redis.call('HSET', run_key,
  'id', new_id, 'workflow', workflow, 'key', key, 'phase', 'running',
  'step', first, 'steps', steps_json, 'params', params, 'fp', fingerprint,
  'created_ms', now, 'updated_ms', now, 'rerun_of', rerun_of)
redis.call('ZADD', index, next_score(index, now), new_id)
redis.call('XADD', stream, '*', 'run_id', new_id, 'workflow', workflow, 'step', first,
  'params', params)
if pointer then
  redis.call('DEL', pointer)
  redis.call('HSET', pointer, 'run', new_id, 'phase', 'running', 'step', first,
    'fp', fingerprint)
  redis.call('ZADD', keyruns, next_score(keyruns, now), new_id)
  redis.call('PERSIST', keyruns)
end
return {'created', new_id, 'running', first, rerun_of, '0'}
