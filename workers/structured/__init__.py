"""Structured outputs on a worker: the grammar engine over kvserve's tokenizer
(`grammars.py`: tokenizer info, compiled-grammar cache, spec validation), a stream's grammar
state (`state.py`), and the per-step logit work (`constraints.py`: logit_bias, and one
batched token bitmask for every constrained stream, applied on the logits' device)."""
