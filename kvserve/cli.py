"""The `kvserve` command line: generate, chat, serve and bench (Ray loads only to serve)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

DEFAULT_SYSTEM = None


# the flags of _engine_args (their argparse names)
ENGINE_FLAGS = ("model", "kv_cache_tokens", "block_size", "dtype", "kv_cache_dtype", "device", "max_model_len",
                "threads", "tensor_parallel_size", "cpu_matmul")


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    from kvserve.models import MODEL_HELP

    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="device KV pool capacity in tokens")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--kv-cache-dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"],
                   help="KV cache dtype (auto: the model's); float16 on the CPU halves the bytes "
                        "decode attention reads")
    g.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    g.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="devices the engine spans (one rank process per device)")
    g.add_argument("--cpu-matmul", choices=["int8", "exact"], default=None,
                   help="CPU on GGUF blocks: 8-bit activations with integer dot products (int8, "
                        "llama.cpp's scheme; the default) or float32 ones (exact)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s names: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' or method draft_model with "model"')


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="the output is JSON matching the JSON schema in FILE")


def _settings(a: argparse.Namespace) -> dict[str, Any]:
    keys = {
        "kv_cache_tokens": a.kv_cache_tokens, "block_size": a.block_size, "dtype": a.dtype,
        "kv_cache_dtype": a.kv_cache_dtype,
        "device": a.device, "max_model_len": a.max_model_len, "num_threads": a.threads,
        "tensor_parallel_size": a.tensor_parallel_size,
        "speculative_config": a.speculative_config, "cpu_matmul": a.cpu_matmul,
    }
    return {k: v for k, v in keys.items() if v is not None}


def _params(a: argparse.Namespace):
    from kvserve.errors import InvalidRequestError
    from kvserve.sampling import parse_sampling_params
    from kvserve.structured import json_schema_output

    structured = None
    if getattr(a, "json_schema", None):
        try:
            with open(a.json_schema, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise InvalidRequestError(f"--json-schema {a.json_schema}: {e.strerror or e}") from None
        structured = json_schema_output(text, where=f"--json-schema {a.json_schema}")
    return parse_sampling_params({
        "max_tokens": a.max_tokens, "temperature": a.temperature, "top_p": a.top_p,
        "top_k": a.top_k, "min_p": a.min_p, "repetition_penalty": a.repetition_penalty,
        "seed": a.seed, "stop": a.stop, "ignore_eos": a.ignore_eos, "structured": structured,
    })


def _stream(llm, prompt_ids: list[int], params) -> str:
    """Print one request's text as it is generated; return the full text."""
    eng = llm.engine
    rid = eng.add_request(prompt_ids, params)
    text = ""
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id != rid:
                continue
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            text += out.delta_text
            if out.finished:
                sys.stdout.write("\n")
                return text
    return text


def cmd_generate(a: argparse.Namespace) -> int:
    from kvserve.llm import LLM

    params = _params(a)
    tls_flags = [f for f, v in (("--tls", a.tls), ("--ca", a.ca), ("--cert", a.cert),
                                ("--key", a.key)) if v]
    if tls_flags and not a.server:
        from kvserve.errors import ConfigError

        raise ConfigError(f"{', '.join(tls_flags)}: for a server (--server HOST:PORT) only")
    if a.server:  # stream from a running server over gRPC instead of loading the model here
        from kvserve.errors import ConfigError
        from kvserve.grpc_client import cmd_generate_remote

        engine_flags = [f"--{k.replace('_', '-')}" for k, v in vars(a).items()
                        if k in ENGINE_FLAGS and v is not None]
        if engine_flags:  # the server's engine is set where it was started
            raise ConfigError(f"{', '.join(engine_flags)} set the engine of an offline run and "
                              f"cannot apply to the running server at {a.server}: drop them, or "
                              "give them to its `kvserve serve`")

        return cmd_generate_remote(a, params.model_dump(exclude_defaults=True) | {
            "max_tokens": params.max_tokens, "temperature": params.temperature})
    with LLM(model=a.model, **_settings(a)) as llm:
        _stream(llm, llm.tokenizer.encode(a.prompt), params)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from kvserve.llm import LLM

    params = _params(a)
    with LLM(model=a.model, **_settings(a)) as llm:
        return _chat(llm, a, params)


def _chat(llm: Any, a: argparse.Namespace, params: Any) -> int:
    messages: list[dict[str, str]] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    turns = [" ".join(a.message)] if a.message else None
    interactive = turns is None
    if interactive:
        print("kvserve chat: type a message, empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        if interactive:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
        else:
            if not turns:
                break
            line = turns.pop(0)
        messages.append({"role": "user", "content": line})
        ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        reply = _stream(llm, ids, params)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": reply})
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve", description="LLM serving with per-stream paged KV caches")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete a prompt with the model (offline)")
    g.add_argument("--prompt", required=True)
    _engine_args(g)
    _sampling_args(g, max_tokens=128)
    r = g.add_argument_group("remote")
    r.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="stream from a running `kvserve serve` over gRPC")
    r.add_argument("--api-key", default=None)
    r.add_argument("--session-id", default=None, help="multi-turn affinity (same worker)")
    r.add_argument("--tls", action="store_true",
                   help="connect with TLS (the system's CAs unless --ca); implied by --ca/--cert")
    r.add_argument("--ca", default=None, metavar="PEM", help="CA certificate(s) to verify the "
                   "server with (a server with a private CA)")
    r.add_argument("--cert", default=None, metavar="PEM",
                   help="client certificate, for a server that requires one (with --key)")
    r.add_argument("--key", default=None, metavar="PEM", help="the client certificate's key")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="chat with the model through its chat template (offline)")
    c.add_argument("message", nargs="*", help="the user message; none = interactive")
    c.add_argument("--system", default=DEFAULT_SYSTEM, help="system prompt (default: the template's)")
    _engine_args(c)
    _sampling_args(c, max_tokens=256)
    c.set_defaults(func=cmd_chat)
    from kvserve.deploy.serve_cli import add_serve_parser

    add_serve_parser(sub)
    from kvserve.bench import add_bench_parser

    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from kvserve.errors import KVServeError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KVServeError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
