"""`loraserve loadtest`: the command (`cli`), its settings (`config`), one request and its
outcome (`sample`), the run (`run`: the workload, open or closed loop, /metrics before and
after), the report (`summary`), and what those are built from: a cheap HTTP/1.1 client
(`client`), a /metrics timeline (`timeline`), the HTML report (`report`), and a driver for `wrk`
(`wrk`). `loraserve.loadtest` re-exports the public names.

The load generator shares the machine with the server it measures, so every microsecond of CPU
it spends per request is one the server does not get: `client` speaks raw HTTP/1.1 over asyncio
(httptools parses the responses, orjson the SSE events), about an order of magnitude cheaper per
request than a general-purpose client; `wrk` drives the C load generator when it is installed.
`--client httpx` (`sample.request_httpx`) is the general-purpose client the built-in one replaced,
kept for comparison (bench/RESULTS.md quotes it; tests run both).
"""
