"""tools/project's model against figures computed by hand, and its reading
of a netbench run folder. Stdlib only; run by ctest as tools.project:

    /usr/bin/python3 tests/tools/project_test.py
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest
from importlib.machinery import SourceFileLoader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "project")
project = SourceFileLoader("project", TOOL).load_module()

D = 25165824
GBIT = 1e9 / 8


def costs(worker=2.0, push=1.0, apply=3.0, crowd=()):
    phase = {"worker_ns": worker, "server_push_ns": push, "server_apply_ns": apply,
             "crowd": [list(p) for p in crowd]}
    table = {c: dict(phase) for c in ("fp32", "fp16", "onebit")}
    return {"plain": table, "secure": table,
            "ddp": {"adamw_ns": 10.0, "gloo_ns_per_byte": 0.5, "gloo_fp16_ns_per_byte": 2.0,
                    "step_ns": 3.0, "step_fp16_ns": 7.0}}


class Wire(unittest.TestCase):
    def test_colocated_hosts_send_three_quarters_of_their_pushes_and_of_their_shards_replies(self):
        lay = project.Layout(4, 4, True, cores_per_host=16, rate=GBIT)
        _, _, parts = project.onebit_step(costs(), lay, D, "fp32", "fp32", 0.0, False)
        # out: 3/4 of 4d bytes of pushes + 3 replies of the d/4 shard at 4 bytes
        want = (0.75 * 4 * D + 3 * D) / (GBIT * 0.95)
        self.assertAlmostEqual(parts["wire"], want, places=9)
        self.assertAlmostEqual(parts["wire"], 1.27154, places=4)

    def test_dedicated_servers_carry_every_workers_push_of_their_shard(self):
        lay = project.Layout(4, 2, False, cores_per_host=16, rate=GBIT)
        _, _, parts = project.onebit_step(costs(), lay, D, "onebit", "onebit", 0.0, False)
        per_elem = 1 / 8 + 4 / 2048  # signs and one fp32 scale per 2048
        self.assertAlmostEqual(parts["wire"], 4 * D * per_elem / 2 / (GBIT * 0.95), places=9)

    def test_a_host_that_reduces_first_sends_one_kth_of_the_flat_bytes(self):
        flat = project.Layout(64, 8, True, k=8, cores_per_host=16, rate=GBIT)
        hier = project.Layout(64, 8, True, k=8, local_ranks=True, cores_per_host=16, rate=GBIT)
        w_flat = project.onebit_step(costs(), flat, D, "onebit", "onebit", 0.0, False)[2]["wire"]
        w_hier = project.onebit_step(costs(), hier, D, "onebit", "onebit", 0.0, False)[2]["wire"]
        self.assertAlmostEqual(w_flat / w_hier, 8.0, places=9)

    def test_local_rank_0_takes_the_hosts_mean_and_runs_the_whole_rule(self):
        # What --local_ranks builds: the slices form's bytes (one push per
        # host), but local rank 0 adds K gradients an element and runs the
        # worker rule on all of d; on a GPU each gradient crosses PCIe to
        # the host and the mean crosses back.
        args = dict(k=8, local_ranks=True, cores_per_host=16, rate=GBIT)
        slices = project.Layout(64, 8, True, **args)
        leader = project.Layout(64, 8, True, leader=True, **args)
        p_s = project.onebit_step(costs(worker=2.0), slices, D, "onebit", "onebit", 0.0, False)[2]
        p_l = project.onebit_step(costs(worker=2.0), leader, D, "onebit", "onebit", 0.0, False)[2]
        self.assertAlmostEqual(p_l["wire"], p_s["wire"], places=12)
        # The rule, the mean (8 adds), and three copies on the way: a
        # follower's gradient in, x out, a follower's x back.
        self.assertAlmostEqual(p_l["worker"], (2.0 + (8 + 3) * 0.27) * 1e-9 * D, places=12)
        # A host's 16 cores carry that, the 6 other followers' two copies
        # each, and its server's sums.
        server = (8 * 1.0 + 3.0) * 1e-9 * D / 8
        self.assertAlmostEqual(p_l["cores"], (p_l["worker"] + 12 * 0.27e-9 * D + server) / 16,
                               places=12)
        gpu = project.Layout(64, 8, True, leader=True, gpu=project.V100, **args)
        p_g = project.onebit_step(costs(), gpu, D, "onebit", "onebit", 0.0, False)[2]
        want = (9 * 4 * D / 900e9 + 2 * (1 / 8 + 4 / 2048) * D / 12e9  # the rule on the GPU
                + 8 * 0.27e-9 * D + 4 * 4 * D / 12e9)  # the mean, and four PCIe crossings
        self.assertAlmostEqual(p_g["worker"], want, places=12)

    def test_a_ring_allreduce_sends_2_n_minus_1_over_n_of_the_gradient(self):
        lay = project.Layout(4, 4, True, cores_per_host=16, rate=GBIT)
        t, limit, parts = project.ring_step(costs(), lay, D, "fp32", 0.0)
        self.assertAlmostEqual(parts["wire"], 1.5 * 4 * D / (GBIT * 0.95), places=9)
        self.assertEqual(limit, "wire")
        # gloo's CPU on what a rank sends and receives (0.5 ns a byte) and the
        # rest of its step (3 ns an element), then AdamW on every rank (10 ns
        # an element)
        self.assertAlmostEqual(parts["cpu"], 2 * 1.5 * 4 * D * 0.5e-9 + 3e-9 * D, places=12)
        self.assertAlmostEqual(t, parts["wire"] + parts["cpu"] + 10e-9 * D, places=9)
        # With the fp16 hook: half the bytes, gloo's fp16 sums, the hook's
        # conversions.
        _, _, p16 = project.ring_step(costs(), lay, D, "fp16", 0.0)
        self.assertAlmostEqual(p16["wire"], parts["wire"] / 2, places=9)
        self.assertAlmostEqual(p16["cpu"], 2 * 1.5 * 2 * D * 2e-9 + 7e-9 * D, places=12)

    def test_a_flat_ring_of_every_rank_still_crosses_each_host_once_each_way(self):
        # 4 hosts of 4 ranks: NCCL-like, the ring runs over the 4 hosts; as
        # gloo runs it, over all 16 ranks, a host's 4 next to each other.
        lay = project.Layout(16, 4, True, k=4, cores_per_host=16, rate=GBIT)
        _, _, hier = project.ring_step(costs(), lay, D, "fp32", 0.0)
        _, _, flat = project.ring_step(costs(), lay, D, "fp32", 0.0, flat=True)
        self.assertAlmostEqual(hier["wire"], 2 * 3 / 4 * 4 * D / (GBIT * 0.95), places=9)
        self.assertAlmostEqual(flat["wire"], 2 * 15 / 16 * 4 * D / (GBIT * 0.95), places=9)


class Cpu(unittest.TestCase):
    def test_a_server_sums_each_push_of_its_shard_then_applies_once(self):
        lay = project.Layout(4, 2, False, cores_per_host=16, rate=None)
        _, _, parts = project.onebit_step(costs(push=1.0, apply=3.0), lay, D, "onebit", "onebit",
                                          0.0, False)
        self.assertAlmostEqual(parts["server"], (4 * 1.0 + 3.0) * 1e-9 * D / 2, places=12)
        self.assertAlmostEqual(parts["worker"], 2.0e-9 * D, places=12)

    def test_shared_cores_slow_down_only_past_one_process_a_core(self):
        c = costs(crowd=[(6, 1.5), (12, 2.0)])
        two = project.Layout(1, 1, False, shared_cores=2)
        _, _, p2 = project.onebit_step(c, two, D, "fp32", "fp32", 0.0, False)
        alone = (2.0 + (1.0 + 3.0)) * 1e-9 * D / 2  # worker + server over 2 cores
        self.assertAlmostEqual(p2["cores"], alone, places=12)
        six = project.Layout(4, 2, False, shared_cores=2)  # a calibrated count: 6 processes
        _, _, p6 = project.onebit_step(c, six, D, "fp32", "fp32", 0.0, False)
        total = 4 * 2.0e-9 * D + 2 * (4 * 1.0 + 3.0) * 1e-9 * D / 2
        self.assertAlmostEqual(p6["cores"], total / 2 * 1.5, places=12)

    def test_the_crowd_joins_the_calibrated_points_and_holds_the_last(self):
        phase = {"crowd": [[6, 1.2, 0.001], [12, 1.5, 0.004], [24, 1.8, 0.004]]}
        f = project.crowd
        self.assertEqual(f(phase, 2, 2), (1.0, 0.0))  # no more processes than cores
        got = f(phase, 4, 2)  # halfway from (2, 1, 0) to (6, 1.2, 1 ms)
        self.assertAlmostEqual(got[0], 1.1)
        self.assertAlmostEqual(got[1], 0.0005)
        self.assertAlmostEqual(f(phase, 12, 2)[0], 1.5)
        self.assertAlmostEqual(f(phase, 16, 2)[0], 1.6)  # a third of the way to 24
        self.assertEqual(f(phase, 64, 2), (1.8, 0.004))  # beyond the last point: held
        self.assertEqual(f({}, 64, 2), (1.0, 0.0))  # costs from before the crowd calibration
        self.assertAlmostEqual(f({"crowd": [[6, 1.2]]}, 6, 2)[0], 1.2)  # without a per-step part

    def test_a_crowds_per_step_cpu_counts_once_per_process(self):
        base = project.Layout(4, 2, False, shared_cores=2)
        c0 = costs(crowd=[(6, 1.5, 0.0)])
        c1 = costs(crowd=[(6, 1.5, 0.002)])
        p0 = project.onebit_step(c0, base, D, "onebit", "onebit", 0.0, False)[2]
        p1 = project.onebit_step(c1, base, D, "onebit", "onebit", 0.0, False)[2]
        self.assertAlmostEqual(p1["cores"] - p0["cores"], 6 * 0.002 / 2, places=12)

    def test_a_message_costs_its_crowded_figure_once_processes_outnumber_the_cores(self):
        c = {"messages": {"plain": {"worker_us": 5.0, "server_us": 7.0}},
             "messages_crowded": {"plain": {"worker_us": 45.0, "server_us": 47.0, "procs": 16}}}
        self.assertEqual(project.message_costs(c, False, 2, 2)["worker_us"], 5.0)
        half = project.message_costs(c, False, 9, 2)  # 7 of the 14 processes past the cores
        self.assertAlmostEqual(half["worker_us"], 25.0)
        self.assertAlmostEqual(half["server_us"], 27.0)
        self.assertAlmostEqual(project.message_costs(c, False, 40, 2)["server_us"], 47.0)
        self.assertEqual(project.message_costs(c, False, None, None)["server_us"], 7.0)  # a cluster
        self.assertIsNone(project.message_costs(c, True, 40, 2))  # no secured figures
        # In a step: a worker of 4 x 2 on 2 cores sends and gets one message
        # per chunk of every shard, at the crowded cost for 6 processes.
        lay = project.Layout(4, 2, False, shared_cores=2)
        c.update(costs())
        _, _, parts = project.onebit_step(c, lay, 1 << 20, "onebit", "onebit", 0.0, False)
        chunks = project.chunks_per_shard((1 << 20) / 2, compressed=True)
        msg = 5.0 + 40.0 * 4 / 14
        self.assertAlmostEqual(parts["worker"], 2.0e-9 * (1 << 20) + 2 * 2 * chunks * msg * 1e-6,
                               places=12)

    def test_on_shared_cores_every_workers_forward_backward_is_cpu_of_the_pool(self):
        # 8 CPU workers on 2 cores compute their gradients 4 at a time, not
        # all at once beside the exchange.
        lay = project.Layout(8, 2, False, shared_cores=2)
        t0, _, p0 = project.onebit_step(costs(), lay, D, "onebit", "onebit", 0.0, False)
        t1, _, p1 = project.onebit_step(costs(), lay, D, "onebit", "onebit", 0.1, False)
        self.assertAlmostEqual(p1["cores"] - p0["cores"], 8 * 0.1 / 2, places=12)
        self.assertAlmostEqual(t1 - t0, 8 * 0.1 / 2, places=12)
        # On a cluster it comes before the exchange, once.
        host = project.Layout(8, 2, False, cores_per_host=16)
        u0, _, _ = project.onebit_step(costs(), host, D, "onebit", "onebit", 0.0, False)
        u1, _, _ = project.onebit_step(costs(), host, D, "onebit", "onebit", 0.1, False)
        self.assertAlmostEqual(u1 - u0, 0.1, places=12)

    def test_with_a_core_for_every_process_the_chunks_overlap_wire_and_cpu(self):
        lay = project.Layout(4, 4, True, cores_per_host=16, rate=GBIT)
        t, limit, parts = project.onebit_step(costs(), lay, D, "fp32", "fp32", 0.25, False)
        self.assertEqual(limit, "wire")
        # A shard of d/4 = 6 Mi elements in the warm-up's grid: chunks of an
        # eighth of it (768 Ki, under the 1 Mi cap), so 8 of them.
        self.assertEqual(project.chunks_per_shard(D / 4, compressed=False), 8)
        w, sv, wire = parts["worker"], parts["server"], parts["wire"]
        self.assertGreater(wire, max(w, sv, parts["cores"]))
        # The busiest resource (the wire), plus one chunk's share of every
        # other stage: encode and apply, the server's step, the reply's wire.
        self.assertAlmostEqual(t, 0.25 + wire + (w + sv + wire) / 8, places=12)

    def test_where_processes_outnumber_the_cores_the_wire_adds_to_the_cpu(self):
        lay = project.Layout(4, 4, True, shared_cores=2, rate=GBIT)
        t, _, parts = project.onebit_step(costs(), lay, D, "fp32", "fp32", 0.0, False)
        w, sv = parts["worker"], parts["server"]
        cpu = max(w, sv, parts["cores"] + parts["turns"])
        self.assertAlmostEqual(t, parts["wire"] + cpu + min(w, sv) / 8, places=12)
        # The same 8 processes with 8 cores: the transfers hide again.
        roomy = project.Layout(4, 4, True, shared_cores=8, rate=GBIT)
        t8, _, p8 = project.onebit_step(costs(), roomy, D, "fp32", "fp32", 0.0, False)
        busiest = max(p8["wire"], p8["worker"], p8["server"], p8["cores"])
        self.assertAlmostEqual(
            t8, busiest + (p8["worker"] + p8["server"] + 2 * p8["wire"] - busiest) / 8, places=12)

    def test_the_grids_follow_the_data_planes_rule(self):
        # warm-up: an eighth of the shard, at least 16 Ki, at most 1 Mi
        self.assertEqual(project.chunks_per_shard(1 << 16, compressed=False), 4)  # 16 Ki chunks
        self.assertEqual(project.chunks_per_shard(1 << 22, compressed=False), 8)
        # compressed: a quarter of the shard, at least 512 Ki
        self.assertEqual(project.chunks_per_shard(1 << 22, compressed=True), 4)
        self.assertEqual(project.chunks_per_shard(1 << 20, compressed=True), 2)


class Netbench(unittest.TestCase):
    def test_step_times_are_the_median_gaps_within_a_phase_without_the_hand_over(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "metrics.csv")
            with open(path, "w") as f:
                f.write("step,phase,loss,wall_s\n")
                walls = [0.5, 1.5, 2.6, 3.8, 7.8, 8.0, 8.3, 8.5, 8.7, 8.8]
                phases = ["warmup"] * 5 + ["compress"] * 5
                for i, (w, p) in enumerate(zip(walls, phases)):
                    f.write(f"{i},{p},1,{w}\n")
            got = project.gap_steps(path)
            # warm-up gaps 1.0, 1.1, 1.2 (step 4, the hand-over's 4.0, left out)
            self.assertAlmostEqual(got["warmup"], 1.1)
            # 0.3, 0.2, 0.2, 0.1 (the first compression step has no gap in its phase)
            self.assertAlmostEqual(got["compress"], 0.2)
            # Fewer than 3 gaps are no steady state: no figure.
            with open(path, "w") as f:
                f.write("step,phase,loss,wall_s\n0,warmup,1,0.5\n1,warmup,1,1.0\n2,warmup,1,1.5\n")
            self.assertEqual(project.gap_steps(path), {})


class Scale(unittest.TestCase):
    def run_folder(self, root, name, warm_gap):
        """A tools/scale output folder of one 4 x 4 run whose warm-up steps
        end warm_gap seconds apart (its step_s column says otherwise)."""
        d = os.path.join(root, name)
        os.makedirs(os.path.join(d, "colocated-n4"))
        with open(os.path.join(d, "scale.csv"), "w") as f:
            f.write("layout,workers,servers,status,warmup_step_ms,compress_step_ms\n")
            f.write("colocated,4,4,ok,999,999\n")
        with open(os.path.join(d, "colocated-n4", "command.txt"), "w") as f:
            f.write("onebit-launch --workers 4 --servers 4 --model synthetic --dim 65536\n")
        with open(os.path.join(d, "colocated-n4", "metrics.csv"), "w") as f:
            f.write("step,phase,loss,wall_s,bytes_up,bytes_down,step_s\n")
            for i in range(6):
                f.write(f"{i},warmup,1,{1 + i * warm_gap},0,0,9.0\n")
        return d

    def test_runs_of_one_configuration_give_their_median_period_against_the_model(self):
        with tempfile.TemporaryDirectory() as root:
            a = self.run_folder(root, "a", 0.010)
            b = self.run_folder(root, "b", 0.030)
            c = costs(worker=100.0, push=0.0, apply=0.0)
            c["synthetic_gradient_ns"] = 50.0
            path = os.path.join(root, "costs.json")
            with open(path, "w") as f:
                json.dump(c, f)
            r = subprocess.run([TOOL, "validate", "--costs", path, "--scale", a, b],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            row = [line for line in r.stdout.splitlines() if "warmup" in line]
            self.assertEqual(len(row), 1, r.stdout)
            # Measured: the median of the runs' periods (10 and 30 ms), not step_s.
            self.assertIn("20.0 ms (median of 2: 10.0 ms, 30.0 ms)", row[0])
            # Predicted: the 4 workers' rule and gradient (150 ns an element)
            # over the cores of the machine validating (where tools/scale's
            # runs are taken to have run); the servers cost nothing here. With
            # more than 4 cores one worker's own time is the larger.
            cores = os.cpu_count()
            if cores <= 4:
                want = 4 * 150e-9 * 65536 / cores
                self.assertIn(f"| {want * 1e3:.1f} ms |", row[0])


class Netbench(unittest.TestCase):
    def folder(self, root, data_cipher):
        """A netbench folder of one secured 1 x 1 adam run at 1 Gbit/s."""
        d = os.path.join(root, data_cipher)
        run = os.path.join(d, "synthetic", "adam", "run1")
        os.makedirs(run)
        with open(os.path.join(d, "config.env"), "w") as f:
            f.write(f"workers=1\nservers=1\nlocal_ranks=1\ncolocate=0\nrate=1gbit\nnproc=2\n"
                    f"dim=1048576\nsecure=1\ndata_cipher={data_cipher}\n")
        with open(os.path.join(run, "metrics.csv"), "w") as f:
            f.write("step,phase,loss,wall_s\n")
            for i in range(6):
                f.write(f"{i},warmup,1,{1 + i * 0.05}\n")
        return d

    def test_a_sealed_runs_rows_are_left_out_as_the_costs_are_curves(self):
        with tempfile.TemporaryDirectory() as root:
            path = os.path.join(root, "costs.json")
            with open(path, "w") as f:
                json.dump(costs(), f)
            curve, sealed = self.folder(root, "curve"), self.folder(root, "aes-gcm")
            r = subprocess.run([TOOL, "validate", "--costs", path, "--netbench", curve, sealed],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            rows = [line for line in r.stdout.splitlines() if "adam warmup" in line]
            self.assertEqual(len(rows), 1, r.stdout)
            self.assertIn("50.0 ms", rows[0])
            self.assertIn("secured", rows[0])
            self.assertIn("sealed with aes-gcm", r.stderr)


class Cli(unittest.TestCase):
    def test_predict_prints_every_phase_from_the_committed_costs(self):
        r = subprocess.run([TOOL, "predict", "--workers", "4", "--colocate", "--rate", "1gbit",
                            "--shared-cores", "2"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        for phase in ("fp32 PS", "fp16 warm-up", "1-bit compression", "ring allreduce fp32"):
            self.assertIn(phase, r.stdout)

    def test_a_bad_rate_is_named(self):
        r = subprocess.run([TOOL, "predict", "--workers", "4", "--rate", "fast"],
                           capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--rate 'fast'", r.stderr)

    def test_recalibrating_ddp_needs_a_costs_file_and_names_the_missing_one(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "none.json")
            r = subprocess.run([TOOL, "calibrate", "--only", "ddp", "--out", path],
                               capture_output=True, text=True)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn(f"no cost file {path} to update", r.stderr)
            self.assertFalse(os.path.exists(path))


if __name__ == "__main__":
    unittest.main()
