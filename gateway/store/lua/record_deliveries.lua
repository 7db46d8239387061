#!lua
--[[ record_deliveries: add a batch of deliveries to the delivery log, then trim it.

KEYS[1]  index of verified deliveries (zset, all scores 0, members = ids, which sort
         by time)                         realm:{deliveries:log}:index
KEYS[2]  index of refused deliveries (401, 413, ...; same form)
                                          realm:{deliveries:log}:refused

ARGV[1]  the records' key base: a record is the hash <base><id>
ARGV[2]  retention in ms (each record expires then)
ARGV[3]  count cap of KEYS[1]
ARGV[4]  count cap of KEYS[2]
ARGV[5]  the oldest id still kept: ids below it are past retention
ARGV[6..] per delivery, 8 values: id, 'v' (verified) or 'r' (refused), path, status,
         outcomes (',started,ignored,': every trigger's), summary JSON, record JSON,
         the stored body (raw bytes; '' when none)

Record hash fields: p path, s status, o outcomes, sum summary, doc record, b body.

Reply: how many old deliveries were trimmed.

Refused deliveries have an index (and a cap) of their own: a flood of unsigned
requests must not push the verified ones out of the log. Trimming is bounded: per
index at most (records added + 100) per call, enough to keep up with what is added,
so one call never walks a large backlog. Records past retention expire by
themselves; the trim takes them out of the index and frees what the count cap
drops. No allow-oom: a Redis at maxmemory refuses the whole call (the log must not
grow past it), and the recorder keeps the batch for its next flush.
]]

local base = ARGV[1]
local retention = tonumber(ARGV[2])
local caps = {tonumber(ARGV[3]), tonumber(ARGV[4])}
local cutoff = ARGV[5]
local added = {0, 0}

local i = 6
while i + 7 <= #ARGV do
  local id, kind = ARGV[i], ARGV[i + 1]
  local record = base .. id
  redis.call('HSET', record, 'p', ARGV[i + 2], 's', ARGV[i + 3], 'o', ARGV[i + 4],
             'sum', ARGV[i + 5], 'doc', ARGV[i + 6], 'b', ARGV[i + 7])
  redis.call('PEXPIRE', record, retention)
  local which = (kind == 'r') and 2 or 1
  redis.call('ZADD', KEYS[which], 0, id)
  added[which] = added[which] + 1
  i = i + 8
end

local function drop(index, ids)
  if #ids == 0 then return 0 end
  local names = {}
  for n, id in ipairs(ids) do names[n] = base .. id end
  redis.call('DEL', unpack(names))
  redis.call('ZREM', index, unpack(ids))
  return #ids
end

local trimmed = 0
for which = 1, 2 do
  local index = KEYS[which]
  local budget = added[which] + 100
  local old = redis.call('ZRANGE', index, '-', '(' .. cutoff, 'BYLEX', 'LIMIT', 0, budget)
  trimmed = trimmed + drop(index, old)
  budget = budget - #old
  local excess = redis.call('ZCARD', index) - caps[which]
  if budget > 0 and excess > 0 then
    trimmed = trimmed + drop(index, redis.call('ZRANGE', index, 0, math.min(excess, budget) - 1))
  end
end
return trimmed
