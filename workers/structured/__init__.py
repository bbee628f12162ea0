"""Structured outputs on a worker: the grammar engine over kvserve's tokenizer
(`grammars.py`: tokenizer info, compiled-grammar cache, spec validation), a stream's grammar
state (`state.py`) and the vocabulary as token bytes (`vocab.py`). The per-step logit work
(logit_bias, then one batched token bitmask for every constrained stream) is the engine's
`workers/engine/constraints.py`."""
