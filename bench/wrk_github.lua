-- wrk script: signed GitHub push deliveries, POST /hooks/github.
--
--   wrk -t2 -c64 -d10s --latency -s bench/wrk_github.lua URL -- REQUESTS_FILE THREADS
--
-- REQUESTS_FILE.<i> (i = 0 .. THREADS-1) holds thread i's deliveries, one a line:
-- "<delivery id>\t<sha256 hex>\t<json body>" (written by bench/listen_bench.py; wrk
-- cannot compute an HMAC). Thread i sends its file's lines in order and wraps around
-- at the end; each thread reads only its own file, so a run of big bodies starts
-- quickly. The requests are formatted once, in init, so the per-request Lua cost is
-- a table lookup. done() prints one line, "BENCH_SENT <n1> <n2> ...": how many
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
  local path = args[1] .. "." .. thread_index
  requests = {}
  for line in io.lines(path) do
    local id, sig, body = line:match("^([^\t]+)\t([^\t]+)\t(.*)$")
    requests[#requests + 1] = wrk.format("POST", "/hooks/github", {
      ["Content-Type"] = "application/json",
      ["User-Agent"] = "GitHub-Hookshot/bench",
      ["X-GitHub-Event"] = "push",
      ["X-GitHub-Delivery"] = id,
      ["X-Hub-Signature-256"] = "sha256=" .. sig,
    }, body)
  end
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
