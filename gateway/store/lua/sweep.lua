#!lua flags=allow-oom
--[[ sweep: one bounded step of trimming one of a workflow's indexes, and its ready stream.

Two indexes are walked this way (gateway/store/sweep.py): the run index, whose members are
run ids, gone once their run hash is; and the key index, whose members are
idempotency keys, gone once both the key's pointer and its run set are.

KEYS[1]  the index (zset)                   realm:{wf}:runs or realm:{wf}:keys
KEYS[2]  stream the runners read            realm:{wf}:stream  (never trimmed past what
         the `runners` group has not acknowledged or not yet been handed)
KEYS[3]  sweep position (string: a score)   realm:{wf}:sweep or realm:{wf}:keysweep
KEYS[4..] ARGV[5] keys per member of ARGV[6..], in the same order: a run id's run hash
         (realm:{wf}:run:<id>), or a key's pointer and run set (realm:{wf}:key:<key>,
         realm:{wf}:keyruns:<key>)

ARGV[1] the position the caller read from KEYS[3] before reading the members ('' =
        none: the walk was at the start of the index)
ARGV[2] the position to store: the score of the last member read ('' = the read
        reached the end of the index: the next walk starts over)
ARGV[3] stream retention in ms: entries whose id is older than TIME minus this go
        ('' = leave the stream alone)
ARGV[4] stream trim limit: entries an approximate trim may remove in this call
ARGV[5] keys per member in KEYS[4..] (1 or 2)
ARGV[6..] members the caller read from the index from ARGV[1] on

Reply: {outcome, removed, trimmed, exact}
  swept    the members none of whose keys exists any more (their run, or their key's
           pointer and run set, ended and expired, or were deleted) were removed from
           the index: `removed` of them
  moved    another sweeper moved the position since ARGV[1] was read: the index was
           left alone (it does the chunk), so replicas share one walk
  trimmed  stream entries removed, both outcomes; exact = '1' when this call trimmed
           exactly (the approximate trim had nothing left to remove), '0' otherwise

A live run's hash never expires, so a live run is never removed from the index; nor
is a key whose pointer or run set is still there. A member is checked and removed in
this one call, and a claim that writes a key's pointer adds the key to its index in
its own call: a key in use is never missing from the index. The index is only written
here when the position is still ARGV[1]: one compare-and-set.
Flags: allow-oom, because this is what frees memory when a server at maxmemory
(noeviction) refuses every start; it writes nothing but the small position.
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

-- The lowest id the runners still need: their oldest pending entry, and the entry
-- after the last one delivered (an id above it is undelivered). nil without runners.
local function runners_floor(stream)
  local floor = nil
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local fields = {}
    for i = 1, #group, 2 do
      fields[group[i]] = group[i + 1]
    end
    if fields['name'] == RUNNERS_GROUP then
      local ms, seq = string.match(fields['last-delivered-id'], '^(%d+)-(%d+)$')
      floor = ms .. '-' .. (tonumber(seq) + 1)
      local pending = redis.call('XPENDING', stream, RUNNERS_GROUP)
      if pending[2] and id_less(pending[2], floor) then
        floor = pending[2]
      end
    end
  end
  return floor
end

local index, stream, position = KEYS[1], KEYS[2], KEYS[3]
local read_from, go_on_from = ARGV[1], ARGV[2]
local stream_retention_ms, trim_limit = tonumber(ARGV[3]), tonumber(ARGV[4])
local per = tonumber(ARGV[5])

local outcome, removed = 'moved', 0
if (redis.call('GET', position) or '') == read_from then
  outcome = 'swept'
  for i = 6, #ARGV do
    local first = 4 + (i - 6) * per
    if redis.call('EXISTS', unpack(KEYS, first, first + per - 1)) == 0 then
      removed = removed + redis.call('ZREM', index, ARGV[i])
    end
  end
  if go_on_from == '' then
    redis.call('DEL', position)
  else
    redis.call('SET', position, go_on_from)
  end
end

-- Stream entry ids are the server's ms at XADD ('*'), so age is read from the id.
-- The approximate trim drops whole macro nodes only (cheap, bounded by the limit);
-- once it finds none to drop, an exact trim removes the old entries left in the one
-- node that straddles the threshold (at most a node's worth: stream-node-max-entries),
-- so an idle stream goes back to empty rather than keeping a last node forever.
-- With runners (the `runners` consumer group), an entry they have not acknowledged
-- is work in hand or still to do: the trim stops below the oldest pending entry and
-- below the first entry not yet delivered, whatever its age.
local trimmed, exact = 0, '0'
local threshold = stream_retention_ms and now_ms() - stream_retention_ms or 0
if threshold > 0 and redis.call('EXISTS', stream) == 1 then
  local floor = runners_floor(stream)
  local minid = tostring(threshold)
  if floor and id_less(floor, minid) then
    minid = floor
  end
  trimmed = redis.call('XTRIM', stream, 'MINID', '~', minid, 'LIMIT', trim_limit)
  if trimmed == 0 then
    trimmed = redis.call('XTRIM', stream, 'MINID', minid)
    exact = '1'
  end
end
return {outcome, removed, trimmed, exact}
