"""The engine core: scheduler, KV block books, model runner, sampler and the step loop.

One thread owns an `LLMEngine`; `AsyncEngine` puts it behind asyncio. Build one with
`loraserve.engine.build.build_engine`.
"""
