"""The one ``specserve`` command.

    specserve generate "prompt" [--spec draft --k 4 --temperature 0 ...] [--server HOST:PORT]
    specserve serve [--port 9000]
    specserve demo "prompt"        (start the service, generate through it, stop)
    specserve models build [--preset builtin|tiny|bench] [--out DIR]
    specserve models info
    specserve bench [--out DIR]

Generated text goes to stdout only (it pipes cleanly); summaries and progress to stderr.
Bad flags or values: a message naming what to change, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import IO, Any

EXIT_USAGE = 2


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--spec", choices=["auto", "off", "draft", "ngram"], default="auto",
                   help="speculation: auto (the proposer and k picked every round by "
                        "goodput), off (plain decoding), draft (draft model), ngram "
                        "(prompt lookup); default auto")
    p.add_argument("--k", type=int, default=4,
                   help="draft tokens per round (0-16, default 4; auto: the most)")
    p.add_argument("--workload", default=None,
                   help="workload class, e.g. code or chat (spec=auto starts from the "
                        "fleet's acceptance for it; never changes the output)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="builtin-target",
                   help="target model: builtin-target, bench-target or a local HF checkpoint")
    p.add_argument("--drafter", default="builtin-drafter",
                   help="drafter model: builtin-drafter or a local HF checkpoint")


def request_from_args(args: argparse.Namespace, prompt: str):
    from pydantic import ValidationError

    from specserve.api import GenerationRequest, describe_validation_error

    try:
        return GenerationRequest(
            prompt=prompt, max_tokens=args.max_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
            spec=args.spec, k=args.k, workload=args.workload,
        )
    except ValidationError as e:
        raise UsageError(describe_validation_error(e)) from None


class UsageError(Exception):
    pass


def summary_line(st: dict, elapsed: float) -> str:
    tokens = st.get("output_tokens", 0)
    rate = tokens / elapsed if elapsed > 0 else 0.0
    ttft = st.get("ttft_s", st.get("ttft_ms", 0) / 1000)
    line = (
        f"[specserve] {tokens} tokens in {elapsed:.2f}s ({rate:.1f} tok/s, TTFT "
        f"{ttft * 1000:.0f} ms) | spec={st.get('spec')} k={st.get('k')} | "
        f"{st.get('tokens_per_round', 0):.2f} tokens/round, acceptance "
        f"{st.get('acceptance_rate', 0):.0%} | finish={st.get('finish_reason', '')} | target "
        f"{st.get('target_revision', '')}"
    )
    if st.get("drafter_revision"):
        line += f" drafter {st['drafter_revision']}"
    if st.get("speculation_disabled_reason"):
        line += f" | speculation off: {st['speculation_disabled_reason']}"
    return line


def stream_to(out: IO[str], client, args: argparse.Namespace) -> tuple[dict, str]:
    """Stream a generation through the SDK to ``out``; (final stats, finish reason)."""
    stats: dict = {}
    finish = ""
    for chunk in client.stream(
        args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
        spec=args.spec, k=args.k, workload=args.workload,
    ):
        out.write(chunk.text)
        out.flush()
        stats, finish = chunk.stats or stats, chunk.finish_reason or finish
    return stats, finish


def product_stdout() -> IO[str]:
    """Keep stdout for the command's product only: returns a stream on the real stdout and
    points file descriptor 1 (and ``sys.stdout``) at stderr, so whatever libraries print
    (Ray's log lines at shutdown, its C++ core) lands on stderr."""
    sys.stdout.flush()
    product = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return product


def local_service_starter() -> Callable[..., Any]:
    """The installed service's ``start_local(config, port, num_cpus)`` (registered by
    ``deployments`` under the ``specserve.service`` entry point: the core package never
    imports the services above it)."""
    for ep in entry_points(group="specserve.service"):
        if ep.name == "local":
            return ep.load()
    raise UsageError("the distributed service is not installed (pip install "
                     "'specserve[serve]' from a checkout)")


def _generate_remote(args: argparse.Namespace) -> int:
    import time

    from specserve.client import Client, SpecServeError

    t0 = time.perf_counter()
    try:
        with Client(args.server, timeout=args.timeout) as client:
            stats, finish = stream_to(sys.stdout, client, args)
    except SpecServeError as e:
        print(f"specserve generate: error: {e.code.name}: {e.details}", file=sys.stderr)
        return EXIT_USAGE if e.code.name in ("INVALID_ARGUMENT", "OUT_OF_RANGE") else 1
    sys.stdout.write("\n")
    print(summary_line({**stats, "finish_reason": finish}, time.perf_counter() - t0),
          file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    req = request_from_args(args, args.prompt)
    if args.server:
        return _generate_remote(args)
    quiet_libraries()
    from specserve.engine.generator import SpeculativeGenerator
    from specserve.errors import RequestError
    from specserve.models.load import IncompatiblePairError, load_pair

    try:
        pair = load_pair(args.target, args.drafter if req.spec in ("draft", "auto") else None)
    except (IncompatiblePairError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    gen = SpeculativeGenerator(pair)
    stats = None
    try:
        for chunk in gen.stream(req):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            stats = chunk.stats or stats
    except RequestError as e:
        raise UsageError(str(e)) from None
    sys.stdout.write("\n")
    print(summary_line(stats.to_dict(), stats.total_s), file=sys.stderr)
    return 0


def cmd_models_build(args: argparse.Namespace) -> int:
    from specserve.models.load import BUILTIN, default_home

    if args.preset == "bench":
        from specserve.models.widen import build_bench_pair

        out = Path(args.out) if args.out else default_home() / "models" / "bench"
        manifest = build_bench_pair(Path(args.source or BUILTIN), out, layers=args.layers,
                                    intermediate=args.intermediate)
    else:
        from specserve.models.build import PRESETS, build_pair

        out = Path(args.out) if args.out else (
            BUILTIN if args.preset == "builtin" else default_home() / "models" / args.preset)
        cfg = PRESETS[args.preset]
        if args.target_steps:
            cfg = cfg.model_copy(update={"target_steps": args.target_steps})
        if args.drafter_steps:
            cfg = cfg.model_copy(update={"drafter_steps": args.drafter_steps})
        quiet_libraries()
        manifest = build_pair(out, cfg, args.preset)
    print(json.dumps({k: manifest[k] for k in ("target", "drafter")}, indent=2), file=sys.stderr)
    print(out)
    return 0


def cmd_models_info(args: argparse.Namespace) -> int:
    from specserve.models.load import BUILTIN

    path = Path(args.path or BUILTIN) / "manifest.json"
    if not path.exists():
        raise UsageError(f"no manifest at {path}")
    print(path.read_text(), end="")
    return 0


def _int_list(flag: str, value: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",")]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {value!r}") from None
    if any(x < 0 for x in out):
        raise UsageError(f"{flag}: values must be >= 0")
    return out


def _names(flag: str, value: str | None) -> list[str] | None:
    if value is None:
        return None
    out = [v.strip() for v in value.split(",") if v.strip()]
    if not out:
        raise UsageError(f"{flag}: expected comma-separated names, got {value!r}")
    return out


def _started_service_config(args: argparse.Namespace) -> dict | None:
    """What ``--draft-ahead`` and ``--round-log`` add to the config of the service the bench
    starts (a running one, ``--server``, has its own)."""
    def started_only(flag: str, setting: str) -> None:
        if not (args.service or args.suite) or args.server:
            raise UsageError(f"{flag}: only with --service or --suite starting the service (a "
                             f"running one, --server, has its own {setting} setting)")

    cfg: dict = {}
    if args.draft_ahead is not None:
        started_only("--draft-ahead", "drafter.draft_ahead")
        if not 0 <= args.draft_ahead <= 4:
            raise UsageError(f"--draft-ahead: GUESSES must be 1-4, got {args.draft_ahead}")
        cfg["drafter"] = {"draft_ahead": True, **({"draft_ahead_guesses": args.draft_ahead}
                                                   if args.draft_ahead else {})}
    if args.round_log is not None:
        started_only("--round-log", "router.round_log")
        path = Path(args.round_log).resolve()
        if not path.parent.is_dir():
            raise UsageError(f"--round-log: no directory {str(path.parent)!r}; create it or "
                             "give another path")
        cfg["router"] = {"round_log": str(path)}
    return cfg or None


def cmd_bench(args: argparse.Namespace) -> int:
    out = product_stdout()  # the report's summary only; Ray's lines go to stderr
    quiet_libraries()
    started = _started_service_config(args)
    if args.repeats != 1 and not args.suite:
        raise UsageError("--repeats: only with --suite")
    if args.concurrency is None:
        args.concurrency = "1,2,4,8,16,32" if args.suite else "1,4,16"
    if args.suite:
        from specserve.bench.analysis import FINE_LEVELS
        from specserve.bench.suite import run_suite
        from specserve.bench.workloads import BUILTIN_CLASSES, WorkloadError, load_jsonl

        levels = list(FINE_LEVELS) if args.concurrency == "fine" else \
            _int_list("--concurrency", args.concurrency)
        if not levels or min(levels) < 1:
            raise UsageError("--concurrency: levels must be >= 1")
        if args.rate is not None and args.rate <= 0:
            raise UsageError("--rate must be > 0 requests/s")
        if args.repeats < 1:
            raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
        classes = None
        if args.workload:
            try:
                classes = load_jsonl(Path(args.workload))
            except (OSError, WorkloadError) as e:
                raise UsageError(f"--workload: {e}") from None
        only = _names("--classes", args.classes)
        known = {*(classes or BUILTIN_CLASSES), "mixed"}
        if only and not set(only) <= known:
            raise UsageError(f"--classes: unknown {sorted(set(only) - known)}; "
                             f"choose among {sorted(known)}")
        report = run_suite(
            args.server or local_service_starter(), args.target, args.drafter, levels,
            _int_list("--ks", args.ks) if args.ks else [2, 4], Path(args.out), classes=classes,
            requests_per_level=args.prompts, baselines=not args.no_hf,
            poisson_rate=args.rate, only=only, app_config=started, repeats=args.repeats)
        print((Path(args.out) / "summary.md").read_text(), file=out)
        return 0 if report["mismatches"]["total"] == 0 else 1
    if args.service or args.server:
        from specserve.bench.service import run_service_bench, summarize

        conc = _int_list("--concurrency", args.concurrency)
        if not conc or min(conc) < 1:
            raise UsageError("--concurrency: levels must be >= 1")
        report = run_service_bench(
            args.server or local_service_starter(), args.target, args.drafter, conc,
            _int_list("--ks", args.ks) if args.ks else [2, 4], args.max_tokens,
            Path(args.out), requests_per_level=args.prompts,
            only=args.configs.split(",") if args.configs else None,
            app_config=started)
        print(json.dumps(summarize(report), indent=1), file=out)
        return 0
    from specserve.bench.single import run_single_process_bench

    if args.ks:
        try:
            ks = [int(x) for x in args.ks.split(",")]
        except ValueError:
            raise UsageError(f"--ks: expected comma-separated integers, got {args.ks!r}") from None
    else:
        ks = list(range(1, 9))
    if args.prompts < 1 or args.max_tokens < 1:
        raise UsageError("--prompts and --max-tokens must be >= 1")
    report = run_single_process_bench(
        target=args.target, drafter=args.drafter, ks=ks, n_prompts=args.prompts,
        max_tokens=args.max_tokens, out_dir=Path(args.out), with_hf=not args.no_hf,
    )
    print(json.dumps(report["summary"], indent=2), file=out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve", description="Exact speculative decoding: generate, build models, bench.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a generation to stdout (single process)")
    g.add_argument("prompt", help="prompt text")
    add_sampling_flags(g)
    add_model_flags(g)
    g.add_argument("--server", help="HOST:PORT of a running `specserve serve`: generate "
                                    "through the gRPC client SDK instead of in this process")
    g.add_argument("--timeout", type=float, default=120.0, help="--server: deadline (s)")
    g.set_defaults(func=cmd_generate)

    for ep in entry_points(group="specserve.commands"):  # `serve`, `demo` (deployments/)
        ep.load()(sub)

    m = sub.add_parser("models", help="build or inspect model pairs")
    msub = m.add_subparsers(dest="models_command", required=True)
    b = msub.add_parser("build", help="train a pair (builtin, tiny) or derive the bench pair")
    b.add_argument("--preset", choices=["builtin", "tiny", "bench"], default="builtin",
                   help="builtin: the committed ~3.6M/0.95M pair (about 15 min on 2 cores); "
                        "tiny: seconds, for tests; bench: the cost-scaled target (seconds)")
    b.add_argument("--out", help="output directory (default: the preset's home)")
    b.add_argument("--target-steps", type=int, help="override training steps of the target")
    b.add_argument("--drafter-steps", type=int, help="override training steps of the drafter")
    b.add_argument("--source", help="bench: the trained pair to widen (default: builtin)")
    b.add_argument("--layers", type=int, default=12, help="bench: total target layers")
    b.add_argument("--intermediate", type=int, default=4096, help="bench: target MLP width")
    b.set_defaults(func=cmd_models_build)
    i = msub.add_parser("info", help="print a pair's manifest")
    i.add_argument("path", nargs="?", help="pair directory (default: builtin)")
    i.set_defaults(func=cmd_models_info)

    bench = sub.add_parser("bench", help="benchmarks, baselines in the same run: single process "
                                         "(default) or the service (--service / --server)")
    add_model_flags(bench)
    bench.add_argument("--ks", help="comma-separated K values for draft mode (default 1..8)")
    bench.add_argument("--prompts", type=int, default=10, help="held-out prompts (default 10)")
    bench.add_argument("--max-tokens", type=int, default=96, help="tokens per prompt")
    bench.add_argument("--out", default="bench-results", help="report directory")
    bench.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines")
    bench.add_argument("--server", help="HOST:PORT: benchmark a running service through the SDK")
    bench.add_argument("--service", action="store_true",
                       help="start a local service (Ray) and benchmark it through the SDK; run "
                            "it in a loopback-only network namespace (see README)")
    bench.add_argument("--concurrency", default=None,
                       help="closed-loop concurrency levels (default: 1,4,16 for --service; "
                            "1,2,4,8,16,32 for --suite); --suite also takes 'fine': "
                            "1,2,3,4,6,8,12,16,24,32")
    bench.add_argument("--configs", help="--service/--server: comma-separated configurations "
                       "to run besides spec-off (off, draft_k<K>, ngram_k4, auto; default all)")
    bench.add_argument("--draft-ahead", nargs="?", type=int, const=0, default=None,
                       metavar="GUESSES",
                       help="--service / --suite: start the service with drafter.draft_ahead "
                            "on, and GUESSES next tokens guessed per row if given (1-4; "
                            "from 2 each rejection is prepared too; compare with a run "
                            "without it: bench/draft_ahead.sh)")
    bench.add_argument("--round-log", metavar="PATH",
                       help="--service / --suite: start the service with router.round_log "
                            "= PATH (one JSON line per round; bench/round_costs.py compares "
                            "what the cost model measures with each run's tokens/s)")
    bench.add_argument("--suite", action="store_true",
                       help="the adoption benchmark: workload classes x concurrency x configs "
                            "+ HF/naive/engine baselines; report.json, outputs.jsonl, "
                            "summary.md, plots (starts a service unless --server)")
    bench.add_argument("--workload", help="--suite: JSONL of {prompt, max_tokens?, class?} "
                                          "instead of the built-in classes")
    bench.add_argument("--classes", help="--suite: comma-separated workload classes to run "
                       "(default all, and mixed; e.g. code-short,mixed)")
    bench.add_argument("--rate", type=float, help="--suite: also an open-loop Poisson run at "
                                                  "this many requests/s")
    bench.add_argument("--repeats", type=int, default=1,
                       help="--suite: run every level's configurations N times, interleaved "
                            "(each in every position in turn), and report the median runs "
                            "(default 1)")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"specserve {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # run the importable module's main: one UsageError class
    from specserve.cli import main as _main

    sys.exit(_main())
