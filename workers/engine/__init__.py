"""The Paddle inference engine: model, loader, paged KV cache, scheduler, sampler."""
