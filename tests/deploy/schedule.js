#!/usr/bin/env node
// The job as one unit on a shared cluster (tests/deploy/check.sh schedule OVERLAY):
//   kubectl kustomize deploy/k8s/overlays/gpu | node tests/deploy/schedule.js [-]
// Asserts, with no binaries needed:
// - size: the coordinator's workers and servers (its --workers/--servers,
//   expanded from env and ConfigMaps as the kubelet does, else its
//   train.json) equal the worker Job's completions and parallelism and the
//   servers' count (the server Job's completions and parallelism, or one
//   per worker pod where the servers run beside the workers);
// - lifecycle: every workload that runs an onebit binary is a Job (a
//   StatefulSet or Deployment never completes), with ttlSecondsAfterFinished
//   and the same Kueue queue label (kueue.x-k8s.io/queue-name);
// - disruption: every pod has a priorityClassName whose PriorityClass is in
//   the manifests, and the annotation
//   cluster-autoscaler.kubernetes.io/safe-to-evict: "false";
// - resources: every container sets cpu and memory requests equal to its
//   limits (Guaranteed QoS: the last to be evicted under node pressure);
// - probes: a liveness probe waits at least 5 s for an answer and gives up
//   only after at least 60 s of failures (a busy CPU answers late); a
//   coordinator's --metrics_linger ends before its liveness probe gives up
//   (the health port closes when the job ends, the metrics linger after);
// - images: a container's image is pinned by digest (@sha256:), or is pulled
//   only where the node lacks it (imagePullPolicy IfNotPresent or Never), so
//   a pod started again mid-job does not pull another build of its tag.
// Exit 0: all fine; 1: a problem, printed as "<Kind>/<name> <container>:
// <what>"; 2: usage or input errors.
'use strict';

const path = require('path');
const {start, readDocuments, isObject, expandedArgv} = require('../../tools/k8s-common');

const die = start('schedule');
const files = process.argv.slice(2);
if (files.length === 0) files.push('-');
const docs = readDocuments(files, die).map((d) => d.doc).filter(isObject);

const problems = [];
const nameOf = (obj) => `${obj.kind}/${obj.metadata && obj.metadata.name}`;
const QUEUE = 'kueue.x-k8s.io/queue-name';
const SAFE_TO_EVICT = 'cluster-autoscaler.kubernetes.io/safe-to-evict';

// Seconds of the absl duration flag --name (45s, 1m30s, 500ms) in argv;
// undefined where absent, NaN where not a duration.
function flagDuration(argv, name) {
  let v;
  for (let i = 0; i < argv.length; i++) {
    const m = argv[i].match(/^--?([A-Za-z0-9_-]+)(?:=(.*))?$/);
    if (m && m[1].replace(/-/g, '_') === name) v = m[2] !== undefined ? m[2] : argv[i + 1];
  }
  if (v === undefined) return undefined;
  const UNITS = {h: 3600, m: 60, s: 1, ms: 1e-3, us: 1e-6, ns: 1e-9};
  const parts = [...String(v).matchAll(/([0-9]*\.?[0-9]+)(h|ms|us|ns|m|s)/g)];
  if (v === '0') return 0;
  if (!parts.length || parts.map((p) => p[0]).join('') !== v) return NaN;
  return parts.reduce((t, p) => t + Number(p[1]) * UNITS[p[2]], 0);
}

function podOf(obj) {
  const s = obj.spec || {};
  if (obj.kind === 'Pod') return {spec: s, meta: obj.metadata || {}};
  if (s.template && s.template.spec) return {spec: s.template.spec, meta: s.template.metadata || {}};
  return null;
}

// The value of --name=V / --name V (dash or underscore spelling) in argv, or undefined.
function flagValue(argv, name) {
  for (let i = 0; i < argv.length; i++) {
    const m = argv[i].match(/^--?([A-Za-z0-9_-]+)(?:=(.*))?$/);
    if (!m || m[1].replace(/-/g, '_') !== name) continue;
    return m[2] !== undefined ? m[2] : argv[i + 1];
  }
  return undefined;
}

// Every object whose pods run an onebit binary, with its containers by role.
const workloads = [];
for (const obj of docs) {
  const pod = podOf(obj);
  if (!pod) continue;
  const roles = new Map();
  for (const c of [...(pod.spec.initContainers || []), ...(pod.spec.containers || [])]) {
    const cmd = (c.command || []).map(String);
    const bin = cmd.length ? path.posix.basename(cmd[0]) : '';
    if (bin.startsWith('onebit-')) roles.set(bin, c);
  }
  if (roles.size) workloads.push({obj, pod, roles});
}
if (!workloads.length) die('no workload runs an onebit-* binary');

// --- Size: one number of workers and one of servers ------------------------
const coordinator = workloads.find((w) => w.roles.has('onebit-coordinator'));
if (!coordinator) {
  problems.push('no container runs onebit-coordinator');
} else {
  const c = coordinator.roles.get('onebit-coordinator');
  const argv = expandedArgv(c, docs);
  // Its train.json, where --config names a file of a mounted ConfigMap.
  let cfg = {};
  const file = flagValue(argv, 'config');
  for (const vm of file ? c.volumeMounts || [] : []) {
    if (path.posix.dirname(file) !== vm.mountPath.replace(/\/$/, '')) continue;
    const vol = (coordinator.pod.spec.volumes || []).find((v) => v.name === vm.name);
    const cm = vol && vol.configMap && docs.find((d) => d.kind === 'ConfigMap' && d.metadata.name === vol.configMap.name);
    const text = cm && cm.data && cm.data[path.posix.basename(file)];
    try {
      if (text !== undefined) cfg = JSON.parse(text);
    } catch (e) { /* reported by the flags and durable checks */ }
  }
  const where = `${nameOf(coordinator.obj)} ${c.name}`;
  const size = (key) => {
    const f = flagValue(argv, key);
    if (f !== undefined) {
      if (!/^[0-9]+$/.test(f)) problems.push(`${where}: --${key}=${f}: not a number the manifests decide`);
      return {n: Number(f), from: `${where} --${key}`};
    }
    return {n: cfg[key] === undefined ? 1 : cfg[key], from: `${where} train.json "${key}"`};
  };
  const workers = size('workers');
  const servers = size('servers');
  let serverTotal = 0;
  const serverCounts = [];
  for (const w of workloads) {
    const spec = w.obj.spec || {};
    if (w.roles.has('onebit-worker')) {
      for (const field of ['completions', 'parallelism']) {
        if (spec[field] !== workers.n) {
          problems.push(`${nameOf(w.obj)}: spec.${field} is ${spec[field]}, but ${workers.from} says ${workers.n} workers`);
        }
      }
    }
    if (w.roles.has('onebit-server')) {
      const field = w.obj.kind === 'Job' ? 'completions' : 'replicas';
      const v = spec[field] === undefined ? 1 : spec[field];
      serverTotal += v;
      serverCounts.push(`${nameOf(w.obj)}: spec.${field} is ${v}`);
      if (w.obj.kind === 'Job' && spec.parallelism !== v) {
        problems.push(`${nameOf(w.obj)}: spec.parallelism is ${spec.parallelism}, not spec.completions ${v}: ` +
                      'the servers must all run at once');
      }
    }
  }
  if (serverCounts.length && serverTotal !== servers.n) {
    problems.push(`${serverCounts.join(', ')}, but ${servers.from} says ${servers.n} servers`);
  }
}

// --- Lifecycle, admission, disruption, resources, probes, images -----------
const queues = new Map();  // queue name -> first object
for (const {obj, pod, roles} of workloads) {
  const at = nameOf(obj);
  if (obj.kind !== 'Job') {
    problems.push(`${at}: runs ${[...roles.keys()].join(', ')} in a ${obj.kind}, not a Job: ` +
                  'it never completes when the job is over');
  } else {
    const ttl = obj.spec.ttlSecondsAfterFinished;
    if (!(Number.isInteger(ttl) && ttl > 0)) {
      problems.push(`${at}: no spec.ttlSecondsAfterFinished: the finished Job and its pods stay for ever`);
    }
  }
  const queue = ((obj.metadata || {}).labels || {})[QUEUE];
  if (!queue) {
    problems.push(`${at}: no label ${QUEUE}: Kueue would not admit it with the rest of the job`);
  } else {
    if (queues.size && !queues.has(queue)) {
      problems.push(`${at}: ${QUEUE} is ${queue}, but ${nameOf([...queues.values()][0])} has ${[...queues.keys()][0]}`);
    }
    if (!queues.has(queue)) queues.set(queue, obj);
  }
  const pc = pod.spec.priorityClassName;
  if (!pc) {
    problems.push(`${at}: no priorityClassName: its pods may be preempted for any other work`);
  } else if (!docs.some((d) => d.kind === 'PriorityClass' && d.metadata && d.metadata.name === pc)) {
    problems.push(`${at}: priorityClassName ${pc}: no such PriorityClass in the manifests`);
  }
  if ((pod.meta.annotations || {})[SAFE_TO_EVICT] !== 'false') {
    problems.push(`${at}: its pods lack the annotation ${SAFE_TO_EVICT}: "false": ` +
                  'a node scale-down would stop the whole job');
  }
  for (const c of [...(pod.spec.initContainers || []), ...(pod.spec.containers || [])]) {
    const where = `${at} ${c.name}`;
    const req = (c.resources || {}).requests || {};
    const lim = (c.resources || {}).limits || {};
    for (const r of ['cpu', 'memory']) {
      if (lim[r] === undefined) {
        problems.push(`${where}: no ${r} limit: not Guaranteed QoS`);
      } else if (req[r] !== undefined && String(req[r]) !== String(lim[r])) {
        problems.push(`${where}: ${r} request ${req[r]} is not its limit ${lim[r]}: not Guaranteed QoS ` +
                      '(evicted before others under node pressure)');
      }
    }
    const live = c.livenessProbe;
    if (live) {
      const timeout = live.timeoutSeconds === undefined ? 1 : live.timeoutSeconds;
      const period = live.periodSeconds === undefined ? 10 : live.periodSeconds;
      const failures = live.failureThreshold === undefined ? 3 : live.failureThreshold;
      if (timeout < 5) {
        problems.push(`${where}: livenessProbe.timeoutSeconds is ${timeout}: a busy CPU answers later ` +
                      'than that, and the kubelet would kill a working process (needs >= 5)');
      }
      if (period * failures < 60) {
        problems.push(`${where}: livenessProbe gives up after ${period * failures} s of failures ` +
                      '(periodSeconds x failureThreshold; needs >= 60)');
      }
    }
    // The coordinator closes its health port when the job ends and then
    // serves its metrics for --metrics_linger: a liveness probe that gives
    // up first kills the finished coordinator (a failed pod, a retry).
    const linger = flagDuration([...(c.command || []), ...(c.args || [])].map(String), 'metrics_linger');
    if (live && linger !== undefined) {
      const period = live.periodSeconds === undefined ? 10 : live.periodSeconds;
      const failures = live.failureThreshold === undefined ? 3 : live.failureThreshold;
      const budget = period * (failures - 1);
      if (Number.isNaN(linger)) {
        problems.push(`${where}: --metrics_linger is not a duration`);
      } else if (linger >= budget) {
        problems.push(`${where}: --metrics_linger of ${linger} s outlasts the liveness probe ` +
                      `(${budget} s: periodSeconds x (failureThreshold - 1)), which fails once the job has ` +
                      'ended and the health port closed: the kubelet would kill the finished coordinator');
      }
    }
    const image = String(c.image || '');
    if (!/@sha256:[0-9a-f]{64}$/.test(image) && !['IfNotPresent', 'Never'].includes(c.imagePullPolicy)) {
      problems.push(`${where}: image ${image} is not pinned by digest and imagePullPolicy is ` +
                    `${c.imagePullPolicy || 'the default'}: a pod started again mid-job could pull another build`);
    }
  }
}

for (const p of problems) process.stdout.write(`${p}\n`);
if (problems.length) {
  process.stdout.write(`schedule: ${problems.length} problem(s)\n`);
  process.exit(1);
}
process.stdout.write(`schedule: ${workloads.length} Jobs of one size, queue ${[...queues.keys()][0]}, ` +
                     'TTL, priority, Guaranteed QoS, patient probes, images pulled once\n');
