#!lua
--[[ record_deliveries: add a batch of deliveries to the delivery log, then trim it.

KEYS[1]  index of verified deliveries (zset, all scores 0, members = ids, which sort
         by time)                         realm:{deliveries:log}:index
KEYS[2]  index of refused deliveries (401, 413, ...; same form)
                                          realm:{deliveries:log}:refused
KEYS[3..] the record (hash) of each delivery written, in ARGV's order, then the record
         of each trim candidate of KEYS[1], then of KEYS[2], each oldest first
                                          realm:{deliveries:log}:d:<id>

ARGV[1]  the length of a record key's part before the id ('realm:{deliveries:log}:d:')
ARGV[2]  retention in ms (each record expires then)
ARGV[3]  count cap of KEYS[1]
ARGV[4]  count cap of KEYS[2]
ARGV[5]  n: deliveries written
ARGV[6]  trim candidates of KEYS[1]; ARGV[7]: how many of them (the first) are past
         retention
ARGV[8]  trim candidates of KEYS[2]; ARGV[9]: how many of them are past retention
ARGV[10..] per delivery, 7 values: 'v' (verified) or 'r' (refused), path, status,
         outcomes (',started,ignored,': every trigger's), summary JSON, record JSON,
         the stored body (raw bytes; '' when none)

Record hash fields: p path, s status, o outcomes, sum summary, doc record, b body.
A record's id (its index member) is its key after ARGV[1] characters.

Reply: how many old deliveries were trimmed.

Every key is in KEYS, none is built here: the caller read the candidates from the
indexes first (the oldest ids, at most the records added + 100 per index, so one call
never walks a large backlog). A candidate goes if it is past retention, or while its
index is over its cap, counted now; and only if it is still in its index: another
worker's trim since the read is never done twice. Writing a record again (a flush
retried after its reply was lost) overwrites it.

Refused deliveries have an index (and a cap) of their own: a flood of unsigned
requests must not push the verified ones out of the log. Records past retention
expire by themselves; the trim takes them out of the index and frees what the count
cap drops. No allow-oom: a Redis at maxmemory refuses the whole call (the log must
not grow past it), and the recorder keeps the batch for its next flush.
]]

local skip = tonumber(ARGV[1])
local retention = tonumber(ARGV[2])
local caps = {tonumber(ARGV[3]), tonumber(ARGV[4])}
local n = tonumber(ARGV[5])
local candidates = {tonumber(ARGV[6]), tonumber(ARGV[8])}
local expired = {tonumber(ARGV[7]), tonumber(ARGV[9])}

local at = 10
for r = 1, n do
  local record = KEYS[2 + r]
  redis.call('HSET', record, 'p', ARGV[at + 1], 's', ARGV[at + 2], 'o', ARGV[at + 3],
             'sum', ARGV[at + 4], 'doc', ARGV[at + 5], 'b', ARGV[at + 6])
  redis.call('PEXPIRE', record, retention)
  redis.call('ZADD', KEYS[(ARGV[at] == 'r') and 2 or 1], 0, string.sub(record, skip + 1))
  at = at + 7
end

local trimmed = 0
local key = 2 + n
for which = 1, 2 do
  local index = KEYS[which]
  local over = redis.call('ZCARD', index) - caps[which]
  for c = 1, candidates[which] do
    local record = KEYS[key + c]
    if (c <= expired[which] or over > 0)
        and redis.call('ZREM', index, string.sub(record, skip + 1)) == 1 then
      redis.call('DEL', record)
      over = over - 1
      trimmed = trimmed + 1
    end
  end
  key = key + candidates[which]
end
return trimmed
