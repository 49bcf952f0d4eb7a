-- wrk: POST the body in BENCH_BODY (with a bearer BENCH_KEY when set), then print one line
-- "WRKJSON {...}" with the requests, RPS, latency percentiles (ms) and error counts.
wrk.method = "POST"
wrk.body = os.getenv("BENCH_BODY")
wrk.headers["Content-Type"] = "application/json"
local key = os.getenv("BENCH_KEY") or ""
if key ~= "" then
  wrk.headers["Authorization"] = "Bearer " .. key
end

function done(summary, latency, requests)
  local e = summary.errors
  local seconds = summary.duration / 1e6
  io.write(string.format(
    'WRKJSON {"requests":%d,"seconds":%.3f,"rps":%.1f,"p50_ms":%.3f,"p99_ms":%.3f,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}}\n',
    summary.requests, seconds, summary.requests / seconds,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    e.connect, e.read, e.write, e.status, e.timeout))
end
