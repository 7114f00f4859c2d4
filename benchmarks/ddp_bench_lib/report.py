"""ddp_bench's printed report: step times over the floor, the overhead ratio against torch DDP,
the levers table (--levers), and the CUDA diagnostics (buckets, pack kernel, phases, gaps).
"""
from .profiling import PHASES
from .trainer import FLOOR, ORACLE, VIEW


def print_report(r):
    views = {False: "False", True: "True", None: "each constructor's default (torch False, pynccl True)"}
    print(f"# pynccl DDP benchmark: {r['model_description']} ({r.get('num_params', 0) / 1e6:.1f}M params), batch {r['batch']}x"
          f"{r['seq']} tokens per rank, {r['precision']}{' autocast' if r['precision'] == 'bf16' else ''}, "
          f"world size {r['world_size']}, {r['device']}, torch {r['torch']}, NCCL {r['nccl']}, "
          f"gradient_as_bucket_view={' and '.join(views[v] for v in r['grad_view'])}"
          f"{' (modes marked' + VIEW + ': True, for both DDPs)' if True in r['grad_view'] else ''}")
    if r.get("comm_path"):
        print(f"# pynccl DDP's buckets (comm_path after the first step's rebuild): {r['comm_path']}")
    modes = r["modes"]

    def overhead(m):      # over the floor run the same way (eager, or captured in a graph)
        base = modes.get(FLOOR + " + graph" if "+ graph" in m else FLOOR, {}).get("median_ms")
        return (modes[m]["median_ms"] - base, base) if base else (float("nan"), float("nan"))

    print(f"# floor = '{FLOOR}': the same per-GPU work on the same GPU, no wrapper, no communication; medians of "
          f"{modes[next(iter(modes))]['n']} steps per mode, the modes alternating")
    print(f"{'mode':<28}{'median ms':>11}{'min':>9}{'max':>9}{'over floor ms':>15}{'over floor %':>14}"
          f"{'host ms':>9}")
    for m, s in modes.items():
        over, base = overhead(m)
        print(f"{m:<28}{s['median_ms']:>11.2f}{s['min_ms']:>9.2f}{s['max_ms']:>9.2f}{over:>15.3f}"
              f"{100 * over / base:>13.2f}%{s.get('host_ms', float('nan')):>9.2f}")
    print("# host ms: median time the step call took to return on the host (kernel launches, no sync); a step is "
          "host-bound where it approaches the step time")
    if r.get("phases"):
        print("# phases of eager steps (median ms): GPU time between events recorded at each phase's start, and the "
              "host time the phase's calls took")
        print(f"{'mode':<28}" + "".join(f"{'gpu ' + ph:>14}" for ph in PHASES) + "".join(f"{'host ' + ph:>15}" for ph in PHASES))
        for m, d in r["phases"].items():
            print(f"{m:<28}" + "".join(f"{d['gpu ' + ph]:>14.3f}" for ph in PHASES) +
                  "".join(f"{d['host ' + ph]:>15.3f}" for ph in PHASES))
        for m, d in r["phases"].items():
            if "gpu bwd compute" not in d:
                continue
            print(f"#   {m}: backward = compute {d['gpu bwd compute']:.3f} + waiting for the buckets "
                  f"{d['gpu bwd wait']:.3f} + tied rows {d['gpu bwd rows']:.3f} ms; per bucket (hand-out order) "
                  "ms after backward began, gradients ready -> reduction ended (its lag):")
            print("#     " + "; ".join(f"b{b['bucket']} {b['ready_ms']:.2f}->{b['done_ms']:.2f} "
                                       f"({b['done_ms'] - b['ready_ms']:+.2f})" for b in d["buckets"]))
    if r.get("gpu_gaps"):
        print("# profiled eager steps (torch.profiler, rank 0): GPU span per step, time per step no kernel ran, "
              "largest gaps (us, the kernel after the gap)")
        for m, g in r["gpu_gaps"].items():
            if g:
                print(f"#   {m:<24} span {g['span_ms']:.2f} ms, GPU idle {g['gpu_idle_ms']:.3f} ms; gaps {g['top_gaps_us'][:4]}")
    for v in r["grad_view"]:
        suffix = VIEW if v else ""
        if "torch DDP" + suffix not in modes:
            continue
        t_over = overhead("torch DDP" + suffix)[0]
        for m in modes:
            if m.startswith("pynccl DDP") and m.endswith(VIEW) == bool(v):
                ratio = overhead(m)[0] / t_over if t_over > 0 else float("nan")
                t_min = modes["torch DDP" + suffix]["min_ms"] - modes[FLOOR]["min_ms"]
                base_min = modes.get(FLOOR + " + graph" if "+ graph" in m else FLOOR, {}).get("min_ms", float("nan"))
                ratio_min = (modes[m]["min_ms"] - base_min) / t_min if t_min > 0 else float("nan")
                print(f"# gradient_as_bucket_view={views[v]}: {m} overhead / torch DDP{suffix} overhead = {ratio:.2f} "
                      f"(by minima {ratio_min:.2f}; target <= 0.5)")
    if ORACLE in modes and "torch DDP" in modes:
        t_over = overhead("torch DDP")[0]
        o_over = overhead(ORACLE)[0]
        print(f"# '{ORACLE}' (the same bytes all-reduced from backward's start, nothing exposed at its end) costs "
              f"{o_over:.3f} ms over the floor = {o_over / t_over if t_over > 0 else float('nan'):.2f} of torch DDP's "
              f"overhead: what NCCL's all-reduce kernels (default configuration) take from backward with nothing "
              f"exposed, the bound for a DDP that all-reduces these bytes with them")
    for m in modes:                                   # issue 10's measure at world size > 1
        if m.startswith("pynccl DDP") and "+ graph" not in m:
            ref = "torch DDP" + (VIEW if m.endswith(VIEW) else "")
            if ref in modes:
                print(f"# step time {m} / {ref} = {modes[m]['median_ms'] / modes[ref]['median_ms']:.3f} (medians; "
                      f"minima {modes[m]['min_ms'] / modes[ref]['min_ms']:.3f})")
    if "buckets" in r:
        print(f"\n# buckets of '{r['profiled_mode']}' (backward takes {r['backward_ms']:.2f} ms; 'ready at' = GPU time "
              f"from its start when the bucket's last gradient was made and the bucket handed on)")
        print(f"{'bucket':>6}{'params':>8}{'MiB':>9}{'ready at ms':>13}{'all-reduce us':>15}{'algbw GB/s':>12}"
              f"{'busbw GB/s':>12}")
        for b in r["buckets"]:
            ready = f"{b['ready_ms']:.2f}" if b["ready_ms"] is not None else "-"
            print(f"{b['bucket']:>6}{b['num_params']:>8}{b['mbytes']:>9.2f}{ready:>13}{b['allreduce_us']:>15.1f}"
                  f"{b['algbw_gbs']:>12.1f}{b['busbw_gbs']:>12.1f}")
        print("\n# pack kernel vs device-to-device copy (GB/s = bytes read + written per second)")
        print("# (a) all buckets at once: one pack launch PER BUCKET vs ONE copy of all the bytes (launch count differs)")
        copy = r["pack"]["device-to-device copy, all bytes, 1 launch"]["gbs"]
        for name, s in r["pack"].items():
            print(f"{name:<58}{s['ms']:>9.3f} ms{s['gbs']:>10.0f} GB/s{100 * s['gbs'] / copy:>8.1f}% of copy")
        rows = r["pack_per_bucket"]
        print("# (b) bucket by bucket: one pack (scale 1/world_size) / unpack launch vs one copy of that bucket's bytes "
              "(same launch count); % = copy time / kernel time")
        print(f"{'bucket':>6}{'tensors':>9}{'MiB':>9}{'pack us':>10}{'unpack us':>11}{'copy us':>10}{'pack %':>9}"
              f"{'unpack %':>10}")
        for b in rows:
            print(f"{b['bucket']:>6}{b['num_tensors']:>9}{b['mbytes']:>9.2f}{1e3 * b['pack_ms']:>10.1f}"
                  f"{1e3 * b['unpack_ms']:>11.1f}{1e3 * b['copy_ms']:>10.1f}{100 * b['copy_ms'] / b['pack_ms']:>8.1f}%"
                  f"{100 * b['copy_ms'] / b['unpack_ms']:>9.1f}%")
        pack_sum, unpack_sum, copy_sum = (sum(b[k] for b in rows) for k in ("pack_ms", "unpack_ms", "copy_ms"))
        print(f"# sum over buckets: pack {pack_sum:.3f} ms, unpack {unpack_sum:.3f} ms, copy {copy_sum:.3f} ms -> "
              f"pack {100 * copy_sum / pack_sum:.1f}% and unpack {100 * copy_sum / unpack_sum:.1f}% of copy bandwidth "
              f"(target >= 80%)")

def print_levers(r):
    """One row per lever: its window's floor, torch DDP and default pynccl DDP were timed in the
    same alternation, so each ratio compares modes measured side by side."""
    rows = r["levers"]
    print(f"\n# levers (--levers): each lever's mode alternated with the floor, torch DDP and default pynccl DDP "
          f"({r['lever_steps']} steps x {r['lever_repeats']} repetitions each); ms are medians. ratio = overhead "
          f"over floor / torch DDP's overhead in the same window (issue 19's target: <= 0.5); vs default = "
          f"lever step ms - default pynccl step ms")
    print(f"{'mode':<34}{'step ms':>9}{'floor ms':>10}{'torch ms':>10}{'over ms':>9}{'torch over':>11}{'ratio':>7}"
          f"{'vs default':>11}  lever")
    for row in rows:
        if row.get("skipped"):
            print(f"{row['mode']:<34}  skipped: {row['skipped']}")
            continue
        over, t_over = row["step_ms"] - row["floor_ms"], row["torch_ms"] - row["floor_ms"]
        ratio = over / t_over if t_over > 0 else float("nan")
        delta = row["step_ms"] - row["default_ms"] if row.get("default_ms") is not None else float("nan")
        print(f"{row['mode']:<34}{row['step_ms']:>9.2f}{row['floor_ms']:>10.2f}{row['torch_ms']:>10.2f}{over:>9.3f}"
              f"{t_over:>11.3f}{ratio:>7.2f}{delta:>+11.3f}  {row['why']}")
