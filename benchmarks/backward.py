"""The CPU backward op against the forward op, interleaved in one process.

Per layout: ``permute_multi_embedding`` and ``permute_multi_embedding_backward`` with the
same plan tensors (warm: the plan is checked and compiled before timing), the backward
with contiguous upstream gradients (what a Linear hands back) and with stride-0 ones
(``loss = out.sum()``). Prints the median time of each and ``backward / forward`` (the
median of per-round ratios, and its range).

    python -m benchmarks.backward                         # narrow layout, B=32, 1 thread
    python -m benchmarks.backward --layout serving --batch 512 --threads 2
    python -m benchmarks.backward --dispatcher  # also both ops called from C++ (no Python)

From Python, each call pays PyTorch's argument parsing, which costs more for the
backward's ``Tensor?[]``, ``SymInt`` and ``ScalarType`` arguments than for the forward's;
``--dispatcher`` times the same calls made through the dispatcher from C++ (a small
extension built with ``torch.utils.cpp_extension.load_inline``), as autograd makes them.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.harness import NARROW, SEED, SERVING, interleaved, make_layout

LAYOUTS = {"narrow": NARROW, "serving": SERVING, "seed": SEED}
FORWARD, BACKWARD, EXPANDED = "forward op", "backward op", "backward op, stride-0 gradients"
CPP_FORWARD, CPP_BACKWARD = "forward op from C++", "backward op from C++"

_LOOPS = r"""
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <chrono>

// Seconds per call of n calls of each op through the dispatcher.
double forward_loop(std::vector<at::Tensor> values, at::Tensor permutes, at::Tensor in_shapes,
                    at::Tensor out_shapes, std::vector<int64_t> out_lengths, int64_t n) {
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("kt_regroup::permute_multi_embedding", "")
      .typed<std::vector<at::Tensor>(at::TensorList, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, c10::SymIntArrayRef)>();
  const auto lengths = c10::fromIntArrayRefSlow(out_lengths);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < n; ++k) op.call(values, permutes, in_shapes, out_shapes, lengths);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
}

double backward_loop(std::vector<at::Tensor> grads, at::Tensor permutes, at::Tensor in_shapes,
                     at::Tensor out_shapes, std::vector<int64_t> in_lengths, int64_t batch,
                     int64_t n) {
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("kt_regroup::permute_multi_embedding_backward", "")
      .typed<std::vector<at::Tensor>(const c10::List<std::optional<at::Tensor>>&,
                                     const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     c10::SymIntArrayRef, c10::SymInt, c10::ScalarType)>();
  c10::List<std::optional<at::Tensor>> list;
  for (const at::Tensor& g : grads) list.push_back(g);
  const auto lengths = c10::fromIntArrayRefSlow(in_lengths);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < n; ++k) {
    op.call(list, permutes, in_shapes, out_shapes, lengths, c10::SymInt(batch),
            grads[0].scalar_type());
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
}
"""


def _cpp_loops():
    import tempfile

    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "kt_regroup_bench_loops", cpp_sources=_LOOPS, functions=["forward_loop", "backward_loop"],
        build_directory=tempfile.mkdtemp(prefix="kt_regroup_bench_"), extra_cflags=["-O2"],
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="narrow")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=2000, help="calls per sample")
    parser.add_argument("--dispatcher", action="store_true",
                        help="also time both ops called from C++ through the dispatcher")
    args = parser.parse_args(argv)

    import kt_regroup

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    keys, lengths, groups = make_layout(**LAYOUTS[args.layout], scattered=True, duplicates=False)
    plan = kt_regroup.get_plan(keys, lengths, groups)
    permutes, in_shapes, out_shapes = plan.tensors()
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(args.batch, w, generator=gen).to(dtype) for w in plan.in_lengths]
    grads = [torch.randn(args.batch, n, generator=gen).to(dtype) for n in plan.out_lengths]
    ones = [torch.ones((), dtype=dtype).expand(args.batch, n) for n in plan.out_lengths]
    fwd = torch.ops.kt_regroup.permute_multi_embedding
    bwd = torch.ops.kt_regroup.permute_multi_embedding_backward
    out_lengths, in_lengths = list(plan.out_lengths), list(plan.in_lengths)

    def backward(g):
        return lambda: bwd(g, permutes, in_shapes, out_shapes, in_lengths, args.batch, dtype)

    fns = {FORWARD: lambda: fwd(values, permutes, in_shapes, out_shapes, out_lengths),
           BACKWARD: backward(grads), EXPANDED: backward(ones)}
    # The backward of the forward is the same copy the other way: checked before timing.
    outs = fns[FORWARD]()
    back = bwd(outs, permutes, in_shapes, out_shapes, in_lengths, args.batch, dtype)
    assert all(torch.equal(b, v) for b, v in zip(back, values)), "backward(forward(x)) != x"

    samples = interleaved(fns, args.rounds, number=args.number, warmup=1)
    if args.dispatcher:  # rounds of the two C++ loops, alternating
        loops = _cpp_loops()
        meta = (permutes, in_shapes, out_shapes)
        for _ in range(args.rounds):
            samples.setdefault(CPP_FORWARD, []).append(
                loops.forward_loop(values, *meta, out_lengths, args.number))
            samples.setdefault(CPP_BACKWARD, []).append(
                loops.backward_loop(grads, *meta, in_lengths, args.batch, args.number))
    med = {n: statistics.median(s) for n, s in samples.items()}
    print(f"{args.layout} layout, B={args.batch}, {args.dtype}, {args.threads} thread(s), "
          f"{args.rounds} rounds of {args.number} calls, copy program: "
          f"{torch.ops.kt_regroup._cpu_copy_program()}")
    print("| row | median us | / forward (same caller; median of rounds) | range |")
    print("|---|---:|---:|---|")
    for name, s in samples.items():
        base = samples[CPP_FORWARD if name.endswith("from C++") else FORWARD]
        ratios = [t / f for t, f in zip(s, base)]
        print(f"| {name} | {med[name] * 1e6:.2f} | {statistics.median(ratios):.3f} | "
              f"{min(ratios):.3f}-{max(ratios):.3f} |")


if __name__ == "__main__":
    main()
