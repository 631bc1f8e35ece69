"""FP8 (torch._scaled_mm via Float8Linear) vs BF16 throughput of a transformer-MLP-sized stack.

Prepared for a single FP8-capable GPU (compute capability >= 8.9, e.g. H100/H200); not run
here. Without CUDA it exits with status 2 and a clear message. The precisions are timed
interleaved (bf16, fp8, fp8, bf16; each figure the mean of its two rounds). Writes
``docs/results/gpu_fp8_throughput.json`` (``--out-dir`` elsewhere)::

    python benchmarks/gpu_fp8_throughput.py --hidden 4096 --ffn 14336 --tokens 8192 --layers 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from report import write_result

from lightning_mmpar.precision.fp8 import FP8Policy, convert_to_fp8, detect_backend, set_precision


def build(hidden: int, ffn: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):  # up-projection, activation, down-projection (LLaMA-style sizes)
        mods += [nn.Linear(hidden, ffn, bias=False), nn.GELU(), nn.Linear(ffn, hidden, bias=False)]
    return nn.Sequential(*mods)


def time_ms(model: nn.Module, x: torch.Tensor, iters: int, backward: bool) -> float:
    for _ in range(3):
        y = model(x)
        if backward:
            y.float().square().mean().backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        y = model(x)
        if backward:
            y.float().square().mean().backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out-dir", type=Path, default=None, help="default docs/results")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_fp8_throughput: no CUDA device available; this benchmark needs an FP8-capable "
            "GPU (compute capability >= 8.9). Nothing measured.",
            file=sys.stderr,
        )
        return 2
    info = detect_backend("auto")
    torch.manual_seed(0)
    model = build(a.hidden, a.ffn, a.layers).cuda().to(torch.bfloat16)
    convert_to_fp8(model, FP8Policy(backend=info.name))
    x = torch.randn(a.tokens, a.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flops = 2 * a.tokens * a.hidden * a.ffn * 2 * a.layers  # forward matmul FLOPs
    res: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "backend": info.name,
        "backend_reason": info.reason,
        "config": vars(a),
    }
    timed: dict[str, list[tuple[float, float]]] = {"bf16": [], "fp8": []}
    for prec in ("bf16", "fp8", "fp8", "bf16"):  # interleaved: A B B A
        set_precision(model, prec)  # type: ignore[arg-type]
        timed[prec].append(
            (time_ms(model, x, a.iters, backward=False), time_ms(model, x, a.iters, backward=True))
        )
    for prec, rounds in timed.items():
        fwd, step = (sum(r[k] for r in rounds) / len(rounds) for k in (0, 1))
        res[prec] = {
            "forward_ms": fwd,
            "fwd_bwd_ms": step,
            "forward_tflops": flops / fwd / 1e9,
            "fwd_bwd_tflops": 3 * flops / step / 1e9,
            "rounds_ms": rounds,
        }
    bf, f8 = res["bf16"], res["fp8"]
    assert isinstance(bf, dict) and isinstance(f8, dict)
    res["speedup_fp8_vs_bf16_forward"] = bf["forward_ms"] / f8["forward_ms"]
    res["speedup_fp8_vs_bf16_fwd_bwd"] = bf["fwd_bwd_ms"] / f8["fwd_bwd_ms"]
    print(json.dumps(res, indent=2))
    print(f"wrote {write_result('gpu_fp8_throughput', res, a.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
