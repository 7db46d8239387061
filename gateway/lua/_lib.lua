-- Shared helpers, prepended by gateway/scripts.py to every script after its
-- `#!lua` line, so each operation stays one atomic file without copying these.

-- Server time, in milliseconds and in microseconds: every gateway replica agrees on it.
local function server_time()
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return math.floor(us / 1000), us
end

local function now_ms()
  return (server_time())
end

-- A score for a new member of a key's run set: the server time in microseconds,
-- nudged past the newest member so that the key's "newest run" (what reconcile
-- points the key at) never depends on a clock tie or a clock set back.
local function next_score(zset, now_us)
  local score = now_us
  local top = redis.call('ZRANGE', zset, -1, -1, 'WITHSCORES')
  if top[2] and tonumber(top[2]) >= score then
    score = tonumber(top[2]) + 1
  end
  return score
end

-- End a live run: record its final phase, mirror it on the key pointer when
-- the pointer still names this run, and start the retention clock on both.
-- `pointer` and `keyruns` may be nil for a run started without a key.
local function end_run(run_key, run_id, phase, now, retention_ms, pointer, keyruns)
  redis.call('HSET', run_key, 'phase', phase, 'updated_ms', now, 'ended_ms', now)
  redis.call('PEXPIRE', run_key, retention_ms)
  if pointer and redis.call('HGET', pointer, 'run') == run_id then
    redis.call('HSET', pointer, 'phase', phase)
    redis.call('PEXPIRE', pointer, retention_ms)
    redis.call('PEXPIRE', keyruns, retention_ms)
  end
end

-- Does a cancel_existing start have to be called again naming the live run's
-- hash (`old_key`)? Keys are never built here, so the caller names it.
local function needs_old(pointer, old_key, on_live)
  if not pointer or on_live ~= 'cancel_existing' then
    return false
  end
  local cur = redis.call('HMGET', pointer, 'run', 'phase')
  if not cur[1] or cur[2] ~= 'running' then
    return false
  end
  return (not old_key) or redis.call('HGET', old_key, 'id') ~= cur[1]
end

-- The claim of DESIGN §3 for one start: decide from the key pointer, and
-- when the decision is a new run, write the run, its indexes, the pointer
-- and the stream entry for the runners, all in this one script call.
-- k: run, index, stream, pointer (nil without a key), keyruns, old (or nil)
-- a: id, workflow, key, params, fp, steps, first (step), on_live, on_terminal,
--    on_mismatch, retention, seq (the item's place in a batch; 0 alone)
-- now: server time in ms; now_us: in microseconds.
-- Returns {outcome, run_id, phase, step, rerun_of, params_mismatch}; see start_run.lua.
local function claim(k, a, now, now_us)
  -- Caller-id check: this exact start already committed (its reply was lost).
  local mine = redis.call('HMGET', k.run, 'phase', 'step', 'rerun_of')
  if mine[1] then
    return {'created', a.id, mine[1], mine[2] or '', mine[3] or '', '0'}
  end

  local rerun_of = ''
  if k.pointer then
    local cur = redis.call('HMGET', k.pointer, 'run', 'phase', 'step', 'fp')
    local cur_id, cur_phase, cur_step = cur[1], cur[2], cur[3] or ''
    if cur_id then
      local mismatch = (cur[4] ~= a.fp) and '1' or '0'
      local existing = 'existing'
      if mismatch == '1' and a.on_mismatch == 'reject' then
        existing = 'conflict'
      end
      local refusal = nil
      if cur_phase == 'running' then
        if a.on_live == 'use_existing' then
          refusal = existing
        elseif a.on_live == 'fail' then
          refusal = 'active'
        elseif not k.old or redis.call('HGET', k.old, 'id') ~= cur_id then
          refusal = 'need_old'
        else
          -- cancel_existing: end the live run and start the new one right here.
          end_run(k.old, cur_id, 'cancelled', now, a.retention, k.pointer, k.keyruns)
        end
      elseif a.on_terminal == 'reuse' then
        refusal = existing
      elseif a.on_terminal == 'reject' then
        refusal = 'used'
      elseif a.on_terminal == 'rerun_if_failed' and cur_phase == 'completed' then
        refusal = existing
      end
      -- Otherwise: rerun, or rerun_if_failed after a failed or cancelled run.
      if refusal then
        return {refusal, cur_id, cur_phase, cur_step, '', mismatch}
      end
      rerun_of = cur_id
    end
  end

  local first = a.first
  redis.call('HSET', k.run,
    'id', a.id, 'workflow', a.workflow, 'key', a.key, 'phase', 'running',
    'step', first, 'steps', a.steps, 'params', a.params, 'fp', a.fp,
    'created_ms', now, 'updated_ms', now, 'rerun_of', rerun_of)
  -- The workflow's index orders listings only: the time (unique per script call,
  -- which takes more than a microsecond) plus the item's place in its batch.
  redis.call('ZADD', k.index, now_us + a.seq, a.id)
  redis.call('XADD', k.stream, '*', 'run_id', a.id, 'workflow', a.workflow, 'step', first,
    'params', a.params)
  if k.pointer then
    if rerun_of ~= '' then
      -- The old pointer may carry a TTL (its run ended): start it afresh. A key
      -- seen for the first time has no pointer to delete.
      redis.call('DEL', k.pointer)
    end
    redis.call('HSET', k.pointer, 'run', a.id, 'phase', 'running', 'step', first, 'fp', a.fp)
    redis.call('ZADD', k.keyruns, next_score(k.keyruns, now_us + a.seq), a.id)
    redis.call('PERSIST', k.keyruns)
  end
  return {'created', a.id, 'running', first, rerun_of, '0'}
end
