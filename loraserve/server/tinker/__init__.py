"""The Tinker/MinT SDK's API under /api/v1: sampling and training on the served base.

    routes     login, sessions, sampling sessions, asample / retrieve_future; mounts the rest
    asample    a sample's future: pinned model, de-duplication, long poll
    sampling   one SampleRequest: its body, engine requests and SampleResponse
    state      sessions, sampling sessions and futures (event loop only, bounded)
    training   create_model, forward(_backward), optim_step, save/load weights, run listings
    runs       training runs: owner tenant, adapter id, checkpoints, operation order
"""
from loraserve.server.tinker.routes import install_tinker, tinker_router

__all__ = ["install_tinker", "tinker_router"]
