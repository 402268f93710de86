"""tools/project's model against figures computed by hand, and its reading
of a netbench run folder. Stdlib only; run by ctest as tools.project:

    /usr/bin/python3 tests/tools/project_test.py
"""
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


def costs(worker=2.0, push=1.0, apply=3.0, factor=1.0):
    phase = {"worker_ns": worker, "server_push_ns": push, "server_apply_ns": apply,
             "shared_factor": factor}
    table = {c: dict(phase) for c in ("fp32", "fp16", "onebit")}
    return {"plain": table, "secure": table, "shared_procs": 6,
            "ddp": {"adamw_ns": 10.0, "gloo_ns_per_byte": 0.5}}


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
        # gloo's CPU on what a rank sends and receives (0.5 ns a byte), then
        # AdamW on every rank (10 ns an element)
        self.assertAlmostEqual(parts["cpu"], 2 * 1.5 * 4 * D * 0.5e-9, places=12)
        self.assertAlmostEqual(t, parts["wire"] + parts["cpu"] + 10e-9 * D, places=9)


class Cpu(unittest.TestCase):
    def test_a_server_sums_each_push_of_its_shard_then_applies_once(self):
        lay = project.Layout(4, 2, False, cores_per_host=16, rate=None)
        _, _, parts = project.onebit_step(costs(push=1.0, apply=3.0), lay, D, "onebit", "onebit",
                                          0.0, False)
        self.assertAlmostEqual(parts["server"], (4 * 1.0 + 3.0) * 1e-9 * D / 2, places=12)
        self.assertAlmostEqual(parts["worker"], 2.0e-9 * D, places=12)

    def test_shared_cores_slow_down_only_past_one_process_a_core(self):
        c = costs(factor=1.5)
        two = project.Layout(1, 1, False, shared_cores=2)
        _, _, p2 = project.onebit_step(c, two, D, "fp32", "fp32", 0.0, False)
        alone = (2.0 + (1.0 + 3.0)) * 1e-9 * D / 2  # worker + server over 2 cores
        self.assertAlmostEqual(p2["cores"], alone, places=12)
        six = project.Layout(4, 2, False, shared_cores=2)  # the calibrated 6 processes
        _, _, p6 = project.onebit_step(c, six, D, "fp32", "fp32", 0.0, False)
        total = 4 * 2.0e-9 * D + 2 * (4 * 1.0 + 3.0) * 1e-9 * D / 2
        self.assertAlmostEqual(p6["cores"], total / 2 * 1.5, places=12)

    def test_the_step_is_forward_backward_plus_the_wire_plus_the_slower_cpu_stage_and_fill(self):
        lay = project.Layout(4, 4, True, cores_per_host=16, rate=GBIT)
        t, limit, parts = project.onebit_step(costs(), lay, D, "fp32", "fp32", 0.25, False)
        self.assertEqual(limit, "wire")
        # A shard of d/4 = 6 Mi elements in the warm-up's grid: chunks of an
        # eighth of it (768 Ki, under the 1 Mi cap), so 8 of them.
        self.assertEqual(project.chunks_per_shard(D / 4, compressed=False), 8)
        w, sv = parts["worker"], parts["server"]
        self.assertAlmostEqual(t, 0.25 + parts["wire"] + max(w, sv) + min(w, sv) / 8, places=12)

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


if __name__ == "__main__":
    unittest.main()
