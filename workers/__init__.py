"""The worker side: loading/ (files, tokenizer), model/ (model, attention, runner), engine/
(scheduler, sampler, engine), and the Ray worker actor. Imports kvcache and the core only."""
