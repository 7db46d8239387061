#!lua
--[[ record_deliveries: add a batch of deliveries to the delivery log, then trim it.

KEYS[1]  index of verified deliveries (zset, all scores 0, members = ids, which sort
         by time)                         realm:{deliveries:log}:index
KEYS[2]  index of refused deliveries (401, 413, ...; same form)
                                          realm:{deliveries:log}:refused
KEYS[3..] the record (a string) of each delivery written, in ARGV's order, then the
         record of each trim candidate of KEYS[1], then of KEYS[2], each oldest first
                                          realm:{deliveries:log}:d:<id>

ARGV[1]  the length of a record key's part before the id ('realm:{deliveries:log}:d:')
ARGV[2]  retention in ms (each record expires then)
ARGV[3]  count cap of KEYS[1]
ARGV[4]  count cap of KEYS[2]
ARGV[5]  n: deliveries written
ARGV[6]  trim candidates of KEYS[1]; ARGV[7]: how many of them (the first) are past
         retention
ARGV[8]  trim candidates of KEYS[2]; ARGV[9]: how many of them are past retention
ARGV[10..] per delivery, 2 values: 'v' (verified) or 'r' (refused), and the stored
         record (gateway/deliveries/records.py pack_record)

A record's id (its index member) is its key after ARGV[1] characters.

Reply: how many old deliveries were trimmed.

Each record is one SET with its expiry, and each index takes a batch's ids in one ZADD:
a record costs Redis one command, and a batch a few more. Every key is in KEYS, none
is built here: the caller read the candidates from the indexes first (the oldest ids,
at most the records added + 100 per index, so one call never walks a large backlog).
A candidate goes if it is past retention, or while its index is over its cap, counted
now; and only if it is still in its index: another worker's trim since the read is
never done twice. Writing a record again (a flush retried after its reply was lost)
overwrites it.

Refused deliveries have an index (and a cap) of their own: a flood of unsigned
requests must not push the verified ones out of the log. Records past retention
expire by themselves; the trim takes them out of the index and frees what the count
cap drops. No allow-oom: a Redis at maxmemory refuses the whole call (the log must
not grow past it), and the recorder keeps the batch for its next flush.
]]

local skip = tonumber(ARGV[1])
local retention = ARGV[2]
local caps = {tonumber(ARGV[3]), tonumber(ARGV[4])}
local n = tonumber(ARGV[5])
local candidates = {tonumber(ARGV[6]), tonumber(ARGV[8])}
local expired = {tonumber(ARGV[7]), tonumber(ARGV[9])}

local added = {{}, {}}
for r = 1, n do
  local record = KEYS[2 + r]
  local at = 10 + 2 * (r - 1)
  redis.call('SET', record, ARGV[at + 1], 'PX', retention)
  local into = added[(ARGV[at] == 'r') and 2 or 1]
  into[#into + 1] = 0
  into[#into + 1] = string.sub(record, skip + 1)
end
for which = 1, 2 do
  if #added[which] > 0 then
    redis.call('ZADD', KEYS[which], unpack(added[which]))
  end
end

local trimmed = 0
local key = 2 + n
for which = 1, 2 do
  local index, count = KEYS[which], candidates[which]
  if count > 0 then
    local ids = {}
    for c = 1, count do
      ids[c] = string.sub(KEYS[key + c], skip + 1)
    end
    local held = redis.call('ZMSCORE', index, unpack(ids))
    local over = redis.call('ZCARD', index) - caps[which]
    local gone_ids, gone_records = {}, {}
    for c = 1, count do
      if held[c] and (c <= expired[which] or over > 0) then
        gone_ids[#gone_ids + 1] = ids[c]
        gone_records[#gone_records + 1] = KEYS[key + c]
        over = over - 1
      end
    end
    if #gone_ids > 0 then
      redis.call('ZREM', index, unpack(gone_ids))
      redis.call('DEL', unpack(gone_records))
      trimmed = trimmed + #gone_ids
    end
  end
  key = key + count
end
return trimmed
