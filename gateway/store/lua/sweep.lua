#!lua flags=allow-oom
--[[ sweep: one bounded step of trimming one of a workflow's indexes, or its ready stream.

Three things are walked this way (gateway/store/sweep.py), each from a position of its own:
  the run index  (kind 'index')   members are run ids, gone once their run hash is;
  the key index  (kind 'index')   members are idempotency keys, gone once both the key's
                                  pointer and its run set are;
  the stream     (kind 'stream')  members are ids of entries older than stream retention:
                                  one no runner has read yet is deleted once its run no
                                  longer needs it (the run ended, moved on or is gone: a
                                  runner would acknowledge it and skip it, as
                                  take_step.lua does). A stream call also trims the
                                  stream's head by age and deletes the consumers that left.

KEYS[1]  what is walked                realm:{wf}:runs, realm:{wf}:keys or realm:{wf}:stream
KEYS[2]  its position (a string)       realm:{wf}:sweep, realm:{wf}:keysweep or
                                       realm:{wf}:streamsweep
KEYS[3..] ARGV[4] keys per member of ARGV[9..], in the same order: a run id's run hash
         (realm:{wf}:run:<id>), a key's pointer and run set (realm:{wf}:key:<key>,
         realm:{wf}:keyruns:<key>), or the run hash an entry names

ARGV[1] the position the caller read from KEYS[2] before reading the members ('' =
        none: the walk was at the start)
ARGV[2] the position to store: the last member read (its score, or its entry id) ('' =
        the read reached the end: the next walk starts over)
ARGV[3] 'index' or 'stream'
ARGV[4] keys per member in KEYS[3..] (1 or 2)
ARGV[5..8] for 'stream' ('' for 'index'): stream retention in ms (entries whose id is
        older than TIME minus this may go); the most entries an approximate trim may
        remove in this call; how long (ms) a consumer with nothing pending may have been
        idle before it is deleted; the most consumers deleted in this call
ARGV[9..] members the caller read from ARGV[1] on

Reply: {outcome, removed, trimmed, exact, consumers}
  swept     the members found gone were removed: `removed` of them (from the index, or
            deleted from the stream)
  moved     another sweeper moved the position since ARGV[1] was read: the members were
            left alone (it does the chunk), so replicas share one walk
  trimmed   stream entries the head trim removed (stream calls, both outcomes); exact =
            '1' when this call trimmed exactly (the approximate trim had nothing left to
            remove), '0' otherwise
  consumers consumers of the runners' group deleted (stream calls, both outcomes)

A live run's hash never expires, so a live run is never removed from the index; nor is
a key whose pointer or run set is still there, nor an entry a runner would be handed.
A member is checked and removed in this one call, and a claim that writes a key's
pointer adds the key to its index in its own call: a key in use is never missing from
the index. Members are only removed when the position is still ARGV[1]: one
compare-and-set.
Flags: allow-oom, because this is what frees memory when a server at maxmemory
(noeviction) refuses every start; it writes nothing but the small position (and the
runners' group, when it is missing).
]]

-- Stream ids ('<ms>-<seq>') in order.
local function id_less(a, b)
  local am, as = string.match(a, '^(%d+)-?(%d*)$')
  local bm, bs = string.match(b, '^(%d+)-?(%d*)$')
  if tonumber(am) ~= tonumber(bm) then
    return tonumber(am) < tonumber(bm)
  end
  return (tonumber(as) or 0) < (tonumber(bs) or 0)
end

-- An XINFO reply's flat field/value list as a table.
local function fields_of(flat)
  local fields = {}
  for i = 1, #flat, 2 do
    fields[flat[i]] = flat[i + 1]
  end
  return fields
end

-- The runners' group on the stream: the last id it delivered, and its oldest pending
-- id (nil when none is pending). A stream without the group gets it here, from its
-- first entry, as the listener makes it: an entry no group has delivered is an entry
-- no runner read, and the trim must keep it (the group is lost with its stream, and a
-- stream written again after a DEL, a FLUSHALL or a failover has none).
local function runners_group(stream)
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local fields = fields_of(group)
    if fields['name'] == RUNNERS_GROUP then
      local pending = redis.call('XPENDING', stream, RUNNERS_GROUP)
      return fields['last-delivered-id'], pending[2] or nil
    end
  end
  redis.call('XGROUP', 'CREATE', stream, RUNNERS_GROUP, '0')
  return '0-0', nil
end

-- Would a runner be handed this entry (take_step.lua)? Only while its run is live and
-- the entry is the one of the step the run is at.
local function needed(run_key, entry_id)
  local run = redis.call('HMGET', run_key, 'phase', 'entry')
  return run[1] == 'running' and (not run[2] or run[2] == entry_id)
end

-- Consumers that left: nothing pending (deleting a consumer drops its pending entries,
-- which no runner would be handed again) and idle past the bound. A runner that is
-- still there only gets its consumer back with its next read.
local function delete_consumers(stream, idle_ms, limit)
  local deleted = 0
  for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', stream, RUNNERS_GROUP)) do
    if deleted >= limit then
      break
    end
    local fields = fields_of(consumer)
    if fields['pending'] == 0 and fields['idle'] >= idle_ms then
      redis.call('XGROUP', 'DELCONSUMER', stream, RUNNERS_GROUP, fields['name'])
      deleted = deleted + 1
    end
  end
  return deleted
end

local walked, position = KEYS[1], KEYS[2]
local read_from, go_on_from, kind = ARGV[1], ARGV[2], ARGV[3]
local per = tonumber(ARGV[4])
local stream = kind == 'stream' and walked or nil

if stream and redis.call('EXISTS', stream) == 0 then
  redis.call('DEL', position)
  return {'swept', 0, 0, '1', 0}
end
local last_delivered, oldest_pending = nil, nil
if stream then
  last_delivered, oldest_pending = runners_group(stream)
end

local outcome, removed = 'moved', 0
if (redis.call('GET', position) or '') == read_from then
  outcome = 'swept'
  for i = 9, #ARGV do
    local member, first = ARGV[i], 3 + (i - 9) * per
    if stream then
      -- Entries the group delivered are the runners' (pending, or acknowledged and
      -- left to the head trim); only an entry no runner read is checked here.
      if id_less(last_delivered, member) and not needed(KEYS[first], member) then
        removed = removed + redis.call('XDEL', stream, member)
      end
    elseif redis.call('EXISTS', unpack(KEYS, first, first + per - 1)) == 0 then
      removed = removed + redis.call('ZREM', walked, member)
    end
  end
  if go_on_from == '' then
    redis.call('DEL', position)
  else
    redis.call('SET', position, go_on_from)
  end
end
if not stream then
  return {outcome, removed, 0, '0', 0}
end

local consumers = delete_consumers(stream, tonumber(ARGV[7]), tonumber(ARGV[8]))

-- Stream entry ids are the server's ms at XADD ('*'), so age is read from the id.
-- The approximate trim drops whole macro nodes only (cheap, bounded by the limit);
-- once it finds none to drop, an exact trim removes the old entries left in the one
-- node that straddles the threshold (at most a node's worth: stream-node-max-entries),
-- so an idle stream goes back to empty rather than keeping a last node forever.
-- An entry the runners have not acknowledged is work in hand or still to do: the trim
-- stops below the oldest pending entry and below the first entry not yet delivered,
-- whatever its age (an entry no run needs was deleted above once old enough).
local minid = tostring(now_ms() - tonumber(ARGV[5]))
local undelivered = redis.call('XRANGE', stream, '(' .. last_delivered, '+', 'COUNT', 1)[1]
for _, floor in ipairs({oldest_pending or minid, undelivered and undelivered[1] or minid}) do
  if id_less(floor, minid) then
    minid = floor
  end
end
local trimmed, exact = redis.call('XTRIM', stream, 'MINID', '~', minid, 'LIMIT', ARGV[6]), '0'
if trimmed == 0 then
  trimmed = redis.call('XTRIM', stream, 'MINID', minid)
  exact = '1'
end
return {outcome, removed, trimmed, exact, consumers}
