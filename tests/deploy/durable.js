#!/usr/bin/env node
// Checkpoint and restart wiring of rendered manifests (tests/deploy/check.sh
// durable OVERLAY):
//   kubectl kustomize deploy/k8s/overlays/gpu | node tests/deploy/durable.js [-]
// Asserts what a job needs to survive preemption and the loss of a process:
// - the coordinator runs in a Job, the servers in an Indexed Job (or beside
//   the workers in their pods, as a sidecar: an initContainer with
//   restartPolicy Always, started again in place) and the workers in an
//   Indexed Job: each of them completes when the job is over;
// - their pods have restartPolicy Never, and each Job's podFailurePolicy
//   ignores a planned stop (the exit code of the container's
//   --exit_code_when_stopped, not 0) and the DisruptionTarget condition
//   (preemption, eviction, a drain), fails the Job at once on a refusal
//   (exit 2: a refused flag or train.json; 78: a finished run folder, a
//   checkpoint of another config) and counts a crash (1, 137), which is
//   retried: backoffLimit > 0 for the coordinator, backoffLimitPerIndex > 0
//   and maxFailedIndexes 0 for the servers and workers (each rank its own
//   budget; a rank out of retries fails the Job);
// - a server Job's pods are reachable at the name they advertise: their
//   subdomain is a headless Service that selects them, and --advertise_host
//   is <job>-$(INDEX).<subdomain> with INDEX the completion index, as --shard;
// - every pod's terminationGracePeriodSeconds covers the stop checkpoint:
//   at least 30 s plus the checkpoint's size (dim x (16 + 8 x workers)
//   bytes) at 100 MB/s (deploy/README.md, "Grace period");
// - the coordinator's training config (--config, from a mounted ConfigMap,
//   or --checkpoint_dir) names a checkpoint_dir, and checkpoint_every > 0;
// - the coordinator, every server and every worker mount one and the same
//   persistentVolumeClaim (the same claim, subPath and mountPath) at that
//   folder or above it, not read-only, and the claim is in the manifests
//   with ReadWriteMany (a StatefulSet's volumeClaimTemplates would give each
//   server a claim of its own).
// A missing backoffLimit counts as Kubernetes' default, 6. Exit 0: all fine;
// 1: a problem, printed as "<Kind>/<name> <container>: <what>"; 2: usage or
// input errors.
'use strict';

const path = require('path');
const {start, readDocuments, isObject, expandedArgv} = require('../../tools/k8s-common');

const die = start('durable');
const files = process.argv.slice(2);
if (files.length === 0) files.push('-');
const docs = readDocuments(files, die).map((d) => d.doc).filter(isObject);

const problems = [];
const nameOf = (obj) => `${obj.kind}/${obj.metadata && obj.metadata.name}`;

// [{obj, podSpec, container, argv}] for every container that runs `binary`.
function containersOf(binary) {
  const out = [];
  for (const obj of docs) {
    const s = obj.spec || {};
    const podSpec = obj.kind === 'Pod' ? s : s.template && s.template.spec;
    if (!podSpec) continue;
    for (const c of [...(podSpec.initContainers || []), ...(podSpec.containers || [])]) {
      const cmd = (c.command || []).map(String);
      if (!cmd.length || path.posix.basename(cmd[0]) !== binary) continue;
      out.push({obj, podSpec, container: c, raw: [...cmd.slice(1), ...(c.args || []).map(String)],
                argv: expandedArgv(c, docs).slice(1)});
    }
  }
  if (out.length === 0) problems.push(`no container runs ${binary}`);
  return out;
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

// A config key in underscore or dash spelling, or undefined.
function setting(cfg, name) {
  return cfg[name] !== undefined ? cfg[name] : cfg[name.replace(/_/g, '-')];
}

// The JSON config the coordinator reads with --config (a file of a mounted
// ConfigMap), or {} with a problem noted.
function coordinatorConfig({podSpec, container, argv}, where) {
  const file = flagValue(argv, 'config');
  if (!file) return {};
  for (const vm of container.volumeMounts || []) {
    if (path.posix.dirname(file) !== vm.mountPath.replace(/\/$/, '')) continue;
    const vol = (podSpec.volumes || []).find((v) => v.name === vm.name);
    if (!vol || !vol.configMap) continue;
    const cm = docs.find((d) => d.kind === 'ConfigMap' && d.metadata.name === vol.configMap.name);
    const text = cm && cm.data && cm.data[path.posix.basename(file)];
    if (text === undefined) break;
    try {
      return JSON.parse(text);
    } catch (e) {
      problems.push(`${where}: --config=${file}: not JSON: ${e.message}`);
      return {};
    }
  }
  problems.push(`${where}: --config=${file}: not a file of a mounted ConfigMap in the manifests`);
  return {};
}

// The first of `fields` that is set (backoffLimit: 6 where none is) must be > 0.
function checkBackoff(obj, where, fields) {
  const field = fields.find((f) => obj.spec[f] !== undefined) || 'backoffLimit';
  const limit = obj.spec[field] === undefined ? 6 : obj.spec[field];
  if (!(Number.isInteger(limit) && limit > 0)) {
    problems.push(`${where}: spec.${field} is ${limit}: a failed job would not be restarted (needs > 0)`);
  }
}

// Exit codes: a refusal (job/flags.cc's 2, onebit-coordinator's 78) fails
// the Job; a crash (1, or 137 for SIGKILL) is retried.
const REFUSED = [[2, 'a refused flag or train.json'],
                 [78, 'a finished run folder or a checkpoint of another config']];
const CRASHED = [1, 137];

// The action spec.podFailurePolicy takes on a pod whose container `name`
// exited with `code`: the first rule that matches, or Count.
function actionFor(job, name, code) {
  for (const r of ((job.spec.podFailurePolicy || {}).rules || [])) {
    const e = r.onExitCodes;
    if (!e || (e.containerName && e.containerName !== name)) continue;
    if ((e.operator === 'In') === (e.values || []).includes(code)) return r.action;
  }
  return 'Count';
}

// The restart and failure rules of the Job that runs container c.
const jobsChecked = new Set();
function checkFailurePolicy(c, where) {
  const job = c.obj;
  if (c.podSpec.restartPolicy !== 'Never') {
    problems.push(`${where}: restartPolicy is ${c.podSpec.restartPolicy}, not Never: a planned stop ` +
                  `(--exit_code_when_stopped) is restarted in place and counted as a failure ` +
                  `(spec.podFailurePolicy needs Never)`);
  }
  const stop = Number(flagValue(c.argv, 'exit_code_when_stopped') || 0);
  if (!(stop > 0)) {
    problems.push(`${where}: --exit_code_when_stopped is ${stop}: a job stopped after a checkpoint ` +
                  `would complete its pods, and the Job with them, instead of resuming`);
  } else if (actionFor(job, c.container.name, stop) !== 'Ignore') {
    problems.push(`${where}: exit ${stop} (--exit_code_when_stopped) is ` +
                  `${actionFor(job, c.container.name, stop)} in spec.podFailurePolicy, not Ignore: ` +
                  `every planned stop would use up the retry budget`);
  }
  for (const [code, what] of REFUSED) {
    const a = actionFor(job, c.container.name, code);
    if (a !== 'FailJob') {
      problems.push(`${where}: exit ${code} (${what}) is ${a} in spec.podFailurePolicy, not FailJob: ` +
                    `the Job would retry what is refused again`);
    }
  }
  for (const code of CRASHED) {
    const a = actionFor(job, c.container.name, code);
    if (a !== 'Count') {
      problems.push(`${where}: exit ${code} (a crash) is ${a} in spec.podFailurePolicy, not Count: ` +
                    `${a === 'Ignore' ? 'retried without end' : 'a failed job would not be restarted'}`);
    }
  }
  if (jobsChecked.has(job)) return;
  jobsChecked.add(job);
  const disruption = ((job.spec.podFailurePolicy || {}).rules || []).find((r) =>
    (r.onPodConditions || []).some((p) => p.type === 'DisruptionTarget' && (p.status || 'True') === 'True'));
  if (!disruption || disruption.action !== 'Ignore') {
    problems.push(`${nameOf(job)}: no spec.podFailurePolicy rule ignores the DisruptionTarget condition: ` +
                  `every preemption, eviction or drain would use up the retry budget`);
  }
}

// An Indexed Job's retries: per index, and one index out of them fails the Job.
function checkIndexBackoff(obj, where) {
  const perIndex = obj.spec.backoffLimitPerIndex;
  if (perIndex === undefined) {
    problems.push(`${where}: spec.backoffLimitPerIndex is not set: all ranks share spec.backoffLimit, ` +
                  `and each failure of the job costs one restart per rank`);
  } else if (!(Number.isInteger(perIndex) && perIndex > 0)) {
    problems.push(`${where}: spec.backoffLimitPerIndex is ${perIndex}: a failed job would not be restarted (needs > 0)`);
  }
  if (perIndex !== undefined && obj.spec.maxFailedIndexes !== 0) {
    problems.push(`${where}: spec.maxFailedIndexes is ${obj.spec.maxFailedIndexes}, not 0: a rank out of ` +
                  `retries would leave the Job running without it`);
  }
}

// Coordinator: a Job whose failures are retried.
const coordinators = containersOf('onebit-coordinator');
if (coordinators.length > 1) problems.push(`${coordinators.length} coordinator containers: a job has one`);
let checkpointDir;
let coordinatorWhere = '';
let coordinatorCfg = {};
let coordinatorArgv = [];
for (const c of coordinators) {
  const where = coordinatorWhere = `${nameOf(c.obj)} ${c.container.name}`;
  if (c.obj.kind !== 'Job') {
    problems.push(`${where}: the coordinator runs in a ${c.obj.kind}, not a Job (a finished job must not be started again)`);
  } else {
    checkBackoff(c.obj, where, ['backoffLimit']);
    checkFailurePolicy(c, where);
  }
  const cfg = coordinatorCfg = coordinatorConfig(c, where);
  coordinatorArgv = c.argv;
  const flag = flagValue(c.argv, 'checkpoint_dir');
  const fromCfg = setting(cfg, 'checkpoint_dir');
  if (flag !== undefined && fromCfg !== undefined && flag !== fromCfg) {
    problems.push(`${where}: --checkpoint_dir=${flag} but the config says "checkpoint_dir": "${fromCfg}"`);
  }
  checkpointDir = flag !== undefined ? flag : fromCfg;
  if (!checkpointDir) problems.push(`${where}: no checkpoint_dir in its config or flags`);
  const flagEvery = flagValue(c.argv, 'checkpoint_every');
  const every = flagEvery !== undefined ? flagEvery : setting(cfg, 'checkpoint_every');
  if (!(Number(every) > 0)) problems.push(`${where}: checkpoint_every is ${every}: the job never checkpoints`);
}
// A setting of the job: the coordinator's flag (expanded), else its config.
const jobSetting = (name, dflt) => {
  const f = flagValue(coordinatorArgv, name);
  const v = f !== undefined ? f : setting(coordinatorCfg, name);
  return v === undefined ? dflt : Number(v);
};

// Servers: an Indexed Job of their own, or beside the workers in their
// Indexed Job's pods.
const servers = containersOf('onebit-server');
const runsWorkers = (obj) => ((obj.spec.template && obj.spec.template.spec.containers) || [])
    .some((k) => (k.command || []).length && path.posix.basename(String(k.command[0])) === 'onebit-worker');
for (const c of servers) {
  const where = `${nameOf(c.obj)} ${c.container.name}`;
  if (c.obj.kind !== 'Job' || c.obj.spec.completionMode !== 'Indexed') {
    problems.push(`${where}: the servers run in a ${c.obj.kind}${c.obj.kind === 'Job' ? ' that is not Indexed' : ''}, ` +
                  `not an Indexed Job (nor beside the workers in theirs): ` +
                  `${c.obj.kind === 'Job' ? 'no shard per pod' : 'it never completes with the job'}`);
    continue;
  }
  if (runsWorkers(c.obj)) {
    // Beside the workers: a sidecar, started again in place when it exits
    // (the pod's fate is its worker's, checked below). A plain container
    // that exited would leave the pod running without its server until the
    // job gave up on it; a plain init container would keep the worker from
    // starting.
    const sidecar = (c.podSpec.initContainers || []).includes(c.container) && c.container.restartPolicy === 'Always';
    if (!sidecar) {
      problems.push(`${where}: a server beside the workers that is not a sidecar (an initContainer with ` +
                    `restartPolicy: Always): with the pod's restartPolicy Never, ` +
                    `${(c.podSpec.initContainers || []).includes(c.container) ? 'the worker would never start'
                                                                              : 'it would not be started again when it exits'}`);
    }
    continue;  // the workers' Job: checked below
  }
  checkFailurePolicy(c, where);
  checkIndexBackoff(c.obj, where);
  // The name it advertises must resolve to it: <job>-<index>.<subdomain>.
  const sub = c.podSpec.subdomain;
  const adv = flagValue(c.raw, 'advertise_host') || '';
  const shard = flagValue(c.raw, 'shard') || '';
  const indexVar = (v) => {
    const e = (c.container.env || []).find((x) => `$(${x.name})` === v);
    const f = e && e.valueFrom && e.valueFrom.fieldRef && e.valueFrom.fieldRef.fieldPath;
    return /batch\.kubernetes\.io\/job-completion-index/.test(f || '');
  };
  const m = adv.match(/^([a-z0-9-]+)-(\$\([A-Za-z_][A-Za-z0-9_]*\))\.([a-z0-9-]+)$/);
  if (!m || m[1] !== c.obj.metadata.name || m[3] !== sub || !indexVar(m[2]) || m[2] !== shard) {
    problems.push(`${where}: --advertise_host=${adv} is not its pod's DNS name ` +
                  `(${c.obj.metadata.name}-$(INDEX).${sub || '<spec.template.spec.subdomain>'}, INDEX the ` +
                  `completion index, as --shard=${shard}): the workers could not reach it`);
  } else {
    const svc = docs.find((d) => d.kind === 'Service' && d.metadata.name === sub);
    const labels = (c.obj.spec.template.metadata || {}).labels || {};
    if (!svc || (svc.spec || {}).clusterIP !== 'None' ||
        !Object.entries((svc.spec || {}).selector || {}).every(([k, v]) => labels[k] === v) ||
        !Object.keys((svc.spec || {}).selector || {}).length) {
      problems.push(`${where}: its subdomain ${sub} is not a headless Service that selects its pods: ` +
                    `${adv} would not resolve`);
    }
  }
}

// Workers: an Indexed Job that restarts failed ranks.
const workers = containersOf('onebit-worker');
for (const c of workers) {
  const where = `${nameOf(c.obj)} ${c.container.name}`;
  if (c.obj.kind !== 'Job' || c.obj.spec.completionMode !== 'Indexed') {
    problems.push(`${where}: the workers run in a ${c.obj.kind}, not an Indexed Job`);
  } else {
    checkIndexBackoff(c.obj, where);
    checkFailurePolicy(c, where);
  }
}

// The grace period covers the stop checkpoint: every process writes its
// state (the servers 16 bytes a parameter together, each worker 8) to the
// shared claim, at an assumed 100 MB/s, after up to 30 s to reach the step
// boundary and start.
{
  const dim = jobSetting('dim', 0);
  const n = jobSetting('workers', 1);
  const bytes = dim * (16 + 8 * n);
  const need = 30 + Math.ceil(bytes / 100e6);
  const seen = new Set();
  for (const c of [...coordinators, ...servers, ...workers]) {
    if (seen.has(c.obj)) continue;
    seen.add(c.obj);
    const grace = c.podSpec.terminationGracePeriodSeconds === undefined ? 30 : c.podSpec.terminationGracePeriodSeconds;
    if (grace < need) {
      problems.push(`${nameOf(c.obj)}: terminationGracePeriodSeconds is ${grace}, under the ${need} s that the ` +
                    `stop checkpoint needs (dim ${dim}, ${n} workers: ${(bytes / 1e9).toFixed(1)} GB at ` +
                    `100 MB/s, plus 30 s; deploy/README.md "Grace period"): it would be killed half written`);
    }
  }
}

// One claim, mounted alike by every process at or above checkpoint_dir.
if (checkpointDir) {
  const dir = path.posix.normalize(checkpointDir).replace(/(.)\/$/, '$1');
  let first = null;
  for (const c of [...coordinators, ...servers, ...workers]) {
    const where = `${nameOf(c.obj)} ${c.container.name}`;
    // The deepest mount at or above dir holds it.
    let vm = null;
    for (const m of c.container.volumeMounts || []) {
      const p = path.posix.normalize(m.mountPath).replace(/(.)\/$/, '$1');
      if ((dir === p || dir.startsWith(p === '/' ? '/' : `${p}/`)) && (!vm || p.length > vm.p.length)) vm = {m, p};
    }
    if (!vm) {
      problems.push(`${where}: mounts nothing at ${checkpointDir} (the checkpoint_dir of ${coordinatorWhere})`);
      continue;
    }
    if (vm.m.readOnly) problems.push(`${where}: mounts ${vm.p} read-only`);
    const vct = c.obj.kind === 'StatefulSet' &&
        (c.obj.spec.volumeClaimTemplates || []).some((t) => t.metadata && t.metadata.name === vm.m.name);
    const vol = (c.podSpec.volumes || []).find((v) => v.name === vm.m.name);
    if (vct || !vol || !vol.persistentVolumeClaim) {
      problems.push(`${where}: volume ${vm.m.name} at ${vm.p} is ${vct ? 'a volumeClaimTemplate (a claim per pod)' : 'not a persistentVolumeClaim'}, not the job's shared claim`);
      continue;
    }
    const mount = {claim: vol.persistentVolumeClaim.claimName, mountPath: vm.p, subPath: vm.m.subPath || ''};
    const text = `claim ${mount.claim} at ${mount.mountPath}${mount.subPath ? ` (subPath ${mount.subPath})` : ''}`;
    if (!first) {
      first = {mount, text, where};
      const pvc = docs.find((d) => d.kind === 'PersistentVolumeClaim' && d.metadata.name === mount.claim);
      if (!pvc) {
        problems.push(`${where}: PersistentVolumeClaim ${mount.claim} is not in the manifests`);
      } else if (!((pvc.spec && pvc.spec.accessModes) || []).includes('ReadWriteMany')) {
        problems.push(`PersistentVolumeClaim/${mount.claim}: accessModes ${JSON.stringify((pvc.spec || {}).accessModes)} lack ReadWriteMany (every process writes there)`);
      }
    } else if (JSON.stringify(mount) !== JSON.stringify(first.mount)) {
      problems.push(`${where}: mounts ${text}, but ${first.where} mounts ${first.text}`);
    }
  }
}

for (const p of problems) process.stdout.write(`${p}\n`);
if (problems.length) {
  process.stdout.write(`durable: ${problems.length} problem(s)\n`);
  process.exit(1);
}
process.stdout.write(`durable: coordinator, server and worker Jobs retry crashes, ignore planned stops, ` +
                     `fail on refusals, and share the checkpoints at ${checkpointDir}\n`);
