"""The engine core: everything that runs where the model is (the engine-core process, or the
engine thread of a single-process server). It never imports `engine.client`."""
