"""Issue 10's collective targets from a sweep's JSON files (pynccl.bench -J, --impl both):
busbw of pynccl >= torch.distributed's at every size >= 32 MiB (ratio >= 1.00), time per op
<= torch's at <= 64 KiB, per op, out-of-place and in-place. Prints, per op and mode, the worst
and median ratio in each range and the sizes that miss.

    python benchmarks/check_targets.py results/DIR/eager_*.json
"""
import json
import statistics
import sys

LARGE, SMALL = 32 << 20, 64 << 10


def rows(path):
    d = json.load(open(path))
    impls = d["pynccl"]["implementations"]
    ours, theirs = impls["pynccl"]["results"], impls["torch"]["results"]
    return d["pynccl"]["op"], d["pynccl"]["world_size"], list(zip(ours, theirs))


def main(paths):
    print(f"{'op':<15}{'mode':<13}{'busbw ratio >= 32 MiB (min / median)':>38}{'time ratio <= 64 KiB (max / median)':>38}"
          "  misses")
    for path in paths:
        op, ws, pairs = rows(path)
        for mode in ("out_of_place", "in_place"):
            big = [(a["size"], b[mode]["time"] / a[mode]["time"]) for a, b in pairs if a["size"] >= LARGE]
            small = [(a["size"], a[mode]["time"] / b[mode]["time"]) for a, b in pairs if a["size"] <= SMALL]
            miss = [f"{s}B busbw {r:.2f}" for s, r in big if r < 1.0] + [f"{s}B time {r:.2f}" for s, r in small if r > 1.0]
            b = f"{min(r for _, r in big):.3f} / {statistics.median(r for _, r in big):.3f}" if big else "-"
            s = f"{max(r for _, r in small):.3f} / {statistics.median(r for _, r in small):.3f}" if small else "-"
            print(f"{op:<15}{mode:<13}{b:>38}{s:>38}  {', '.join(miss) if miss else 'none'}")


if __name__ == "__main__":
    main(sys.argv[1:])
