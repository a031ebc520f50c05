"""The engine client: the API process's side of the engine (frontend, engine-core client, catalog
view, warm refs). It reaches the core only through `engine.core.boot`, the core process's entry."""
