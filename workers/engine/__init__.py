"""The continuous-batching engine: sequences, scheduler, sampler, engine, async engine and
stream snapshots. Imports workers.model, workers.loading, kvcache and the core."""
