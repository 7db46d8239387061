-- Shared helpers, prepended by gateway/scripts.py to every script after its
-- `#!lua` line, so each operation stays one atomic file without copying these.

-- Server time in milliseconds: every gateway replica agrees on it.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A score for a new member of a run index: the server time in microseconds,
-- nudged past the newest member so that "newest" never depends on a clock tie.
local function next_score(zset, now)
  local score = now * 1000
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
