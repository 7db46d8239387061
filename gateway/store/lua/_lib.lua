-- Shared helpers, prepended by gateway/store/scripts.py to every script after its
-- `#!lua` line, so each operation stays one atomic file without copying these.

-- The consumer group of the runners on every stream (gateway/store/runstore.py take_steps).
local RUNNERS_GROUP = 'runners'

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

-- Operation ids: a mutating call names a key of its own, realm:{wf}:op:<id>,
-- and records its reply there. The store resends a call whose reply was lost; the
-- resend finds the record and reports what the first attempt did, not what a second
-- decision would say now. Kept for OP_TTL_MS: longer than any resend, and short enough
-- that the records of a busy gateway stay small; never longer than the workflow's
-- retention, after which the run itself is gone and a resend learns that instead.
--
-- An id names one call: the record keeps `what` the call was ({kind, run or key,
-- step}), and the same id sent with another `what` is refused (op_recall answers
-- {'op_reused', kind, run or key, step}: STATE_REQUEST_ID_REUSED), never answered
-- with the first call's reply, which would acknowledge it without effect.
local OP_TTL_MS = 120000

local function op_recall(op_key, what)
  if not op_key or op_key == '' then
    return nil
  end
  local stored = redis.call('GET', op_key)
  if not stored then
    return nil
  end
  local record = cjson.decode(stored)
  if record.r == nil then
    return record  -- written by an older version: the reply alone
  end
  local was = record.w
  if what then
    for i = 1, 3 do
      if (was[i] or '') ~= (what[i] or '') then
        return {'op_reused', was[1] or '', was[2] or '', was[3] or ''}
      end
    end
  end
  return record.r
end

local function op_remember(op_key, reply, retention_ms, what)
  if op_key and op_key ~= '' then
    local ttl = math.min(OP_TTL_MS, tonumber(retention_ms) or OP_TTL_MS)
    redis.call('SET', op_key, cjson.encode({r = reply, w = what or {}}), 'PX', ttl)
  end
  return reply
end

-- A key's runs under on_live_match 'queue': its pointer lists the live ones ('live': their
-- ids, space-separated, oldest first) and how many may be live at once ('limit'); the
-- runs waiting behind them are its queue (realm:{wf}:queue:<key>, scored by arrival),
-- and the workflow's queued index (realm:{wf}:queued) lists every waiting run.
local function count_ids(ids)
  local n = 0
  for _ in string.gmatch(ids, '%S+') do
    n = n + 1
  end
  return n
end

local function without_id(ids, id)
  local kept = {}
  for other in string.gmatch(ids, '%S+') do
    if other ~= id then
      kept[#kept + 1] = other
    end
  end
  return table.concat(kept, ' ')
end

-- Before a script that may end a running run of a key writes anything: the id of the
-- run its ending would start (the first of the key's queue) when the caller did not
-- name its hash (q.next_id), else nil. Keys are never built here: the caller calls again
-- naming it (one more round trip, only when a run waits).
-- q: {queue, queued, next (the hash named), next_id, stream}, nil for a run without key.
local function next_needed(q, pointer)
  if not q or not redis.call('HGET', pointer, 'live') then
    return nil
  end
  local head = redis.call('ZRANGE', q.queue, 0, 0)[1]
  if head and head ~= q.next_id then
    return head
  end
  return nil
end

-- Start the run first in the key's queue (its hash named: see next_needed): its first
-- step goes to the runners, and the key points at it. Its id, or nil when none waits.
local function start_next(q, pointer, keyruns, now)
  local head = redis.call('ZRANGE', q.queue, 0, 0)[1]
  if not head or head ~= q.next_id then
    return nil
  end
  redis.call('ZREM', q.queue, head)
  redis.call('ZREM', q.queued, head)
  local run = redis.call('HMGET', q.next, 'phase', 'workflow', 'step', 'params', 'fp')
  if run[1] ~= 'queued' then
    return nil  -- its hash is gone (deleted by hand): the next ending starts the one after
  end
  local entry = redis.call('XADD', q.stream, '*', 'run_id', head, 'workflow', run[2],
    'step', run[3], 'params', run[4])
  redis.call('HSET', q.next, 'phase', 'running', 'updated_ms', now, 'started_ms', now,
    'entry', entry)
  redis.call('HSET', pointer, 'run', head, 'phase', 'running', 'step', run[3], 'fp', run[5])
  redis.call('PERSIST', pointer)
  redis.call('ZADD', keyruns, next_score(keyruns, select(2, server_time())), head)
  redis.call('PERSIST', keyruns)
  return head
end

-- End a live (or waiting) run: record its final phase, mirror it on the key pointer when
-- the pointer still names this run, and start the retention clock on both.
-- `pointer` and `keyruns` may be nil for a run started without a key. With the
-- `stream`, the entry of the step it was at is acknowledged for the runners: no
-- step of an ended run is handed out (take_step.lua refuses one anyway). A run of a
-- queued key frees its place: with `q`, the first waiting run starts in its stead;
-- the key and its run set keep no TTL while any of its runs is live.
local function end_run(run_key, run_id, phase, now, retention_ms, pointer, keyruns, stream, q)
  if stream then
    local entry = redis.call('HGET', run_key, 'entry')
    if entry then
      redis.call('XACK', stream, RUNNERS_GROUP, entry)
    end
  end
  redis.call('HSET', run_key, 'phase', phase, 'updated_ms', now, 'ended_ms', now)
  redis.call('HDEL', run_key, 'lease', 'lease_until')
  redis.call('PEXPIRE', run_key, retention_ms)
  if not pointer then
    return
  end
  local held = redis.call('HMGET', pointer, 'run', 'live', 'limit')
  if held[2] then
    local live = without_id(held[2], run_id)
    local started = nil
    if q and count_ids(live) < (tonumber(held[3]) or 1) then
      started = start_next(q, pointer, keyruns, now)
    end
    if started then
      live = live == '' and started or (live .. ' ' .. started)
    end
    redis.call('HSET', pointer, 'live', live)
    if started then
      return
    end
    if held[1] == run_id then
      redis.call('HSET', pointer, 'phase', phase)
    end
    if live == '' then
      -- The key's last live run ended (the pointer's, or one started beside it): the
      -- key's retention starts now.
      redis.call('PEXPIRE', pointer, retention_ms)
      redis.call('PEXPIRE', keyruns, retention_ms)
    end
    return
  end
  if held[1] == run_id then
    redis.call('HSET', pointer, 'phase', phase)
    redis.call('PEXPIRE', pointer, retention_ms)
    redis.call('PEXPIRE', keyruns, retention_ms)
  end
end

-- End a run that waits (queued or scheduled) and never started: it leaves its queue or
-- the due index; a scheduled run's key says it was cancelled.
local function end_waiting(run_key, run_id, phase, now, retention_ms, pointer, keyruns, q, due)
  if q then
    redis.call('ZREM', q.queue, run_id)
    redis.call('ZREM', q.queued, run_id)
  end
  if due then
    redis.call('ZREM', due, run_id)
  end
  redis.call('HSET', run_key, 'phase', phase, 'updated_ms', now, 'ended_ms', now)
  redis.call('PEXPIRE', run_key, retention_ms)
  local held = pointer and redis.call('HMGET', pointer, 'run', 'live')
  if held and held[1] == run_id then
    redis.call('HSET', pointer, 'phase', phase)
    if (held[2] or '') == '' then
      redis.call('PEXPIRE', pointer, retention_ms)
      redis.call('PEXPIRE', keyruns, retention_ms)
    end
  end
end

local function ack(stream, entry)
  if entry and entry ~= '' then
    redis.call('XACK', stream, RUNNERS_GROUP, entry)
  end
end

-- A step's stream entry while a lease (or a retry's wait) runs until `until_ms`:
-- its idle time is set so that it reaches `horizon_ms`, the idle time after which
-- runners look at pending entries again (XAUTOCLAIM), when the lease lapses, and not
-- before. So the steps runners hold are never re-claimed while their leases are
-- valid, however many there are. Redis keeps a delivery time in the future at now:
-- a lease longer than the horizon is looked at (and found held) once per horizon.
local function park(stream, consumer, entry, until_ms, horizon_ms, now)
  local delivered = math.max(0, math.min(now, until_ms - horizon_ms))
  redis.call('XCLAIM', stream, RUNNERS_GROUP, consumer, 0, entry, 'TIME', delivered, 'JUSTID')
end

-- `park` for an entry whose consumer the caller does not know (a heartbeat, a retry).
local function repark(stream, entry, until_ms, horizon_ms, now)
  if not entry or entry == '' then
    return
  end
  local found = redis.call('XPENDING', stream, RUNNERS_GROUP, entry, entry, 1)
  if found[1] then
    park(stream, found[1][2], entry, until_ms, horizon_ms, now)
  end
end

-- May a report on `step` of a run be recorded (complete_step, step_failed,
-- extend_lease, end_run with a lease)? nil if so, else the refusal
-- {outcome, phase, step}. A report on a run that ended, or that moved past the step,
-- is discarded and the reporter's stream entry (`entry_id`) acknowledged: nothing is
-- left to do for it. A report under a lease (`token`; '' = an operator's, unleased)
-- that is no longer the run's is discarded too, and the entry left to the runner
-- that holds the newer lease.
local function check_report(run_key, stream, step, token, entry_id)
  local run = redis.call('HMGET', run_key, 'id', 'phase', 'step', 'lease', 'entry')
  if not run[1] then
    return {'not_found', '', ''}
  end
  if run[2] ~= 'running' then
    ack(stream, entry_id)
    ack(stream, run[5])
    return {'not_live', run[2], run[3]}
  end
  if step ~= '' and run[3] ~= step then
    if entry_id ~= run[5] then
      ack(stream, entry_id)
    end
    return {'wrong_step', run[2], run[3]}
  end
  if token ~= '' and run[4] ~= token then
    return {'lease_lost', run[2], run[3]}
  end
  return nil
end

-- Does an item of a batch have to be called again naming the hash of the run its
-- key points at (`cur_id`, the id the caller named, '' if none)? Keys are never
-- built here, so the caller names it; see `claim`.
local function needs_cur(pointer, cur_id)
  if not pointer then
    return false
  end
  local held = redis.call('HGET', pointer, 'run')
  return held ~= false and held ~= cur_id
end

-- Superseded runs of one key kept in its run set: a key rerun forever while always
-- live (a cancel_existing singleton) must not grow without bound. Older members are
-- dropped from the set (their run hashes expire on their own).
local KEYRUNS_KEEP = 1000

-- Markers are strings: the run, the outcome, the run it reran and the tag (the event id
-- a replay guard's body came with), one per line, the tag last: only it may hold a
-- newline. One SET places, reads and dates a marker at once (an earlier version kept
-- hashes: those are still read, and a write replaces them).
local function marker_value(run_id, outcome, rerun_of, tag)
  return run_id .. '\n' .. outcome .. '\n' .. rerun_of .. '\n' .. tag
end

-- Place `value` at `marker` unless one is there: nil when placed, else what was there
-- as {run, outcome, rerun_of, tag}.
local function place_marker(marker, value, retention)
  local got = redis.pcall('SET', marker, value, 'NX', 'GET', 'PX', retention)
  if type(got) == 'table' and got.err then
    if not string.find(got.err, 'WRONGTYPE', 1, true) then
      error(got)
    end
    return redis.call('HMGET', marker, 'run', 'outcome', 'rerun_of', 'tag')
  end
  if not got then
    return nil
  end
  local a = string.find(got, '\n', 1, true)
  local b = string.find(got, '\n', a + 1, true)
  local c = string.find(got, '\n', b + 1, true)
  return {string.sub(got, 1, a - 1), string.sub(got, a + 1, b - 1),
          string.sub(got, b + 1, c - 1), string.sub(got, c + 1)}
end

-- An ordered trigger's delivery (marker mode 'order', tag 'number rank ties text')
-- against its entity's mark ('number rank text', the highest that started a run): the
-- mark's text when the delivery is stale (lower, or equal with ties 'refuse'), else nil.
local function stale_against(mark_key, tag)
  local held = redis.call('GET', mark_key)
  if not held then
    return nil
  end
  local n, r, ties = string.match(tag, '^(%S+) (%S+) (%S+) ')
  local hn, hr, htext = string.match(held, '^(%S+) (%S+) (.*)$')
  n, r, hn, hr = tonumber(n), tonumber(r), tonumber(hn), tonumber(hr)
  if n > hn or (n == hn and (r > hr or (r == hr and ties == 'accept'))) then
    return nil
  end
  return htext
end

-- A rate limit's window (marker mode 'rate', tag 'limit period_ms'): a sorted set of
-- the runs it let start, scored by their start (ms). Entries a period old leave first.
-- The ms until the window has room when it is full, else nil.
local function window_full(window, tag, now)
  local limit, period = string.match(tag, '^(%d+) (%d+)$')
  limit, period = tonumber(limit), tonumber(period)
  redis.call('ZREMRANGEBYSCORE', window, '-inf', now - period)
  if redis.call('ZCARD', window) < limit then
    return nil
  end
  local oldest = redis.call('ZRANGE', window, 0, 0, 'WITHSCORES')
  return math.max(tonumber(oldest[2]) + period - now, 1)
end

-- The entity's mark once a run started: the delivery's number, rank and text.
local function order_mark(tag)
  local n, r, text = string.match(tag, '^(%S+) (%S+) %S+ (.*)$')
  return n .. ' ' .. r .. ' ' .. text
end

-- Write the markers of a start that was decided (a run started or deduplicated):
-- a redelivery of the same event, a replayed body or a retried request finds them.
-- `done[i]`: marker i already holds this decision (placed by this call as it). An
-- entity's order mark moves only when a run starts.
local function mark(k, a, outcome, run_id, rerun_of, done)
  for i, marker in ipairs(k.markers) do
    local mode = a.marks[i].mode
    if mode == 'order' then
      if outcome == 'created' or outcome == 'debounced' then
        redis.call('SET', marker, order_mark(a.marks[i].tag), 'PX', a.retention)
      end
    elseif mode == 'rate' then
      if outcome == 'created' then
        local period = string.match(a.marks[i].tag, ' (%d+)$')
        redis.call('ZADD', marker, a.now, run_id)
        redis.call('PEXPIRE', marker, period)
      end
    elseif not done[i] then
      redis.call('SET', marker, marker_value(run_id, outcome, rerun_of, a.marks[i].tag),
        'PX', a.retention)
    end
  end
end

-- Take back the markers this call placed or found gone (`placed`): it decided nothing.
local function unmark(k, placed)
  for i, marker in ipairs(k.markers) do
    if placed[i] then
      redis.call('DEL', marker)
    end
  end
end

-- A start's flow (a.flow, '' when none): 'limit max keep debounce_ms max_wait_ms delay_ms'.
-- limit: live runs per key under on_live_match 'queue'; max: runs that may wait; keep:
-- 'all' or 'newest' (one waits, the latest); debounce_ms / delay_ms: the run is scheduled
-- that long after the start (0: not); max_wait_ms: a debounced run's due time never
-- goes past its creation plus this (0: no bound).
local function parse_flow(text)
  if not text or text == '' then
    return nil
  end
  local limit, max, keep, debounce, max_wait, delay =
    string.match(text, '^(%d+) (%d+) (%a+) (%d+) (%d+) (%d+)$')
  return {limit = tonumber(limit), max = tonumber(max), keep = keep,
          debounce = tonumber(debounce), max_wait = tonumber(max_wait), delay = tonumber(delay)}
end

-- Write a new run's hash (claim, enqueue) in `phase`, with the field its phase has of
-- its own, if any ('entry': its first step's stream entry; 'due_ms': when a scheduled
-- run starts).
local function write_run(k, a, phase, now, rerun_of, field, value)
  local fields = {'id', a.id, 'workflow', a.workflow, 'key', a.key, 'phase', phase,
    'step', a.first, 'steps', a.steps, 'params', a.params, 'fp', a.fp,
    'created_ms', now, 'updated_ms', now, 'rerun_of', rerun_of}
  if field then
    fields[#fields + 1] = field
    fields[#fields + 1] = value
  end
  redis.call('HSET', k.run, unpack(fields))
end

-- A debounced start whose key names a scheduled run: that run takes this start's params
-- and its due time moves to now + debounce, never past its creation + max_wait. Its
-- markers name that run, so a redelivery of this event changes nothing.
local function debounce(k, a, cur_id, cur_step, now)
  local created = tonumber(redis.call('HGET', k.cur, 'created_ms')) or now
  local due = now + a.flow.debounce
  if a.flow.max_wait > 0 then
    due = math.min(due, created + a.flow.max_wait)
  end
  redis.call('HSET', k.cur, 'params', a.params, 'fp', a.fp, 'due_ms', due, 'updated_ms', now)
  redis.call('HSET', k.pointer, 'fp', a.fp)
  redis.call('ZADD', k.due, due, cur_id)
  mark(k, a, 'debounced', cur_id, '', {})
  return {'scheduled', cur_id, 'scheduled', cur_step, '', '0', tostring(due)}
end

-- A start behind its key's live runs (on_live_match 'queue', the key at its limit): a
-- run in phase 'queued' at the end of the key's queue, started by the ending that frees
-- its place. keep 'newest' cancels the run that waited (one at most: its hash is named,
-- k.qrun); keep 'all' refuses a start past max.
local function enqueue(k, a, now, now_us, placed, gone, live)
  local waiting = a.flow.keep == 'newest' and redis.call('ZRANGE', k.queue, 0, 0) or {}
  if waiting[1] then
    if a.qrun_id ~= waiting[1] then
      unmark(k, placed)
      return {'need_run', waiting[1], 'queued', '', '', '0'}
    end
    redis.call('HSET', k.qrun, 'phase', 'cancelled', 'updated_ms', now, 'ended_ms', now,
      'error', 'superseded by run ' .. a.id .. ', queued after it (queue keep: newest)')
    redis.call('PEXPIRE', k.qrun, a.retention)
    redis.call('ZREM', k.queue, waiting[1])
    redis.call('ZREM', k.queued, waiting[1])
  elseif a.flow.keep == 'all' then
    local count = redis.call('ZCARD', k.queue)
    if count >= a.flow.max then
      unmark(k, placed)
      unmark(k, gone)
      return {'queue_full', '', tostring(count), '', '', '0'}
    end
  end
  write_run(k, a, 'queued', now, '')
  redis.call('ZADD', k.index, now_us + a.seq, a.id)
  redis.call('ZADD', k.queue, now_us + a.seq, a.id)
  redis.call('ZADD', k.queued, now_us + a.seq, a.id)
  -- The live runs it waits behind (a run started under another policy is listed here
  -- first): each one's ending looks at the queue.
  redis.call('HSET', k.pointer, 'live', live, 'limit', a.flow.limit)
  mark(k, a, 'created', a.id, '', placed)
  return {'queued', a.id, 'queued', a.first, '', '0'}
end

-- The claim for one start (the on_live_match / on_terminal_match policies): decide from the markers and the key
-- pointer, and when the decision is a new run, write the run, its indexes, the
-- pointer and the stream entry for the runners, all in this one script call.
-- k: run, index, stream, pointer and keyruns (nil without a key), key_index (the
--    workflow's index of keys), cur (the hash of the run the caller believes the
--    pointer names, or nil), mrun (the hash of the run the caller was told a marker
--    names, or nil), markers (list of marker keys), queue (the key's queue), qrun (the
--    hash of the run waiting in it, when named), queued (the workflow's queued index),
--    due (the workflow's scheduled runs, by due time)
-- a: id, workflow, key, params, fp, steps, first (step), on_live, on_terminal,
--    on_mismatch, retention, seq (the item's place in a batch; 0 alone),
--    cur_id (the run k.cur is the hash of, '' if none), mrun_id (likewise for k.mrun),
--    qrun_id (for k.qrun), flow (parse_flow, or nil),
--    resend ('1': this call may repeat one that ran, so look for the run a.id first),
--    marks (per marker: {mode, tag}); mode is 'same' (a request id: its retry gets the
--    first call's outcome), 'dedupe' (an event id: a redelivery is deduplicated),
--    'replay' (a body digest: a hit only when the tag, the event id, differs) or
--    'order' (an entity's mark: see stale_against) or 'rate' (a rate limit's window:
--    see window_full); at most one of each, after the others
-- now: server time in ms; now_us: in microseconds.
-- Returns {outcome, run_id, phase, step, rerun_of, params_mismatch[, due_ms]}; see
-- start_run.lua.
local function claim(k, a, now, now_us)
  -- Caller-id check: this exact start already committed (its reply was lost). Only a
  -- resend can find it: a first try names a run id no call has used.
  if a.resend == '1' then
    local mine = redis.call('HMGET', k.run, 'phase', 'step', 'rerun_of', 'due_ms')
    if mine[1] then
      if mine[1] == 'queued' or mine[1] == 'scheduled' then
        return {mine[1], a.id, mine[1], mine[2] or '', mine[3] or '', '0', mine[4] or ''}
      end
      return {'created', a.id, mine[1], mine[2] or '', mine[3] or '', '0'}
    end
  end

  -- Markers: this event, body or request was decided before. A marker whose tag
  -- differs is a hit only for a replay guard (same body, another event id); a
  -- marker with no tag of ours ('') is always a hit. An absent marker is placed at
  -- once as a new run of this call would have it (the usual end), and taken back
  -- if the call ends otherwise.
  local placed, gone, order, rate = {}, {}, nil, nil
  a.now = now
  for i, marker in ipairs(k.markers) do
    local mode, tag = a.marks[i].mode, a.marks[i].tag
    if mode == 'order' then
      order = i  -- looked at once no marker decided: a redelivery is never stale
    elseif mode == 'rate' then
      rate = i  -- looked at once the claim is about to start a run
    else
      local m = place_marker(marker, marker_value(a.id, 'created', '', tag), a.retention)
      if not m then
        placed[i] = true
      elseif m[1] and (mode ~= 'replay' or m[4] ~= tag) then
        if a.mrun_id ~= m[1] then
          unmark(k, placed)
          return {'need_run', m[1], 'marker', '', '', '0'}
        end
        local r = redis.call('HMGET', k.mrun, 'phase', 'step')
        if r[1] then
          unmark(k, placed)
          if mode == 'same' and m[2] == 'created' then
            return {'created', m[1], r[1], r[2] or '', m[3] or '', '0'}
          end
          return {'existing', m[1], r[1], r[2] or '', '', '0'}
        end
        -- The run it names is gone (deleted, evicted): the marker protects nothing.
        -- This call's decision replaces it; a refusal deletes it.
        gone[i] = true
      end
    end
  end

  -- An ordered trigger: an event older than one that started a run for its entity
  -- starts nothing (and cancels nothing, whatever the key's policies).
  if order then
    local newest = stale_against(k.markers[order], a.marks[order].tag)
    if newest then
      unmark(k, placed)
      return {'stale', '', newest, '', '', '0'}
    end
  end

  -- `live`: under on_live_match 'queue', the ids of the key's live runs, this one to be
  -- added ('' when none); `wait`: the key is at its limit, so the start queues.
  local rerun_of, cancel, live, wait = '', nil, nil, false
  local queueing = a.on_live == 'queue' and k.pointer ~= nil
  if queueing then
    live = ''
  end
  if k.pointer then
    local cur = redis.call('HMGET', k.pointer, 'run', 'phase', 'step', 'fp', 'live')
    local cur_id, cur_phase, cur_step = cur[1], cur[2], cur[3] or ''
    if cur_id and cur_id ~= a.cur_id then
      -- A repeat: every decision below names or ends the key's run, so the caller
      -- must name its hash (it is checked to exist). One more call, only on repeats.
      unmark(k, placed)
      return {'need_run', cur_id, 'pointer', '', '', '0'}
    end
    if cur_id and not redis.call('HGET', k.cur, 'id') then
      -- The pointer names a run that no longer exists (deleted, evicted, a partial
      -- restore): nothing owns the key, so it is free. Never dedupe onto a 404.
      redis.call('DEL', k.pointer)
      redis.call('ZREM', k.keyruns, cur_id)
      cur_id = nil
    end
    if cur_id then
      local mismatch = (cur[4] ~= a.fp) and '1' or '0'
      local existing = 'existing'
      if mismatch == '1' and a.on_mismatch == 'reject' then
        existing = 'conflict'
      end
      local refusal = nil
      if cur_phase == 'scheduled' then
        -- The key's run has not started: a debounced start moves it; any other start
        -- is deduplicated onto it (there is nothing to queue behind or to replace).
        if a.flow and a.flow.debounce > 0 then
          return debounce(k, a, cur_id, cur_step, now)
        end
        refusal = existing
      elseif queueing and (cur[5] or '') ~= '' then
        live = cur[5]
        wait = count_ids(live) >= a.flow.limit
      elseif queueing and cur_phase == 'running' then
        -- Started under another policy: it holds the key's first place.
        live = cur_id
        wait = a.flow.limit <= 1
      elseif cur_phase == 'running' then
        if a.on_live == 'use_existing' then
          refusal = existing
        elseif a.on_live == 'fail' then
          refusal = 'active'
        else
          -- cancel_existing: end the live run and start the new one right here.
          cancel = cur_id
        end
      elseif a.on_terminal == 'reuse' then
        refusal = existing
      elseif a.on_terminal == 'reject' then
        refusal = 'used'
      elseif a.on_terminal == 'rerun_if_failed' and cur_phase == 'completed' then
        refusal = existing
      end
      -- Otherwise: rerun, or rerun_if_failed after a failed or cancelled run (or a
      -- queued key with room: this run joins its live ones).
      if refusal then
        if refusal == 'existing' then
          mark(k, a, 'existing', cur_id, '', {})
        else
          unmark(k, placed)
          unmark(k, gone)
        end
        return {refusal, cur_id, cur_phase, cur_step, '', mismatch}
      end
      if live == nil or live == '' then
        rerun_of = cur_id
      end
    end
  end

  -- A rate limit: a full window starts nothing (and cancels nothing). Nothing is
  -- recorded of the delivery: its redelivery, once the window has room, may start.
  if rate then
    local wait_ms = window_full(k.markers[rate], a.marks[rate].tag, now)
    if wait_ms then
      unmark(k, placed)
      unmark(k, gone)
      return {'rate_limited', '', tostring(wait_ms), '', '', '0'}
    end
  end
  if wait then
    return enqueue(k, a, now, now_us, placed, gone, live)
  end
  if cancel then
    end_run(k.cur, cancel, 'cancelled', now, a.retention, k.pointer, k.keyruns, k.stream)
  end

  local first = a.first
  -- A debounced or delayed start is scheduled: its first step goes to the runners when
  -- it is due (start_due.lua, from the sweep).
  local due = nil
  if a.flow and (a.flow.debounce > 0 or a.flow.delay > 0) then
    due = now + math.max(a.flow.debounce, a.flow.delay)
  end
  local phase = due and 'scheduled' or 'running'
  if due then
    write_run(k, a, phase, now, rerun_of, 'due_ms', due)
    redis.call('ZADD', k.due, due, a.id)
  else
    local entry = redis.call('XADD', k.stream, '*', 'run_id', a.id, 'workflow', a.workflow,
      'step', first, 'params', a.params)
    -- `entry`: the stream entry of the step the run is at, for the runners.
    write_run(k, a, phase, now, rerun_of, 'entry', entry)
  end
  -- The workflow's index orders listings only: the time (unique per script call,
  -- which takes more than a microsecond) plus the item's place in its batch.
  redis.call('ZADD', k.index, now_us + a.seq, a.id)
  if k.pointer then
    if rerun_of ~= '' then
      -- The old pointer may carry a TTL (its run ended): start it afresh. A key
      -- seen for the first time has no pointer to delete.
      redis.call('DEL', k.pointer)
    end
    redis.call('HSET', k.pointer, 'run', a.id, 'phase', phase, 'step', first, 'fp', a.fp)
    if live then
      redis.call('HSET', k.pointer, 'live', live == '' and a.id or (live .. ' ' .. a.id),
        'limit', a.flow.limit)
      redis.call('PERSIST', k.pointer)
    end
    -- The key index: reconcile walks it instead of the keyspace, the sweep drops a key
    -- once its pointer and run set are gone. Scored by this claim's time, like the run
    -- index: the sweep looks only at keys claimed more than a retention ago (a group
    -- outlives its last claim by that much, unless deleted or repointed). Only a claim
    -- that writes the pointer adds the key (one ZADD): every key group starts here, and
    -- a repeat's group (pointer or run set still there) is in the index already.
    local new_key = redis.call('ZADD', k.key_index, now_us + a.seq, a.key) == 1
    if new_key and rerun_of == '' then
      -- A key new to the index has no run set (a key with one is in the index), so
      -- this run is its first member and its newest, and the set has no TTL to drop.
      redis.call('ZADD', k.keyruns, now_us + a.seq, a.id)
    else
      redis.call('ZADD', k.keyruns, next_score(k.keyruns, now_us + a.seq), a.id)
      -- A key whose run ended keeps its run set with a TTL: this run makes it live.
      redis.call('PERSIST', k.keyruns)
      if rerun_of ~= '' then
        redis.call('ZREMRANGEBYRANK', k.keyruns, 0, -(KEYRUNS_KEEP + 1))
      end
    end
  end
  mark(k, a, 'created', a.id, rerun_of, rerun_of == '' and placed or {})
  if due then
    return {'scheduled', a.id, phase, first, rerun_of, '0', tostring(due)}
  end
  return {'created', a.id, phase, first, rerun_of, '0'}
end
