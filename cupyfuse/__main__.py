"""Command line: ``python -m cupyfuse {bench,info}`` (console script ``cupyfuse``).

    cupyfuse bench [--problems 55,56,98,39] [--sizes kernelbench,seed,small]
                   [--seeds 0,1,2] [--json PATH] [--plot PATH.png] [--no-compile] [--reps N]
    cupyfuse bench --model FILE [FILE ...] [--seeds 0,1,2] [--reps N] [--json PATH]
                   [--cpu-max-gb GB]
    cupyfuse bench --sweep [--reps N] [--json PATH] [--plot PATH.png]
    cupyfuse bench --lm-head [--tokens 4096,16384] [--vocab 128256,32000] [--hidden 4096]
                   [--dtype bf16] [--reps N] [--no-compile] [--json PATH]
    cupyfuse gemm-bench [--shapes MxNxK,...] [--json PATH]
    cupyfuse info
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from cupyfuse.bench.problems import ALL_PROBLEMS, ALL_SIZES, DEFAULT_GPU_SIZES, DEFAULT_REPS, DEFAULT_SEEDS

    parser = argparse.ArgumentParser(
        prog="cupyfuse",
        description="Fused CUDA kernels for 'Linear + cheap tail' models: any such model "
                    "(cupyfuse.from_model / fused_class), and named ops for KernelBench "
                    "level 2's 55, 56, 98 and 39.")
    sub = parser.add_subparsers(dest="command", metavar="{bench,gemm-bench,info}")
    sub.required = True

    b = sub.add_parser(
        "bench", help="check correctness against a float64 reference and time against PyTorch",
        description="For each problem and size: check the fused module against the original "
                    "model in float64 (several seeds, two input distributions, "
                    "allclose atol=rtol=1e-4), then on a GPU time PyTorch eager fp32 (TF32 off), "
                    "torch.compile and cupyfuse. Without a GPU, only the CPU path is checked, "
                    "at size 'small'. Exit code 0 when every check passed, 1 otherwise.")
    b.add_argument("--problems", default=",".join(ALL_PROBLEMS),
                   help=f"comma-separated problems (default: all, {','.join(ALL_PROBLEMS)})")
    b.add_argument("--sizes", default=None,
                   help=f"comma-separated sizes, from {','.join(ALL_SIZES)} ('seed' exists for "
                        f"39 only); default {','.join(DEFAULT_GPU_SIZES)} on a GPU, "
                        "small without one")
    b.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)),
                   help="comma-separated input seeds for the correctness check (default: "
                        f"{','.join(map(str, DEFAULT_SEEDS))})")
    b.add_argument("--json", dest="json_path", metavar="PATH", default=None,
                   help="write every number (and the device, versions, date) to this JSON file")
    b.add_argument("--plot", dest="plot_path", metavar="PATH.png", default=None,
                   help="write a bar chart of the timings (needs matplotlib)")
    b.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip timing torch.compile")
    b.add_argument("--reps", type=int, default=DEFAULT_REPS, metavar="N",
                   help=f"timed runs per measurement, median reported (default: {DEFAULT_REPS})")
    b.add_argument("--model", nargs="+", metavar="FILE", default=None,
                   help="check and time these model files in KernelBench's format (a Model "
                        "class, get_inputs(), get_init_inputs()) instead of the four problems: "
                        "fused_class(Model) vs the original, KernelBench's timing (grad mode, "
                        "L2 flushed) and under no_grad")
    b.add_argument("--train", action="store_true",
                   help="--model: also a training step (forward + backward, parameters and "
                        "floating inputs requiring grad): gradients vs float64, and on a GPU "
                        "the step's time and peak memory, eager vs fused")
    b.add_argument("--cpu-max-gb", type=float, default=None, metavar="GB",
                   help="--model without a GPU: skip (and say so) a file whose check needs "
                        "more memory than this (default: 80%% of the available memory)")
    b.add_argument("--sweep", action="store_true",
                   help="every calling mode (module no_grad / grad, function with torch / "
                        "CuPy operands, the CuPy weight prepared or plain) over the grid: the four models x batch {1, 8, 64, "
                        "512, 4096} x features {1024, 4096, 16384}; speedup per cell over "
                        "its baseline, host cost per call; --json and --plot (heat map) "
                        "apply (GPU only)")
    b.add_argument("--lm-head", dest="lm_head", action="store_true",
                   help="a language-model head and its cross entropy (linear_cross_entropy) "
                        "at --tokens x --hidden -> --vocab: forward and training step, time "
                        "and peak memory against eager, torch.compile, Liger-Kernel (when "
                        "importable) and the three GEMMs alone; errors vs float64 (GPU only)")
    b.add_argument("--tokens", default="4096,16384", help="--lm-head: comma-separated token counts")
    b.add_argument("--vocab", default="128256,32000", help="--lm-head: comma-separated vocabularies")
    b.add_argument("--hidden", type=int, default=4096, help="--lm-head: hidden size")
    b.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                   help="--lm-head: the operands' dtype")
    b.set_defaults(subparser=b)

    gb = sub.add_parser("gemm-bench", help="our sm90 GEMM engine vs cuBLAS (GPU only)",
                        description="Time and check the sm90 engine ('highest' = 3xTF32, "
                                    "'high' = TF32, 'medium' = BF16) against cuBLAS fp32, TF32 "
                                    "and BF16 on the shapes of the four models and 8192^3: ms, "
                                    "TFLOP/s, GB/s and max relative error vs float64.")
    gb.add_argument("--json", dest="json_path", metavar="PATH", default=None)
    gb.add_argument("--shapes", default=None,
                    help="comma-separated MxNxK shapes (default: 8192^3 and the models' GEMMs)")

    sub.add_parser("info", help="versions, device and GEMM engine (cupyfuse.info())")
    return parser


def _format_info(inf: dict[str, Any]) -> str:
    width = max((len(str(k)) for k in inf), default=0)
    return "\n".join(f"{str(k).ljust(width)} : {v}" for k, v in inf.items())


def _cmd_info() -> int:
    from cupyfuse import info

    print(_format_info(info()))
    return 0


def _cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.sweep:
        from cupyfuse.bench.sweep import run_sweep

        return run_sweep(reps=args.reps, json_path=args.json_path, plot_path=args.plot_path)
    if args.lm_head:
        from cupyfuse.bench.lmhead import run_lm_head_bench

        try:
            tokens = [int(v) for v in args.tokens.split(",")]
            vocabs = [int(v) for v in args.vocab.split(",")]
        except ValueError:
            parser.error("--tokens and --vocab take comma-separated integers")
        return run_lm_head_bench(tokens, args.hidden, vocabs, args.dtype, reps=args.reps,
                                 compile_=args.compile, json_path=args.json_path)
    if args.model:
        from cupyfuse.bench.model import run_model_bench
        from cupyfuse.bench.problems import parse_seeds

        return run_model_bench(args.model, seeds=parse_seeds(args.seeds),
                               reps=args.reps, json_path=args.json_path,
                               cpu_max_gb=args.cpu_max_gb, train=args.train)
    from cupyfuse.bench.problems import BenchOptions, parse_problems, parse_seeds, parse_sizes, run_bench

    try:
        opts = BenchOptions(problems=parse_problems(args.problems), sizes=parse_sizes(args.sizes),
                            seeds=parse_seeds(args.seeds), reps=args.reps, compile=args.compile,
                            json_path=args.json_path, plot_path=args.plot_path)
    except ValueError as exc:
        parser.error(str(exc))  # exits with code 2
    if opts.reps < 1:
        parser.error("--reps must be at least 1")
    return run_bench(opts)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m cupyfuse`` and the ``cupyfuse`` console script."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.command == "info":
        return _cmd_info()
    if args.command == "bench":
        return _cmd_bench(args, args.subparser)
    if args.command == "gemm-bench":
        from cupyfuse.bench.gemm import run_gemm_bench

        shapes = None
        if args.shapes:
            try:
                shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
                assert all(len(s) == 3 and min(s) > 0 for s in shapes)
            except (ValueError, AssertionError):
                parser.error(f"--shapes must look like 128x512x8192,1024x1024x1024, got {args.shapes!r}")
        return run_gemm_bench(shapes, args.json_path)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
