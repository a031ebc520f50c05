"""The engine, in two halves that run in different processes, and what they share.

- `engine.core`: where the model is. The scheduler, KV block books, model runner, sampler and the
  step loop (`core.llm_engine.LLMEngine`), the transport-free `core.engine_core.EngineCore`
  that owns and drives it (turns, training slices, admission, call dispatch, residency), the structured-output matchers, and the engine-core process's transport
  (`core.process.EngineCoreProc`, entered via `core.boot`).
  Build an engine with `core.build.build_engine`.
- `engine.client`: the API process's side. `client.frontend.EngineClient` (admission,
  detokenize, stop strings, resolve warm refs, calls, the catalog through `client.catalog_view`)
  over a `Transport`: `client.core_client.ProcessTransport` talks to a supervised engine-core
  process over a Unix socket (`CoreClient` builds the client over it).
- Shared by both: `types` (requests, outputs, errors), `messages` (the one typed message set
  between the sides), `wire` (its field codecs), `snapshot`, `config`, `interface` (the engine
  interface the server uses), `heartbeat`, `directory` (model name -> `ResolvedModel`),
  `structured` (grammar text the server checks).
- `async_engine.AsyncEngine` hosts both halves in one process: the core on a thread
  (`ThreadTransport`), the client on the event loop.

import-linter holds the split (pyproject.toml): the core never imports the client, and the shared
modules import neither.
"""
