"""What `loraserve loadtest` is built from: a cheap HTTP/1.1 client, a /metrics timeline, the
HTML report, and a driver for `wrk`.

The load generator shares the machine with the server it measures, so every microsecond of CPU
it spends per request is one the server does not get: `client` speaks raw HTTP/1.1 over asyncio
(httptools parses the responses, orjson the SSE events), about an order of magnitude cheaper per
request than a general-purpose client; `wrk` drives the C load generator when it is installed.
"""
