"""tools/netbench's report: OUT/report.md and its PNG plots (gnuplot) from the
run folders OUT/<model>/<system>/run<k>/ (metrics.csv as docs/design.md §2,
summary.json, nic_before.txt / nic_after.txt) and OUT/config.env.

    python3 tools/netbench.d/report.py OUT

Per run: the step time of each phase is the median of the gaps between
consecutive steps' ends (wall_s) within the phase, i.e. the whole step with
the gradient, and without step 0 (no gap before it), the hand-over step (onebit-ps's
last warm-up step, which also carries m and v) and the first step of the
compression phase; the time to the target is wall_s of the first test score
at or above it (rank 0 scores the test set every --eval-every steps on both
sides, inside the timed loop; gpt: the first validation loss at or below
it, from metrics.csv's test_loss column, which both sides fill with it);
bytes per step per worker are the systems'
own count: onebit-ps's payload (metrics.csv bytes_up + bytes_down over the
workers), DDP's as its rank 0's NIC counted them during the step (wire bytes:
with the TCP/IP headers); "wire" is every worker NIC's tx + rx over the whole
run (start-up included) per worker and step, the same measure for all.
Figures are medians over the runs; the ratios divide by DDP fp32's median.
"""
import csv
import json
import math
import os
import re
import statistics
import subprocess
import sys

out = sys.argv[1]
cfg = {}
with open(os.path.join(out, "config.env")) as f:
    for line in f:
        k, _, v = line.rstrip("\n").partition("=")
        cfg[k] = v
workers = int(cfg["workers"])
# The link rate in bytes per second ("1gbit", "100mbit").
_rate = re.fullmatch(r"([0-9.]+)([kmg]?)bit", cfg.get("rate", ""))
RATE_BYTES = (float(_rate.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[_rate.group(2)] / 8
              if _rate else None)
TARGET = {"mlp": float(cfg["target"]), "cnn": float(cfg.get("cnn_target", "0.87")),
          "gpt": float(cfg.get("gpt_target", "2.6"))}
TRAINED = ("mlp", "cnn", "gpt")  # the models with a score: time to the target
LOSS_SCORED = ("gpt",)  # scored by validation loss (lower is better), not test accuracy
SYSTEMS = [
    ("adam", "onebit-ps adam (fp32 PS)"),
    ("onebit-adam", "onebit-ps onebit-adam, freeze at 15 %"),
    ("onebit-adam-auto", "onebit-ps onebit-adam, auto freeze"),
    ("onebit-adam-fp16", "onebit-ps onebit-adam, fp16 warm-up, freeze at 15 %"),
    ("zero-one-adam", "onebit-ps zero-one-adam (its defaults)"),
    ("diloco", f"onebit-ps diloco, H = {cfg.get('diloco_h', '32')}"),
    ("diloco-overlap", f"onebit-ps diloco, H = {cfg.get('diloco_h', '32')}, each sync "
     f"overlapped with {cfg.get('diloco_delay', '?')} inner steps"),
    ("ddp", "DDP gloo fp32"),
    ("ddp-fp16", "DDP gloo fp16 hook"),
    ("ddp-powersgd", "DDP gloo PowerSGD hook (rank 2)"),
]
LABEL = dict(SYSTEMS)
models = cfg["models"].split()
systems = [s for s, _ in SYSTEMS if s in cfg["systems"].split()]  # the table's order


def median(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else None


def read_rows(d):
    with open(os.path.join(d, "metrics.csv")) as f:
        return list(csv.DictReader(f))


def nic_total(d):
    def read(name):
        with open(os.path.join(d, name)) as f:
            return [list(map(int, line.split())) for line in f if line.strip()]
    before, after = read("nic_before.txt"), read("nic_after.txt")
    return sum(a[0] - b[0] + a[1] - b[1] for a, b in zip(after, before))


def figures(d, onebit, target, by_loss=False):
    """The figures of one run folder, or None when it failed. by_loss: the
    score is test_loss (the gpt's validation loss), reached at or below target."""
    if os.path.exists(os.path.join(d, "FAILED")) or not os.path.exists(os.path.join(d, "metrics.csv")):
        return None
    rows = read_rows(d)
    if not rows:
        return None
    n = len(rows)
    wall = [float(r["wall_s"]) for r in rows]
    phase = [r["phase"] for r in rows]
    by = [(int(r["bytes_up"]) + int(r["bytes_down"])) / workers for r in rows]
    last_warm = max((i for i in range(n) if phase[i] == "warmup"), default=None)
    has_compress = any(p == "compress" for p in phase)
    # onebit-ps's last warm-up step also carries m and v (PowerSGD has no hand-over).
    handover = last_warm if (onebit and has_compress and last_warm is not None) else None
    f = {"steps": n, "wall": wall[-1]}

    def gaps(ph):
        out = []
        for i in range(1, n):
            if phase[i] == ph and phase[i - 1] == ph and i != handover:
                out.append(wall[i] - wall[i - 1])
        return out

    f["warm_step"] = median(gaps("warmup"))
    f["comp_step"] = median(gaps("compress"))
    f["handover_step"] = (wall[handover] - wall[handover - 1]) if handover else None
    f["freeze"] = next((i for i in range(n) if phase[i] == "compress"), None)
    warm_b = [by[i] for i in range(n) if phase[i] == "warmup" and i != handover]
    comp_b = [by[i] for i in range(n) if phase[i] == "compress"]
    f["warm_bytes"] = statistics.mean(warm_b) if warm_b else None
    f["comp_bytes"] = statistics.mean(comp_b) if comp_b else None
    f["bytes"] = statistics.mean(by)
    f["wire"] = nic_total(d) / workers / n
    col = "test_loss" if by_loss else "test_accuracy"

    def reached(v):
        return v <= target if by_loss else v >= target
    acc = [(i, wall[i], float(r[col])) for i, r in enumerate(rows) if r.get(col)]
    f["final_acc"] = acc[-1][2] if acc else None
    f["tta"] = next((w for _, w, a in acc if reached(a)), None)
    f["tta_step"] = next((i for i, _, a in acc if reached(a)), None)
    f["opt"] = None
    r0 = os.path.join(d, "rank0.csv")
    if os.path.exists(r0):  # DDP: the time of rank 0's AdamW step
        with open(r0) as fr:
            f["opt"] = median([float(r["opt_s"]) for r in csv.DictReader(fr)][2:])
    # onebit-worker's own measure of forward + backward per step (pushes
    # excluded), under the same load: the median over the workers.
    fb = []
    for name in sorted(os.listdir(d)):
        if name.startswith("worker") and name.endswith(".log"):
            with open(os.path.join(d, name), errors="replace") as fl:
                for line in fl:
                    m = re.search(r"forward \+ backward per step \(median ms\): warm-up (\S+), "
                                  r"compression (\S+)", line)
                    if m and m.group(2) != "-":
                        fb.append(float(m.group(2)) / 1e3)
    f["fwd_bwd"] = median(fb)
    # Where the compression step went: the workers' own medians of its
    # parts and the servers' of their arithmetic (their closing lines),
    # each the median over the processes.
    parts = {}
    for name in sorted(os.listdir(d)):
        if not name.endswith(".log"):
            continue
        with open(os.path.join(d, name), errors="replace") as fl:
            for line in fl:
                m = re.search(r"(step parts|per step) \(median ms\): .*compression (.*)$", line)
                if not m:
                    continue
                for part in m.group(2).split(", "):
                    key, _, value = part.rpartition(" ")
                    try:
                        parts.setdefault(("server " if m.group(1) == "per step" else "") + key,
                                         []).append(float(value) / 1e3)
                    except ValueError:
                        pass
    for key in ("gradient", "encode and send", "wait", "apply", "server arithmetic"):
        f["part " + key] = median(parts.get(key, []))
    return f


data = {}  # (model, system) -> {figure: median}, plus "_runs": [per-run figures]
for model in models:
    for s in systems:
        base = os.path.join(out, model, s)
        runs = sorted(r for r in os.listdir(base) if r.startswith("run")) if os.path.isdir(base) else []
        per = [figures(os.path.join(base, r), not s.startswith("ddp"), TARGET.get(model, 1.0),
                       model in LOSS_SCORED) for r in runs]
        ok = [p for p in per if p]
        med = {}
        if ok:
            for k in ok[0]:
                med[k] = median([p[k] for p in ok])
        med["_ok"], med["_runs"] = len(ok), len(per)
        data[(model, s)] = med


def ms(x):
    if x is None:
        return "—"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def secs(x):
    return "—" if x is None else f"{x:.1f} s"


def mb(x):
    if x is None:
        return "—"
    return f"{x / 1e6:.3f} MB" if x < 1e7 else f"{x / 1e6:.0f} MB"


def with_ratio(text, x, base):
    if x is None or base is None or base == 0:
        return text
    return f"{text} ({x / base:.2f})"


lines = []
put = lines.append
put("# onebit-ps against PyTorch DDP on an emulated network")
put("")
quick = cfg["quick"] == "1"
put(f"Made by `{cfg['command']}` on {cfg['date']} (commit {cfg['commit']}).")
put("")
layout = (f"{workers} hosts each running a worker and a server (--colocate)"
          if cfg.get("colocate") == "1" else f"{cfg['servers']} servers and {workers} workers")
local_ranks = int(cfg.get("local_ranks", "1"))
if local_ranks > 1:
    layout += (f", {local_ranks} processes on every worker host: "
               + (f"{workers * local_ranks} onebit-ps workers, each pushing its own (--flat)"
                  if cfg.get("flat") == "1" else
                  f"each onebit-ps worker {local_ranks} local ranks that push once (--local_ranks)")
               + f"; {workers * local_ranks} DDP ranks")
put(f"- **Machine:** {cfg['nproc']} CPU cores ({cfg['cpu']}), Linux {cfg['kernel']}. Every process "
    f"(the coordinator, {layout}, or {workers * local_ranks} DDP ranks) runs "
    f"on these same {cfg['nproc']} cores, each in its own network namespace, under nice {cfg['nice']}: "
    "the hosts are emulated, the CPUs are shared. Load average (1, 5, 15 min) at the start "
    f"{cfg.get('load_start', '?')}, at the end {cfg.get('load_end', '?')}: anything else running "
    "on the machine shows in the figures.")
put(f"- **Links:** every host's NIC (a veth on one Linux bridge) shaped to **{cfg['rate']}** each way "
    f"with tc tbf (burst {cfg['burst']} B, 10 ms queue); the DDP ranks run on the worker hosts.")
put(f"- **Runs:** every figure is the median over **{cfg['runs']} run(s)** of each configuration; in "
    "parentheses, the figure divided by DDP fp32's of the same benchmark (below 1: less time or "
    "fewer bytes than DDP fp32).")
put(f"- onebit-ps's planes are {('secured with a job secret (TLS + ' + ('AES-256-GCM sealed data plane' if cfg.get('data_cipher') == 'aes-gcm' else 'CURVE') + ')') if cfg['secure'] == '1' else 'plaintext (--insecure), like gloo'}; "
    "its servers keep their shard's Adam state, so its workers run no optimizer; DDP's ranks each "
    "run torch.optim.AdamW over the whole model.")
put("")
for model in models:
    base = data.get((model, "ddp"), {})
    b_step = base.get("warm_step")
    target = TARGET.get(model)
    if model in TRAINED:
        mt = f" (first {cfg['max_train']} training images)" if cfg["max_train"] != "0" else ""
    if model == "gpt":
        size = cfg.get("gpt_size", "default")
        put(f"## gpt: the byte-level GPT of examples/pytorch/gpt.py (size {size})")
        put("")
        put(f"{workers} workers x local batch 16 windows of 64 bytes of Debian's fortunes, "
            f"{cfg.get('gpt_steps', '?')} steps, peak lr 5e-3 on the script's warm-up (10 % of the "
            "steps) + cosine schedule, AdamW with its param groups (weight decay 0.1 on the Linear "
            "weights only) and bias correction on both sides, the gradient norm clipped at 1.0: "
            "onebit-ps through the PyTorch front (each worker clips its own gradient, then pushes "
            "it at step(): overlap=False), DDP through ddp_worker.py (clipping the averaged "
            "gradient), with the script's own model, initial weights and batches; freeze and "
            "PowerSGD start at 15 % of the steps. The validation loss (nats per byte on 256 "
            f"held-out windows, lower is better) every {cfg.get('gpt_eval_every', '?')} steps and "
            f"after the last. Time to loss: to the first validation loss ≤ {target}.")
        put("")
    if model == "cnn":
        put(f"## cnn: the PyTorch conv net of examples/pytorch/fashion_mnist_cnn.py{mt}")
        put("")
        epochs = int(cfg.get("cnn_epochs", "1"))
        n_cnn = epochs * ((int(cfg["max_train"]) or 60000) // (workers * 64))
        put(f"{workers} workers x local batch 64, {epochs} epoch(s) ({n_cnn} steps), lr 3e-3 on "
            "the script's cosine schedule, AdamW (no weight decay) with bias correction on both sides; "
            "onebit-ps through the PyTorch front (`onebit_ps.DistributedOptimizer`, pushes from "
            "backward hooks), DDP through ddp_worker.py, with the same layers, initial weights and data "
            f"order; test set scored every {cfg.get('cnn_eval_every', '?')} steps. On this machine "
            "the conv net's forward and backward take most of every step: it is compute-bound. "
            f"Time to accuracy: to the first score ≥ {target}.")
        put("")
    if model == "mlp":
        put(f"## mlp 784-256-128-10 on Fashion-MNIST{mt}")
        put("")
        put(f"{workers} workers x local batch 64, {cfg['steps']} steps, lr 1e-3, Adam's betas (0.9, 0.999), "
            "eps 1e-8, no weight decay, bias correction on both sides; the same initial weights and "
            "the same data order on both sides; test set scored every "
            f"{cfg['eval_every']} steps. Time to accuracy: to the first score ≥ {target}.")
        put("")
    if model in LOSS_SCORED:
        put("| system | warm-up step | compression step | hand-over step | freeze step | "
            f"time to loss ≤ {target} | steps to {target} | final val loss | total time | "
            "MB/step/worker warm-up | MB/step/worker compression | wire MB/step/worker |")
        put("|---|---|---|---|---|---|---|---|---|---|---|---|")
    elif model in TRAINED:
        put("| system | warm-up step | compression step | hand-over step | freeze step | "
            f"time to {target} | steps to {target} | final test acc | total time | "
            "MB/step/worker warm-up | MB/step/worker compression | wire MB/step/worker |")
        put("|---|---|---|---|---|---|---|---|---|---|---|---|")
    else:
        put(f"## synthetic, {int(cfg['dim']) / 1e6:.1f} M parameters")
        put("")
        put(f"{cfg['synthetic_steps']} steps. onebit-ps: the built-in synthetic model with "
            "--skip_model (zero gradients, no arithmetic); DDP: the parameters as 24 matrices "
            "(PowerSGD compresses matrices only) and loss sum(w * c) for a fixed random c per rank "
            "(the gradient is a copy of c). Both step times are the network's and the update's.")
        put("")
        put("| system | warm-up step | compression step | hand-over step | freeze step | total time | "
            "MB/step/worker warm-up | MB/step/worker compression | wire MB/step/worker | "
            "of the step: the worker's optimizer |")
        put("|---|---|---|---|---|---|---|---|---|---|")
    for s in systems:
        d = data[(model, s)]
        name = LABEL[s]
        cols = 12 if model in TRAINED else 10
        not_run = os.path.join(out, model, s, "NOT_RUN")
        if os.path.exists(not_run):
            with open(not_run) as f:
                put(f"| {name} | not run: {f.read().strip()} |" + " |" * (cols - 2))
            continue
        if not d.get("_ok"):
            put(f"| {name} | failed ({d['_runs']} run(s); see {model}/{s}/) |" + " |" * (cols - 2))
            continue
        if d["_ok"] < d["_runs"]:
            name += f" ({d['_ok']} of {d['_runs']} runs)"
        ref_step = b_step
        c = [name,
             with_ratio(ms(d["warm_step"]), d["warm_step"], ref_step),
             with_ratio(ms(d["comp_step"]), d["comp_step"], ref_step),
             ms(d["handover_step"]),
             "—" if d["freeze"] is None else str(int(d["freeze"]))]
        if model in TRAINED:
            final = "—" if d["final_acc"] is None else f"{d['final_acc']:.4f}"
            if model in LOSS_SCORED:
                final = with_ratio(final, d["final_acc"], base.get("final_acc"))
            c += [with_ratio(secs(d["tta"]), d["tta"], base.get("tta")),
                  "not reached" if d["tta_step"] is None else str(int(d["tta_step"]) + 1),
                  final]
        c += [with_ratio(secs(d["wall"]), d["wall"], base.get("wall")),
              with_ratio(mb(d["warm_bytes"]), d["warm_bytes"], base.get("warm_bytes")),
              with_ratio(mb(d["comp_bytes"]), d["comp_bytes"], base.get("warm_bytes")),
              with_ratio(mb(d["wire"]), d["wire"], base.get("wire"))]
        if model not in TRAINED:
            c.append("(on the servers)" if not s.startswith("ddp") else ms(d["opt"]))
        put("| " + " | ".join(c) + " |")
    breakdown = [s for s in systems if not s.startswith("ddp") and data[(model, s)].get("_ok")
                 and data[(model, s)].get("comp_step") is not None
                 and data[(model, s)].get("part wait") is not None]
    if breakdown:
        put("")
        put("Where a compression step goes (medians in ms: each part's over the workers' or the "
            "servers' own closing lines, so the parts need not add up to the step). *wait*: for "
            "the replies, i.e. the wire and the servers; *wire floor*: a worker host's bytes of "
            "the step, the larger direction, at the link rate.")
        put("")
        put("| system | step | gradient | encode and send | wait | apply | server arithmetic | "
            "wire floor |")
        put("|---|---|---|---|---|---|---|---|")
        rate = RATE_BYTES
        for s in breakdown:
            d = data[(model, s)]
            floor = d["comp_bytes"] / 2 / rate if d.get("comp_bytes") and rate else None
            put("| " + " | ".join([LABEL[s], ms(d["comp_step"])] + [
                ms(d.get("part " + k)) for k in ("gradient", "encode and send", "wait", "apply",
                                                   "server arithmetic")] + [ms(floor)]) + " |")
    fb = [data[(model, s)].get("fwd_bwd") for s in systems if not s.startswith("ddp")]
    fb = median([x for x in fb if x is not None])
    if fb is not None and model == "mlp":
        cores = int(cfg["nproc"])
        procs = workers * local_ranks
        floor = fb * procs / cores if procs > cores else fb
        put("")
        put(f"The compression step's floor on this machine: a worker's forward + backward alone takes "
            f"{ms(fb)} (onebit-worker's median, under the same load), and {procs} processes share "
            f"{cores} cores, so a step cannot be shorter than about {ms(floor)} before any "
            "encoding, server or network work.")
    put("")
    put(f"![step time per phase, {model}](step_time_{model}.png)")
    put(f"![bytes per step per phase, {model}](bytes_{model}.png)")
    if model in LOSS_SCORED:
        put(f"![validation loss against wall time, {model}](val_loss_{model}.png)")
    elif model in TRAINED:
        put(f"![test accuracy against wall time, {model}]({'accuracy' if model == 'mlp' else 'accuracy_' + model}.png)")
    put("")

put("## How to read it")
put("")
put("- *warm-up step*: onebit-ps's full-precision Adam steps (all of them for `adam`), DDP's fp32 "
    "allreduce steps (all of them for `ddp`; PowerSGD's vanilla allreduce before it starts). "
    "*compression step*: onebit-adam after the freeze, DDP with the fp16 hook (all steps) or "
    "with PowerSGD after its start. Both ratios divide by DDP fp32's step.")
put("- *hand-over step*: onebit-ps's last warm-up step, whose reply also carries m and v.")
put("- *MB/step/worker*: what one worker sends plus receives per step, as the system counts it: "
    "onebit-ps its payload, DDP its NIC (so DDP's include TCP/IP headers, some 3-5 %). "
    "*wire*: every worker NIC's bytes over the whole run, start-up included, per worker and "
    "step: the same measure for all systems (the ratio of the compression column divides by "
    "DDP fp32's warm-up bytes).")
put("- A DDP step ends when rank 0's optimizer step ends; a onebit-ps step when its replies are "
    "applied. Both include computing the gradient; rank 0's test scores fall inside the timed loop "
    "on both sides, so the step after a score is longer (the medians leave it out).")
if "gpt" in models:
    put("- *final val loss* (gpt): the last validation loss, in parentheses divided by DDP fp32's "
        "(above 1: worse). *time to loss*: wall_s of the first validation loss at or below the "
        "target (scored every --gpt-eval-every steps, so a multiple of that many steps).")
put("- Every run's folder is under `<model>/<system>/run<k>/` with the logs; its metrics.csv "
    "has a row per step.")
with open(os.path.join(out, "report.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


# The plots.
def gp_escape(s):
    return s.replace("'", "''")


script = ['set terminal pngcairo size 960,560 font ",11"', "set datafile separator comma",
          "set datafile missing 'NaN'", "set grid", "set key inside bottom right"]
for model in [m for m in models if m in TRAINED]:
    curves = []
    target = TARGET[model]
    by_loss = model in LOSS_SCORED
    column = 11 if by_loss else 12  # metrics.csv's test_loss, test_accuracy
    for s in systems:
        d = os.path.join(out, model, s, "run1")
        if os.path.exists(os.path.join(d, "metrics.csv")) and not os.path.exists(os.path.join(d, "FAILED")):
            curves.append(f"'{d}/metrics.csv' using 4:(${column} > 0 ? ${column} : 1/0) every ::1 "
                          f"with linespoints pointtype 7 pointsize 0.6 title '{gp_escape(LABEL[s])}'")
    if curves:
        if by_loss:
            png, what = f"val_loss_{model}.png", "validation loss"
        else:
            png, what = ("accuracy.png" if model == "mlp" else f"accuracy_{model}.png"), "test accuracy"
        script += [f"set output '{out}/{png}'",
                   f"set title '{model}: {what} against wall time ({cfg['rate']}, run 1)'",
                   "set xlabel 'wall time (s)'", f"set ylabel '{what}'",
                   "set key inside top right" if by_loss else "set key inside bottom right",
                   f"set arrow 1 from graph 0, first {target} to graph 1, first {target} nohead dashtype 2",
                   "plot " + ", ".join(curves), "unset arrow 1", "set key inside bottom right"]
for model in models:
    tab = os.path.join(out, f"bars_{model}.csv")
    shown = [s for s in systems if data[(model, s)].get("_ok")]
    with open(tab, "w") as f:
        f.write("system,warm_ms,comp_ms,warm_mb,comp_mb\n")
        for s in shown:
            d = data[(model, s)]

            def v(k, scale):
                return "NaN" if d.get(k) is None else f"{d[k] * scale:.6g}"
            f.write(f"\"{LABEL[s].replace('onebit-ps ', '').replace('DDP gloo ', 'DDP ')}\","
                    f"{v('warm_step', 1e3)},{v('comp_step', 1e3)},{v('warm_bytes', 1e-6)},{v('comp_bytes', 1e-6)}\n")
    common = ["set style data histograms", "set style histogram clustered gap 1",
              "set style fill solid 0.8 border -1", "set boxwidth 0.9", "set xtics rotate by -25",
              "set key outside top center horizontal", "set xlabel ''"]
    def bars(warm, comp):
        # A column with no value at all would only draw a warning.
        parts = []
        for col, key, title in ((warm[0], warm[1], "warm-up / fp32 step"),
                                (comp[0], comp[1], "compression step")):
            if any(data[(model, s)].get(key) is not None for s in shown):
                parts.append((col, title))
        if not parts:
            return None
        first = f"'{tab}' using {parts[0][0]}:xtic(1) every ::1 title '{parts[0][1]}'"
        rest = [f"'' using {c} every ::1 title '{t}'" for c, t in parts[1:]]
        return "plot " + ", ".join([first] + rest)

    script += common
    p = bars((2, "warm_step"), (3, "comp_step"))
    if p:
        script += [f"set output '{out}/step_time_{model}.png'",
                   f"set title '{model}: step time per phase ({cfg['rate']}, median of {cfg['runs']})'",
                   "set ylabel 'ms per step'", "unset logscale y", "set yrange [0:*]", p]
    p = bars((4, "warm_bytes"), (5, "comp_bytes"))
    if p:
        script += [f"set output '{out}/bytes_{model}.png'",
                   f"set title '{model}: MB per step per worker, sent + received ({cfg['rate']})'",
                   "set ylabel 'MB per step per worker (log)'", "set logscale y", "set yrange [*:*]", p]
    script += ["unset logscale y", "set yrange [*:*]", "set xtics norotate", "set key inside bottom right",
               "set style data lines"]
subprocess.run(["gnuplot"], input="\n".join(script) + "\n", text=True, check=True)
print(open(os.path.join(out, "report.md")).read())
