"""GPU check of the target's verify cost: verify(K) vs a 1-token step, on one CUDA GPU.

    python bench/gpu_check.py [--size 1b] [--dtype bfloat16] [--batches 1,8] [--context 512]
                              [--tp-path]

Needs one CUDA GPU (exits 2 with a clear message otherwise). Builds a randomly initialised
Llama target of the chosen size on the GPU (no hub access needed: what matters here is the
cost of a forward, not its tokens), and times the service's own verify code path,
``specserve.engine.target.TargetEngine.verify``, in steady state: every session holds
``--context`` tokens of KV and each step sends 1 newly committed token + K drafts (K = 0 is
the plain 1-token decode step). CUDA events around each call (after a synchronize), median
of ``--iters``. Prints per batch size and K: ms per verify, ms per row, and cost(K) /
cost(1-token step); writes bench-results/gpu_check.json.

``--tp-path`` also runs the tensor-parallel code path of the service with one rank (nccl
group of world size 1, the checkpoint saved to a temp dir and loaded with transformers'
``tp_plan="auto"``, driven through ``TPTargetEngine``): the same numbers, so the overhead
of the TP machinery itself (broadcast, DTensor dispatch) is visible before running TP > 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = {  # Llama shapes: hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": (256, 2, 4, 4, 768, 4096),  # smoke test only (--allow-cpu)
    "1b": (2048, 16, 32, 8, 8192, 32000),
    "3b": (3072, 28, 24, 8, 8192, 32000),
    "8b": (4096, 32, 32, 8, 14336, 32000),
}


def build_model(size: str, dtype: torch.dtype, device: str, context: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, inter, vocab = SIZES[size]
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                      max_position_embeddings=max(2048, context + 64), tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.eval()
    return model


def _items(b: int, step: int, k: int, context: int, vocab: int, tag: str) -> list:
    from specserve.core.sampling import SamplingParams
    from specserve.engine.target import VerifyItem

    out = []
    for i in range(b):
        prompt = [(7 * i + j) % (vocab - 1) + 1 for j in range(context)]
        committed = prompt + [(11 * i + s) % (vocab - 1) + 1 for s in range(step)]
        drafts = [(13 * i + step + d) % (vocab - 1) + 1 for d in range(k)]
        start = 0 if step == 0 else len(committed) - 1
        out.append(VerifyItem(f"{tag}-{b}-{k}-{i}", len(committed), start, committed[start:],
                              drafts, None, SamplingParams()))
    return out


def time_verify(engine, vocab: int, batches: list[int], ks: list[int], context: int,
                iters: int, device: str, tag: str) -> dict:
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    res: dict = {}
    for b in batches:
        row: dict = {}
        for k in ks:
            engine.verify(_items(b, 0, k, context, vocab, tag))  # prefill the sessions
            for s in range(1, 4):
                engine.verify(_items(b, s, k, context, vocab, tag))  # warm up
            times = []
            for s in range(4, 4 + iters):
                items = _items(b, s, k, context, vocab, tag)
                sync()
                if device == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                        enable_timing=True)
                    start.record()
                    engine.verify(items)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                else:
                    import time

                    t = time.perf_counter()
                    engine.verify(items)
                    times.append(1e3 * (time.perf_counter() - t))
            for i in range(b):
                engine.release(f"{tag}-{b}-{k}-{i}")
            row[k] = statistics.median(times)
        res[b] = {str(k): {"ms": ms, "ms_per_row": ms / b, "vs_1_token_step": ms / row[0]}
                  for k, ms in row.items()}
    return res


def run_tp_path(model, args, dtype: torch.dtype, device: str) -> dict:
    """The service's TP code path with one rank (world size 1)."""
    from target_service.tp import TPTargetEngine, free_port, setup_rank

    with tempfile.TemporaryDirectory(prefix="specserve-gpu-check-") as tmp:
        model.save_pretrained(tmp)
        backend = "nccl" if device == "cuda" else "gloo"
        engine = setup_rank(0, 1, "127.0.0.1", free_port("127.0.0.1"), backend, 300.0, tmp,
                            args.cache_bytes, dtype)
        tp = TPTargetEngine(engine, [], heartbeat_s=3600)
        try:
            return time_verify(tp, model.config.vocab_size, args.batches, args.ks,
                               args.context, args.iters, device, "tp")
        finally:
            tp.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ks", default="0,1,2,3,4,5,6,7,8", help="K values; 0 = 1-token step")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--cache-bytes", type=int, default=16 << 30)
    ap.add_argument("--tp-path", action="store_true", help="also time the TP code path (1 rank)")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "gpu_check.json"))
    ap.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # smoke test
    args = ap.parse_args()
    args.batches = [int(x) for x in args.batches.split(",")]
    args.ks = [int(x) for x in args.ks.split(",")]
    if 0 not in args.ks:
        args.ks = [0, *args.ks]
    if torch.cuda.is_available():
        device = "cuda"
    elif args.allow_cpu:
        device = "cpu"
    else:
        sys.stderr.write("bench/gpu_check.py: error: no CUDA GPU visible (torch "
                         f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                         "run it on a GPU machine with a CUDA build of torch\n")
        return 2
    dtype = getattr(torch, args.dtype)
    from specserve.engine.quiet import quiet_libraries
    from specserve.engine.target import TargetEngine

    quiet_libraries()
    model = build_model(args.size, dtype, device, args.context)
    params = sum(p.numel() for p in model.parameters())
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    engine = TargetEngine(model, cache_budget_bytes=args.cache_bytes)
    result: dict = {"device": gpu, "size": args.size, "params": params, "dtype": args.dtype,
                    "context": args.context, "iters": args.iters,
                    "tp1": time_verify(engine, model.config.vocab_size, args.batches, args.ks,
                                       args.context, args.iters, device, "tp1")}
    if args.tp_path:
        result["tp_path_world1"] = run_tp_path(model, args, dtype, device)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    sys.stdout.write(f"{gpu}: random Llama {args.size} ({params / 1e9:.2f} B params, "
                     f"{args.dtype}), context {args.context}\n")
    for name in [n for n in ("tp1", "tp_path_world1") if n in result]:
        for b, row in result[name].items():
            cells = " ".join(f"K={k}:{v['ms']:.2f}ms({v['vs_1_token_step']:.2f}x)"
                             for k, v in row.items())
            sys.stdout.write(f"{name} batch {b}: {cells}\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
