"""What the benchmark prints and the JSON record it writes."""
import os
import statistics

from pipeline.files import write_json_atomic


def log(msg):
    print(msg, flush=True)


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt_spread(s, digits=0):
    return f"{s['median']:,.{digits}f} [{s['min']:,.{digits}f}-{s['max']:,.{digits}f}]"


def consumer(entry):
    """The consuming process's own CPU a sample (median over the runs): what caps one rank."""
    return statistics.median(r["cpu_main_s"] / r["samples"] * 1e6 for r in entry["runs"])


def table(entries):
    """One row per loader and worker count: medians with [min-max] over the repeats."""
    def ratio(e, base, metric):
        r = e["ratios"].get(f"vs_{base}", {}).get(metric)
        return fmt_spread(r, 2) if r else "-"

    head = (f"{'workers':>7} {'loader':<7} {'samples/s':>24} {'x A':>17} {'samples/cpu-s':>24} {'x A':>17}"
            f" {'x B':>17} {'x C':>17}  cores consumer  ceiling share")
    lines = [head, f"{'':>7} {'':<7} {'':>24} {'(samples/s)':>17} {'(per busy core)':>24} {'(per core)':>17}"
                   f" {'(per core)':>17} {'(per core)':>17}       us/sample   /s  /cpu-s"]
    order = {"LitData": 0, "Mosaic": 1, "A": 2, "B": 3, "C": 4, "C8": 5, "T": 6}
    for e in sorted(entries, key=lambda e: (e["workers"], e["encoding"] or "", order[e["method"]])):
        name = e["method"] + (f"/{e['encoding']}" if e["encoding"] else "")
        cores = statistics.median(r["busy_cores"] for r in e["runs"])
        lines.append(f"{e['workers']:>7} {name:<7} {fmt_spread(e['samples_per_s']):>24} "
                     f"{ratio(e, 'A', 'samples_per_s'):>17} {fmt_spread(e['samples_per_cpu_s']):>24} "
                     f"{ratio(e, 'A', 'samples_per_cpu_s'):>17} {ratio(e, 'B', 'samples_per_cpu_s'):>17} "
                     f"{ratio(e, 'C', 'samples_per_cpu_s'):>17}  {cores:.2f} {consumer(e):>9.3f}"
                     + (f"  {e['ceiling_share']:4.1%}  {e['ceiling_share_cpu']:5.1%}" if "ceiling_share" in e else ""))
    lines.append("A: the tutorial's torchvision loaders; B: stock webdataset (wds.RandomMix); C, C8: this stream, "
                 "float and uint8 batches; T: this stream over an image-text set (the CIFAR10 JPEGs with captions: "
                 "uint8 images and a caption a sample); LitData, Mosaic: those libraries over the raw pixels (x B, x C: "
                 "to B/raw, C/raw)")
    return "\n".join(lines)


def report(record):
    """The table, then memory, profile and ceiling as far as they were measured."""
    h = record["host"]
    log(f"\nhost: {h['cpus']} cpus, affinity {h['affinity']}, cgroup quota {h['cgroup_cpus']}, torch threads "
        f"{h['torch_threads']} (+{h['torch_interop_threads']} interop), "
        f"{'/proc children' if h['proc_children'] else 'ppid scan'}"
        + "".join(f", {k}={v}" for k, v in h["env"].items() if v is not None))
    cpu = h.get("cpu", {})
    log("cpu: " + (", ".join(f"{k} {v}" for k, v in cpu.items()) or "?"))
    runs = [r for e in record["throughput"] for r in e["runs"]]
    told = [r for r in runs if r.get("steal_share") is not None]
    stolen, busy = sum(r["steal_ticks"] for r in told), sum(r["busy_ticks"] for r in told)
    log(f"steal: {len(told)} of {len(runs)} runs could tell" + (
        f"; {stolen} of their {stolen + busy} busy and stolen ticks on this process's CPUs were stolen "
        f"({stolen / (stolen + busy) * 100:.1f}%)" if told else ""))
    log("\n" + table(record["throughput"]))
    if "memory" in record:
        base = record["memory"]["baseline"]["peak_rss_mib"]
        log(f"\npeak memory of the process tree (MiB; baseline imports-only {base:.0f} RSS)")
        log(f"{'loader':<8}{'RSS 1x':>9}{'RSS 10x':>9}{'10x/1x':>8}{'PSS 1x':>9}{'PSS 10x':>9}{'10x/1x':>8}")
        for e in record["memory"]["entries"]:
            name = e["method"] + (f"/{e['encoding']}" if e["encoding"] else "")
            one, ten = e["scale_1x"], e["scale_10x"]
            pss_ratio = f"{e['ratio_10x_1x_pss']:.2f}" if e["ratio_10x_1x_pss"] else "-"
            log(f"{name:<8}{one['peak_rss_mib']:>9.0f}{ten['peak_rss_mib']:>9.0f}{e['ratio_10x_1x']:>8.2f}"
                f"{one['peak_pss_mib']:>9.0f}{ten['peak_pss_mib']:>9.0f}{pss_ratio:>8}")
    for c in record.get("read_ceiling", []):
        log(f"read ceiling ({c['encoding']} shards, page cache): {fmt_spread(c['samples_per_s'])} samples/s, "
            f"{c['mb_per_s']:,.0f} MB/s")
    if "decoders" in record:
        log("\nJPEG decoders, us an image (median [min-max]); * = what pipeline.data.decoding.decode uses")
        for r in record["decoders"]:
            log(f"  {r['images']:<18} {r['decoder']:<28} {fmt_spread(r['us_per_image'], 1):>22} "
                f"{'*' if r['chosen'] else ''}")
    for prof in (record[k] for k in ("profile", "profile_c8") if k in record):
        log(f"\nprofile of {prof.get('method', 'C')}/{prof['encoding']}, workers=0, {prof['samples']} samples, "
            f"{prof['total_s']} s (under cProfile)\n{'tottime':>8} {'cumtime':>8} {'calls':>9}  function")
        for r in prof["top"]:
            log(f"{r['tottime_s']:>8.3f} {r['cumtime_s']:>8.3f} {r['calls']:>9}  {r['function']}")


def write_record(path, record):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json_atomic(path, record)
    log(f"wrote {path}")
