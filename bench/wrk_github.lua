-- wrk script: signed GitHub push deliveries, POST /hooks/github.
--
--   wrk -t2 -c64 -d10s --latency -s bench/wrk_github.lua URL -- REQUESTS_FILE THREADS
--
-- REQUESTS_FILE has one delivery per line: "<delivery id>\t<sha256 hex>\t<json body>"
-- (written by bench/listen_bench.py; wrk cannot compute an HMAC). The file is cut
-- into THREADS contiguous chunks, thread i sends chunk i in order and wraps around
-- at its end. The requests are formatted once, in init, so the per-request Lua cost
-- is a table lookup. done() prints one line, "BENCH_SENT <n1> <n2> ...": how many
-- requests each thread generated, from which the caller computes how many distinct
-- delivery ids were sent (and so how many runs should exist).

local threads = {}
local counter = 0

function setup(thread)
  thread:set("thread_index", counter)
  counter = counter + 1
  table.insert(threads, thread)
end

function init(args)
  local path, nthreads = args[1], tonumber(args[2])
  local lines = {}
  for line in io.lines(path) do
    lines[#lines + 1] = line
  end
  local chunk = math.floor(#lines / nthreads)
  local first = thread_index * chunk + 1
  requests = {}
  for i = first, first + chunk - 1 do
    local id, sig, body = lines[i]:match("^([^\t]+)\t([^\t]+)\t(.*)$")
    requests[#requests + 1] = wrk.format("POST", "/hooks/github", {
      ["Content-Type"] = "application/json",
      ["User-Agent"] = "GitHub-Hookshot/bench",
      ["X-GitHub-Event"] = "push",
      ["X-GitHub-Delivery"] = id,
      ["X-Hub-Signature-256"] = "sha256=" .. sig,
    }, body)
  end
  lines = nil
  collectgarbage()
  sent = 0
end

function request()
  local req = requests[(sent % #requests) + 1]
  sent = sent + 1
  return req
end

function done(summary, latency, requests)
  local counts = {}
  for _, thread in ipairs(threads) do
    counts[#counts + 1] = tostring(thread:get("sent"))
  end
  io.write("BENCH_SENT " .. table.concat(counts, " ") .. "\n")
end
