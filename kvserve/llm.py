"""Offline API: `LLM(model=None, **engine_settings).generate(...)` and `.chat(...)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.config import EngineConfig
from kvserve.outputs import RequestOutput
from kvserve.sampling import SamplingParams


class LLM:
    """Runs a model in this process; `model=None` loads the embedded default model."""

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        from kvserve.workers.engine.engine import LLMEngine

        self.config = EngineConfig(model=model, **settings)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop a tensor-parallel engine's rank processes now (else at garbage collection or
        interpreter exit); a no-op on one device."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); outputs in input order.
        `lora`: a loaded LoRA adapter's name for every prompt, or one per prompt (None: the
        base model)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA adapter names")
        ids = []
        try:
            for p, sp, name in zip(prompts, plist, loras, strict=True):
                ids.append(self.engine.add_request(p, sp, lora=name))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Load a PEFT LoRA adapter (a directory or Hub id) under `name`."""
        return self.engine.add_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.tokenizer.apply_chat_template(
                c, add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs
            )
            for c in convs
        ]
        return self.generate(prompts, params, use_tqdm)  # type: ignore[arg-type]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        wanted = set(ids)
        while self.engine.has_unfinished() and len(done) < len(ids):
            for out in self.engine.step(finished_only=True):
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]
