"""The transformers baseline of `kvserve bench offline`: the same prompts through HF's
static-batch `generate` and, where this transformers has it, continuous-batching
`generate_batch`, in float32 on the same threads."""

from __future__ import annotations

import argparse
import inspect
import os
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from kvserve.bench.common import Timer, figures, identical, progress_bar
from kvserve.models import resolve_model


def load_hf_model(model: str | None, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """The same weights kvserve runs, as a transformers model on `device` in `dtype` (float32
    on the CPU, kvserve's dtype on a GPU; no hub access)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    path = resolve_model(model)
    if path.endswith(".gguf"):
        # transformers dequantizes GGUF weights to the requested dtype, as kvserve does
        folder, name = os.path.split(path)
        m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return m.to(device).eval()


def _eos_ids(model: Any) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


class _StepMeter:
    """A stopping criterion that never stops: it counts tokens into a progress bar and
    notes when the first token of the batch was chosen (the end of prefill)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.first is None:
            self.first = time.perf_counter()
        self.bar.update(input_ids.shape[0])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_generate(
    model: Any, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[dict[str, Any], list[list[int]]]:
    """`model.generate` on the whole batch: prompts are equal-length, so no padding."""
    from transformers import GenerationConfig, StoppingCriteriaList

    eos = _eos_ids(model)
    pad = eos[0] if eos else 0

    def config(new: int) -> Any:
        # min_new_tokens = max_new_tokens: EOS is banned throughout (as kvserve's min_tokens),
        # so every row generates exactly `new` tokens
        return GenerationConfig(
            do_sample=False, max_new_tokens=new, min_new_tokens=new,
            eos_token_id=eos or None, pad_token_id=pad,
        )

    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    if args.warmup:
        n = min(4, len(prompts))
        model.generate(ids[:n], attention_mask=mask[:n], generation_config=config(4))
    total = len(prompts) * args.output_len
    with progress_bar(args.progress, total, "hf generate") as bar:
        meter = _StepMeter(bar)
        with Timer() as timer:
            out = model.generate(
                ids, attention_mask=mask, generation_config=config(args.output_len),
                stopping_criteria=StoppingCriteriaList([meter]),
            )
    tokens = out[:, ids.shape[1]:].tolist()
    res = figures(timer, prompts, tokens)
    if meter.first is not None:
        res["prefill_s"] = meter.first - timer.t0
        res["decode_s"] = timer.elapsed - res["prefill_s"]
    return res, tokens


def _accepted(fn: Any) -> set[str] | None:
    """Keyword names `fn` takes; None when it takes any (**kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


# ContinuousBatchingConfig renamed its fields across transformers releases: try each name
_CB_ALIASES = {"page_size": ("page_size", "block_size"), "block_size": ("block_size", "page_size")}


def make_cb_config(cls: Any, wanted: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Build `cls` (transformers' ContinuousBatchingConfig) from the fields this version
    takes, under whichever of their names it uses. Returns the config and the fields it
    does not take (so a report can say what the baseline ran without)."""
    names = _accepted(cls.__init__)
    kwargs: dict[str, Any] = {}
    dropped: dict[str, Any] = {}
    for key, value in wanted.items():
        for name in _CB_ALIASES.get(key, (key,)):
            if names is None or name in names:
                kwargs[name] = value
                break
        else:
            dropped[key] = value
    return cls(**kwargs), dropped


def supported_kwargs(fn: Any, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments `fn` accepts, from `kwargs` (optional extras only)."""
    names = _accepted(fn)
    return kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}


def run_generate_batch(
    model: Any, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[dict[str, Any], list[list[int]]]:
    """HF continuous batching (`generate_batch`, paged KV cache), with its default config."""
    from transformers import GenerationConfig

    eos = _eos_ids(model)

    def config(new: int) -> Any:
        # eos_token_id=-1 is CB's "never stop on EOS"; suppressing the EOS ids keeps the
        # greedy choice the same as the other runs (which ban EOS too)
        return GenerationConfig(
            do_sample=False, max_new_tokens=new, eos_token_id=-1,
            pad_token_id=eos[0] if eos else 0, suppress_tokens=eos or None,
        )

    if args.warmup:
        model.generate_batch(inputs=prompts[: min(4, len(prompts))], generation_config=config(4))
    with Timer() as timer:
        results = model.generate_batch(
            inputs=prompts, generation_config=config(args.output_len),
            **supported_kwargs(model.generate_batch, progress_bar=args.progress,
                               record_timestamps=True),
        )
    outs = list(results.values())  # in input order
    failed = [o.error for o in outs if o.error is not None]
    if len(outs) != len(prompts) or failed:
        raise RuntimeError(f"{len(outs)} of {len(prompts)} results; errors: {failed[:1]}")
    tokens = [list(o.generated_tokens) for o in outs]
    # Each call builds a fresh manager: it sizes and allocates a paged cache from free RAM and
    # runs its own warm-up before taking requests. The figures time the generation itself,
    # from the first request's arrival to the last one's end; call_s includes the setup.
    if all(hasattr(o, "created_time") and hasattr(o, "lifespan") for o in outs):
        start = min(o.created_time for o in outs)
        res = figures(timer, prompts, tokens, elapsed=max(o.lifespan[1] for o in outs) - start)
    else:  # an older GenerationOutput: time the whole call
        start = timer.t0
        res = figures(timer, prompts, tokens)
    res["call_s"] = timer.elapsed
    # process CPU time cannot be split between setup and generation: report it for the call
    res["call_cpu_per_wall"] = res.pop("cpu_per_wall")
    if all(getattr(o, "timestamps", None) for o in outs):
        res["prefill_s"] = max(o.timestamps[0] for o in outs) - start  # type: ignore[index]
        res["decode_s"] = res["elapsed_s"] - res["prefill_s"]
    return res, tokens


def run_hf_baselines(
    args: argparse.Namespace, prompts: list[list[int]]
) -> Iterator[tuple[str, dict[str, Any], list[list[int]] | None]]:
    """Yield (name, figures, tokens) per baseline; a baseline that cannot run yields its
    error and None, so the others still report."""
    t0 = time.perf_counter()
    try:
        model = load_hf_model(args.model)
    except Exception as e:  # e.g. a GGUF layout transformers' GGUF loader does not map
        yield "hf_generate", {"error": f"transformers cannot load it: {type(e).__name__}: "
                                       f"{str(e).splitlines()[0]}"}, None
        return
    load_s = time.perf_counter() - t0
    gen_res, gen_tokens = run_generate(model, prompts, args)
    gen_res["load_s"] = load_s
    yield "hf_generate", gen_res, gen_tokens
    if not getattr(args, "generate_batch", True):
        return
    if not hasattr(model, "generate_batch"):
        yield "hf_generate_batch", {"error": "this transformers has no generate_batch"}, None
        return
    try:
        cb_res, cb_tokens = run_generate_batch(model, prompts, args)
    except Exception as e:  # report why it cannot run here, keep the other figures
        traceback.print_exc()
        yield "hf_generate_batch", {"error": f"{type(e).__name__}: {e}"}, None
        return

    cb_res["hf_generate_match"] = identical(gen_tokens, cb_tokens)
    yield "hf_generate_batch", cb_res, cb_tokens


def run_hf_continuous(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: list[int],
    cb_config: dict[str, Any] | None = None,
    progress: bool = True,
    warmup: bool = True,
) -> tuple[dict[str, Any], list[list[int]]]:
    """HF continuous batching with a per-request output length (EOS ignored, greedy).

    `cb_config` goes to transformers' ContinuousBatchingConfig (e.g. num_blocks and
    page_size to give HF the same KV budget as kvserve), under the names the installed
    version uses; fields it does not take are listed in the figures' "cb_config_dropped".
    Returns (figures, tokens in input order); the figures time the generation from the
    first add to the last result.
    """
    import transformers
    from transformers import GenerationConfig

    ContinuousBatchingConfig = getattr(transformers, "ContinuousBatchingConfig", None) or getattr(
        transformers.generation.configuration_utils, "ContinuousBatchingConfig", None)
    if ContinuousBatchingConfig is None or not hasattr(model, "continuous_batching_context_manager"):
        raise RuntimeError(f"transformers {transformers.__version__} has no ContinuousBatchingConfig "
                           "/ continuous_batching_context_manager: no continuous-batching baseline")
    if len(prompts) != len(max_new_tokens):
        raise ValueError("one max_new_tokens per prompt")
    eos = _eos_ids(model)
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(max_new_tokens), eos_token_id=-1,
        pad_token_id=eos[0] if eos else 0, suppress_tokens=eos or None,
    )
    cbc, dropped = make_cb_config(ContinuousBatchingConfig, cb_config or {})
    results: dict[str, Any] = {}
    cm_kwargs = supported_kwargs(model.continuous_batching_context_manager, warmup=warmup)
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cbc, block=True, timeout=5, **cm_kwargs
    ) as manager, progress_bar(progress, sum(max_new_tokens), "hf continuous") as bar:
        if warmup:  # one short request through the whole loop, untimed
            manager.add_request(prompts[0][:8], request_id="warm", max_new_tokens=2, eos_token_id=-1)
            while manager.get_result(timeout=60) is None:
                if not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped during warm-up")
        with Timer() as timer:
            for i, (p, n) in enumerate(zip(prompts, max_new_tokens, strict=True)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
            while len(results) < len(prompts):
                r = manager.get_result(timeout=1)
                if r is None:
                    if not manager.is_running():
                        raise RuntimeError(f"HF continuous batching stopped after {len(results)} results")
                    continue
                if r.is_finished():
                    if r.error is not None:
                        raise RuntimeError(f"HF request {r.request_id} failed: {r.error}")
                    results[r.request_id] = r
                    bar.update(len(r.generated_tokens))
    tokens = [list(results[f"r{i}"].generated_tokens) for i in range(len(prompts))]
    res = figures(timer, prompts, tokens)
    if dropped:
        res["cb_config_dropped"] = sorted(dropped)
    return res, tokens
