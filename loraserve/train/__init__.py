"""LoRA training on the resident serving base (the Tinker training API's math).

A run's LoRA factors attach to the serving `CausalLM` itself through forward hooks: the base's
weight tensors are read where they live (frozen, never copied), and only the run's factors,
gradients, optimizer state and activations are its own. Modules:

    config    RunConfig (rank, alpha, which of attention / MLP / unembed, seed) -> target kinds
    factors   LoRAFactors: the run's A/B per target module, PEFT's init, serving-layout export
    hooks     attach factors to the resident model for one forward (PackedLinear made differentiable)
    losses    cross_entropy, importance_sampling, ppo as the Tinker SDK defines them
    chunked   one datum longer than the slice budget, forward/backward a chunk per slice
    run       TrainingRun: forward / forward_backward in token-bounded slices, optim_step (AdamW),
              training state (factors + Adam moments) out and back in
"""
